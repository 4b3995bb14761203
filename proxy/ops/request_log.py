"""One record per HTTP request: its log line and what it adds to the metrics.

``observe_middleware`` (the app's outermost middleware) gives every request a
``RequestRecord`` (``request[RECORD]``), which the handlers fill as the request
goes (its id, the completed response, an error sent after the headers). When the
request ends it writes one INFO line (``proxy.requests`` logger) and moves the
counters and histograms of ``proxy.ops.metrics``. This line replaces aiohttp's
access log: one line per request, never two.

Fields of the line (``protocol.logs``: ``key=value`` after the message in text,
top-level keys in JSON): ``method``, ``path``, ``endpoint`` (route),
``status`` (HTTP; 499 when the client left before the response ended), ``remote``,
``duration_s``, ``correlation_id`` (``RequestRecord.correlation_id``: the client's
``X-Request-Id``, else the server's id; also the response's ``X-Request-Id``
header, set by ``echo_request_id``), and for completion requests ``request_id``, ``stream``,
``prompt_tokens``, ``cached_tokens``, ``completion_tokens``, ``draft_accepted``,
``draft_rejected`` (``null`` without drafting), ``ttft_s``, ``decode_tps``
(completion tokens after each choice's first / decode seconds of the longest
choice), ``finish_reason`` (comma-joined over choices), and ``error`` (the
OpenAI error code) for a failure, in the body or as an error event.

Probes and ``/metrics`` (``proxy.server.probes.PROBE_PATHS``) are neither counted nor
logged at INFO; their line is DEBUG.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from protocol.logs import FIELDS
from protocol.messages import Finished
from proxy.core.usage import Counts
from proxy.errors import ProxyError
from proxy.ops.metrics import CompletedRequest, Metrics
from proxy.server.probes import PROBE_PATHS
from proxy.server.request_id import REQUEST_ID_HEADER, client_request_id

log = logging.getLogger("proxy.requests")

CLIENT_GONE = 499
"""Status recorded for a request whose client disconnected before its response
ended, a stream cut short included (nginx's "client closed request")."""


@dataclass(slots=True)
class RequestRecord:
    """What is known of one HTTP request; ``arrived`` is ``time.monotonic()``
    seconds. Handlers set ``request_id`` and ``stream``, then ``complete`` it
    once every choice finished, or ``error`` it. ``client_id``: the client's
    ``X-Request-Id`` (``proxy.server.request_id``), set by ``observe_middleware``."""

    arrived: float
    client_id: str | None = None
    request_id: str | None = None
    stream: bool | None = None
    error_code: str | None = None
    usage: Counts | None = None
    finished: tuple[Finished, ...] = ()
    first_token_at: float | None = None
    ended: float | None = None
    client_gone: bool = False  # the client's connection broke before the response ended
    server_id: str | None = None  # made when a request of no response id needs one

    def correlation_id(self) -> str:
        """The id that ties this request's log line, trace, status entry and
        response together: the client's ``X-Request-Id``, else the response's
        id (``request_id``: ``chatcmpl-...``), else (a request that failed before
        it got one, a route without one) 32 random hex digits, made once."""
        own = self.client_id or self.request_id or self.server_id
        if own is None:
            own = self.server_id = uuid.uuid4().hex
        return own

    def fail(self, exc: ProxyError) -> None:
        """An error was sent to the client (as a status or an error event)."""
        self.error_code = exc.code or exc.type

    def complete(self, usage: Counts, finished: list[Finished], first_token_at: float | None) -> None:
        """Every choice finished; ``usage`` is what the response's usage says."""
        self.usage = usage
        self.finished = tuple(finished)
        self.first_token_at = first_token_at
        self.ended = time.monotonic()

    def completed(self) -> CompletedRequest | None:
        """The metrics' view of a completed request, else ``None``."""
        usage, ended = self.usage, self.ended
        if usage is None or ended is None or not self.finished:
            return None
        first = self.finished[0]
        ttft_at = self.first_token_at if self.first_token_at is not None else ended
        return CompletedRequest(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            draft_accepted=usage.draft_accepted or 0,
            draft_rejected=usage.draft_rejected or 0,
            ttft=max(0.0, ttft_at - self.arrived),
            duration=max(0.0, ended - self.arrived),
            queue=first.time_queued,
            prefill=first.time_prefill,
            itl=tuple(
                f.time_decode / (f.completion_tokens - 1) for f in self.finished if f.completion_tokens > 1
            ),
            reasoning_tokens=usage.reasoning_tokens,
        )


RECORD: web.RequestKey[RequestRecord] = web.RequestKey("record", RequestRecord)
"""Where ``observe_middleware`` keeps the request's record."""

METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
"""The app's ``Metrics`` (set by ``proxy.app.create_app``)."""


def _endpoint(request: web.Request) -> str:
    # The route pattern, not the path: a label per distinct path would let
    # clients grow the metric's series without bound.
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _decode_tps(finished: tuple[Finished, ...]) -> float | None:
    tokens = sum(max(0, f.completion_tokens - 1) for f in finished)
    seconds = max((f.time_decode for f in finished), default=0.0)
    return round(tokens / seconds, 2) if tokens and seconds > 0 else None


def _fields(request: web.Request, rec: RequestRecord, endpoint: str, status: int) -> dict[str, object]:
    now = time.monotonic()
    fields: dict[str, object] = {
        "method": request.method,
        "path": request.path,
        "endpoint": endpoint,
        "status": status,
        "remote": request.remote,
        "duration_s": round(now - rec.arrived, 6),
        "correlation_id": rec.correlation_id(),
    }
    if rec.request_id is not None:
        fields["request_id"] = rec.request_id
        fields["stream"] = rec.stream
    usage = rec.usage
    if usage is not None:
        fields.update(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            reasoning_tokens=usage.reasoning_tokens,
            draft_accepted=usage.draft_accepted,
            draft_rejected=usage.draft_rejected,
            ttft_s=round((rec.first_token_at or now) - rec.arrived, 6),
            decode_tps=_decode_tps(rec.finished),
            finish_reason=",".join(str(f.finish_reason) for f in rec.finished),
        )
    if rec.error_code is not None:
        fields["error"] = rec.error_code
    return fields


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def observe_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Record, count and log every request but probes (module docstring).
    Outermost: it sees the status the error middleware chose, and the
    cancellation of a client that left."""
    if request.path in PROBE_PATHS:
        response = await handler(request)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s %d", request.method, request.path, response.status)
        return response
    rec = request[RECORD] = RequestRecord(time.monotonic(), client_request_id(request.headers))
    status = CLIENT_GONE
    try:
        response = await handler(request)
        status = CLIENT_GONE if rec.client_gone else response.status
        return response
    except web.HTTPException as e:  # redirects; errors became envelopes further in
        status = e.status
        raise
    finally:
        # Also on cancellation (the client went away): the request is still
        # counted and logged, then the CancelledError goes on.
        _finish(request, rec, status)


def _finish(request: web.Request, rec: RequestRecord, status: int) -> None:
    endpoint = _endpoint(request)
    metrics = request.app[METRICS]
    metrics.count_request(endpoint, status)
    if rec.error_code is not None:
        metrics.count_error(rec.error_code)
    done = rec.completed()
    if done is not None:
        metrics.observe_completed(done)
    if log.isEnabledFor(logging.INFO):
        log.info(
            "%s %s %d",
            request.method,
            request.path,
            status,
            extra={FIELDS: _fields(request, rec, endpoint, status)},
        )


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the response's ``X-Request-Id`` is the request's
    correlation id (``RequestRecord.correlation_id``), on every response but
    the probes', set as its headers go out, a stream's and an error's included."""
    rec = request.get(RECORD)
    if rec is not None:
        response.headers[REQUEST_ID_HEADER] = rec.correlation_id()


def record_of(request: web.Request) -> RequestRecord:
    """The request's record (a fresh, unattached one if the middleware did not
    run, as for handlers called directly)."""
    rec = request.get(RECORD)
    return rec if rec is not None else RequestRecord(time.monotonic())
