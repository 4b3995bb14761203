"""The generation requests in flight in this proxy, for ``GET /v1/status`` and traces.

``proxy.serving.serve`` opens one ``Tracked`` per request once it reached the worker
and closes it in a ``finally`` (``InFlight.open``/``close``); nothing here
runs per event. What a request is doing is read when someone asks
(``Tracked.view``), from the request's ``proxy.core.generation.Generation``: the
latest ``QueueProgress``/``PrefillProgress`` of choice 0 (kept whether or not
the client asked for progress), its ``Started``, tokens so far and its
``Finished`` events.

``InFlight.totals`` are counters since the proxy started, moved when a request
closes by what it did (its final usage, or what it got to before it failed or
its client left), so that the totals plus the in-flight requests' counts never
go backwards: a reader takes rates from two snapshots (``proxy.ops.status``).

``InFlight.listeners`` are called with every closed ``Tracked`` (traces:
``proxy.ops.tracing``); a listener's exception is logged, never raised into the
request.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from protocol.messages import PrefillProgress, QueueProgress
from proxy.core.generation import Generation
from proxy.errors import ProxyError
from proxy.ops.request_log import RequestRecord
from proxy.server.intake import KEY_DIGEST

log = logging.getLogger(__name__)


class Stage(enum.StrEnum):
    """Where a request is, in the order it gets there."""

    SUBMITTED = "submitted"  # sent to the worker, no event back yet
    QUEUED = "queued"  # waits in the worker's queue (a ``QueueProgress`` came)
    PREFILL = "prefill"  # admitted (``Started``), no token yet
    DECODE = "decode"  # a first token came
    DONE = "done"  # every choice finished; the response is being sent


@dataclass(frozen=True, slots=True)
class View:
    """What one request is doing now (``Tracked.view``). Tokens are counts, times
    seconds. ``prompt_tokens``/``cached_tokens`` are 0 before ``Started``;
    ``prefilled``: prompt tokens computed so far (``processed - cached`` of the
    latest progress; cached tokens cost no compute); ``completion_tokens`` summed
    over choices; ``draft_accepted``/``draft_rejected`` summed over the choices
    that finished, ``None`` until one did with drafting on (the worker reports
    them at a choice's end)."""

    stage: Stage
    queue: QueueProgress | None
    prefill: PrefillProgress | None
    prompt_tokens: int
    cached_tokens: int
    prefilled: int
    completion_tokens: int
    draft_accepted: int | None
    draft_rejected: int | None
    reasoning_tokens: int = 0
    thinking: bool = False
    """In decode, some choice is thinking (its latest tokens are its thinking)."""


@dataclass(eq=False, slots=True)
class Tracked:
    """One generation request in flight: ``request_id`` (the response's id),
    ``dialect`` (``Dialect.name``), ``endpoint`` (the route's path), ``stream``,
    ``choices``; ``record`` is its ``RequestRecord`` (``arrived``: monotonic
    seconds; ``error_code``); ``submitted_at``: ``time.monotonic()`` when its
    ``Submit``s were sent; ``submitted_ns``: ``time.time_ns()`` then (traces
    place the worker's timings after it); ``headers``: the HTTP request's
    (``traceparent``); ``model``: the served model's name; set by
    ``InFlight.close``: ``closed_at`` (monotonic) and ``error`` (why it ended
    without a whole answer: an error code, ``client_gone``; else ``None``);
    ``key``: the digest of the API key it came with (``None`` without keys),
    whose holder alone sees it in ``/v1/status``."""

    request_id: str
    model: str
    dialect: str
    endpoint: str
    stream: bool
    choices: int
    gen: Generation
    record: RequestRecord
    headers: Mapping[str, str]
    submitted_at: float = field(default_factory=time.monotonic)
    submitted_ns: int = field(default_factory=time.time_ns)
    closed_at: float | None = None
    error: str | None = None
    key: bytes | None = None

    def view(self) -> View:
        """The request's state now, read from its ``Generation``."""
        gen = self.gen
        counts = gen.running_counts()
        started = gen.choices[0].started
        prefill = gen.prefill
        if gen.done:
            stage = Stage.DONE
        elif gen.first_token_at is not None:
            stage = Stage.DECODE
        elif started is not None:
            stage = Stage.PREFILL
        elif gen.queue is not None:
            stage = Stage.QUEUED
        else:
            stage = Stage.SUBMITTED
        if gen.done or gen.first_token_at is not None:
            prefilled = counts.prompt_tokens - counts.cached_tokens
        elif prefill is not None:
            prefilled = prefill.processed - prefill.cached
        else:
            prefilled = 0
        accepted = rejected = None
        for c in gen.choices:
            f = c.finished
            if f is not None and f.draft_accepted is not None:
                accepted = (accepted or 0) + f.draft_accepted
                rejected = (rejected or 0) + (f.draft_rejected or 0)
        return View(
            stage,
            gen.queue if stage is Stage.QUEUED else None,
            prefill if stage is Stage.PREFILL else None,
            counts.prompt_tokens,
            counts.cached_tokens,
            max(prefilled, 0),
            counts.completion_tokens,
            accepted,
            rejected,
            sum(c.reasoning_tokens for c in gen.choices),
            stage is Stage.DECODE and any(c.thinking for c in gen.choices),
        )


@dataclass(slots=True)
class Totals:
    """Counters since the proxy started, over closed requests: ``requests``
    closed (``failed``: of them, with an error sent or a client gone),
    ``prompt_tokens``, ``cached_tokens``, ``prefilled_tokens`` (computed),
    ``completion_tokens``, ``draft_accepted``/``draft_rejected``."""

    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    completion_tokens: int = 0
    draft_accepted: int = 0
    draft_rejected: int = 0

    def add(self, v: View, failed: bool) -> None:
        """Count a closed request."""
        self.requests += 1
        self.failed += failed
        self.add_tokens(v)

    def add_tokens(self, v: View) -> None:
        """Add what ``v`` did so far (a request in flight, or closed by ``add``)."""
        self.prompt_tokens += v.prompt_tokens
        self.cached_tokens += v.cached_tokens
        self.prefilled_tokens += v.prefilled
        self.completion_tokens += v.completion_tokens
        self.draft_accepted += v.draft_accepted or 0
        self.draft_rejected += v.draft_rejected or 0


Listener = Callable[[Tracked], None]


class InFlight:
    """The registry: ``requests`` by id, in the order they were opened (at most
    ``max_in_flight`` of them: ``proxy.serving.serve`` opens one only after
    ``ProxyState.admit``), ``totals``, ``listeners``."""

    def __init__(self) -> None:
        self.requests: dict[str, Tracked] = {}
        self.totals = Totals()
        self.listeners: list[Listener] = []

    def open(
        self,
        request: web.Request,
        request_id: str,
        model: str,
        dialect: str,
        stream: bool,
        gen: Generation,
        record: RequestRecord,
    ) -> Tracked:
        """Track a request whose ``Submit``s were just sent."""
        t = Tracked(
            request_id,
            model,
            dialect,
            request.path,
            stream,
            len(gen.choices),
            gen,
            record,
            request.headers,
            key=request.get(KEY_DIGEST),
        )
        self.requests[request_id] = t
        return t

    def close(self, t: Tracked, exc: BaseException | None = None) -> None:
        """The request ended (any way): count it and tell the listeners. ``exc``
        is the exception on its way out of the request, if any (a ``ProxyError``,
        the cancellation of a client that left): its ``error``. (Passed, not read
        from ``sys.exception()``, which under ``serve`` still named an exception
        handled further up the stack, and counted every request as failed.)"""
        if self.requests.pop(t.request_id, None) is None:
            return
        t.closed_at = time.monotonic()
        t.error = _error_of(t, exc)
        self.totals.add(t.view(), t.error is not None)
        for listener in self.listeners:
            try:
                listener(t)
            except Exception:
                log.exception("in-flight listener %r failed for %s", listener, t.request_id)


def _error_of(t: Tracked, exc: BaseException | None) -> str | None:
    rec = t.record
    if isinstance(exc, ProxyError):
        return exc.code or exc.type
    if isinstance(exc, asyncio.CancelledError) or rec.client_gone:
        return "client_gone"
    if exc is not None:
        return type(exc).__name__
    if rec.error_code is not None:
        return rec.error_code
    return None if t.gen.done else "unfinished"


INFLIGHT: web.AppKey[InFlight] = web.AppKey("inflight", InFlight)
"""Where ``proxy.app.create_app`` keeps the app's ``InFlight``."""
