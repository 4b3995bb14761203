"""Exceptions of the proxy and their one translation into OpenAI's error envelope.

    ProxyError                          any failure a client is told about
     +-- InvalidRequest                 400 invalid_request_error: bad JSON, types, ranges, limits
     |    +-- ContextLengthExceeded     400, code "context_length_exceeded"
     |    +-- BadHttpRequest            400: the HTTP parser refused the request itself
     |    +-- RequestTimeout            408: the body did not arrive within ``body_read_timeout``
     |    +-- RequestTooLarge           413: the body is over the limit (``max_body_mb``)
     |    +-- UnsupportedMediaType      415: not ``application/json``, or a compressed body
     +-- InvalidApiKey                  401: API key missing or wrong (+ ``WWW-Authenticate``)
     +-- NotFound                       404 invalid_request_error: unknown route or model
     +-- QueueFull                      429: the worker's queue is full now (``Retry-After``)
     |    +-- TooManyRequests           429: ``ProxySettings.max_in_flight`` requests already running
     +-- ServiceUnavailable             503 server_error (``Retry-After``)
     |    +-- EngineNotReady            no worker handshake yet (or the worker is dead)
     |    +-- EngineUnavailable         the worker's input queue refused the request
     |    +-- EngineDead                the worker died or restarted with the request in flight
     |    +-- EngineOverloaded          the worker refused the request as overloaded
     |    +-- RequestAborted            the worker aborted the request (an Abort for it arrived)
     |    +-- ShuttingDown              the proxy is draining after SIGINT/SIGTERM
     +-- GatewayTimeout                 504, code "timeout": no worker event for ``request_idle_timeout``
     +-- StalledClient                  408: the client read nothing for ``stalled_client_timeout`` (cut)
     +-- EngineInternalError            500 server_error: the worker failed the request

Every exception carries its HTTP ``status``, the envelope fields ``type``,
``code`` and ``param``, ``retry_after`` (seconds for the ``Retry-After`` header
where a retry can succeed, else ``None``) and ``close`` (the connection is closed
after the response: the request body was not read). ``envelope``/``error_response``
are the only places that produce the envelope, ``from_request_error`` the only
place that maps the worker's ``RequestError`` codes, and ``from_http_exception``
the only place that maps aiohttp's own HTTP errors (unknown route, wrong method),
and ``FieldNames.rename`` the only place a field name is put in a dialect's terms.

``Retry-After`` values: 1 s when the server is full now (429 ``queue_full`` and
``too_many_requests``; 503 ``overloaded``, ``engine_unavailable``); 5 s while the
worker is not there (``engine_not_ready``, ``engine_dead``: a restart or a model
load takes seconds) and while draining (``shutting_down``: by then a load
balancer sends the retry to another replica).

Envelope (OpenAI API reference, error object; ``ErrorEnvelope``)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import msgspec
from aiohttp import web

from protocol.messages import ErrorCode, RequestError

NOT_READY_MESSAGE = "The engine worker is not ready (handshake pending, worker down or restarting)"

RETRY_FULL_S = 1
"""``Retry-After`` when the server is full now."""
RETRY_ABSENT_S = 5
"""``Retry-After`` while the worker is not there, or the proxy is draining."""


QUOTED_CHARS = 64
"""Most characters of a client's value an error message quotes (``quoted``)."""

MAX_MESSAGE_CHARS = 2000
"""Longest error message sent; a longer one (a validator quoting a whole value)
is cut, so an error body never grows with what the client sent."""


def quoted(value: object, limit: int = QUOTED_CHARS) -> str:
    """``value`` as an error message quotes it: its ``repr`` when a string of at
    most ``limit`` characters, else its first ``limit`` characters and how many
    there were (a 1 MB tool name gives a short error, not a 1 MB one)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit + 2 else text[: limit + 2] + "..."


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"


class ProxyError(Exception):
    """Base: a failure reported to the client as ``status`` + envelope. The
    message is at most ``MAX_MESSAGE_CHARS`` long; messages quote client values
    with ``quoted``."""

    status: int = 500
    type: str = "server_error"
    default_code: ClassVar[str | None] = None
    retry_after: ClassVar[int | None] = None
    close: ClassVar[bool] = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        message = _bounded(message)
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def headers(self) -> dict[str, str]:
        """Headers of the error response besides ``Content-Type``."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class InvalidRequest(ProxyError):
    """The request body is malformed or a parameter is out of range (400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt alone does not fit the model's context (400). A ``max_tokens``
    reaching past the context is not an error: generation stops at the context
    end with ``finish_reason: "length"``, as llama.cpp's server does."""

    default_code = "context_length_exceeded"


class BadHttpRequest(InvalidRequest):
    """aiohttp's HTTP parser refused the request (a line or header too long, too
    many headers, a bad ``Content-Length``, an invalid method); the status is
    the parser's."""

    default_code = "bad_http_request"
    close = True


class RequestTimeout(InvalidRequest):
    """The request body did not arrive in full within ``body_read_timeout`` (408)."""

    status = 408
    default_code = "request_timeout"
    close = True


class RequestTooLarge(InvalidRequest):
    """The request body is larger than the limit (``max_body_mb``) (413)."""

    status = 413
    default_code = "request_too_large"
    close = True


class UnsupportedMediaType(InvalidRequest):
    """The body is not ``application/json``, or is compressed (415)."""

    status = 415
    default_code = "unsupported_media_type"
    close = True


class InvalidApiKey(ProxyError):
    """API keys are configured and the request carries none of them (401)."""

    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(ProxyError):
    """Unknown route or model (404)."""

    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class QueueFull(ProxyError):
    """The worker's queue of waiting requests is full (its ``max_queue``) (429)."""

    status = 429
    type = "server_error"
    default_code = "queue_full"
    retry_after = RETRY_FULL_S


class ServiceUnavailable(ProxyError):
    """The request cannot be served now; retrying later may work (503)."""

    status = 503
    type = "server_error"
    default_code = "service_unavailable"
    retry_after = RETRY_FULL_S


class EngineNotReady(ServiceUnavailable):
    """The worker has not completed the handshake, speaks another protocol
    version, or was declared dead and has not come back yet."""

    default_code = "engine_not_ready"
    retry_after = RETRY_ABSENT_S


class EngineUnavailable(ServiceUnavailable):
    """Sending to the worker would block: its input queue is full or no worker
    is connected (ZeroMQ ``EAGAIN``)."""

    default_code = "engine_unavailable"


class EngineDead(ServiceUnavailable):
    """The worker stopped answering (heartbeat timeout, socket disconnect) or
    restarted while the request was in flight; the request's work is lost."""

    default_code = "engine_dead"
    retry_after = RETRY_ABSENT_S


class EngineOverloaded(ServiceUnavailable):
    """The worker refused the request because it is overloaded."""

    default_code = "overloaded"


class RequestAborted(ServiceUnavailable):
    """The worker ended the request on an ``Abort``: this proxy sends one only
    for a request whose client is gone, so a live request seeing it was aborted
    by another client of the worker socket, and a retry can succeed."""

    default_code = "aborted"


class TooManyRequests(QueueFull):
    """``ProxySettings.max_in_flight`` requests are already being served: full now,
    so 429 like a full worker queue, and a retry later can succeed."""

    default_code = "too_many_requests"


class ShuttingDown(ServiceUnavailable):
    """The proxy stopped admitting requests (SIGINT/SIGTERM), or aborted this
    one when the drain period (``ProxySettings.shutdown_drain``) ran out."""

    default_code = "shutting_down"
    retry_after = RETRY_ABSENT_S


class GatewayTimeout(ProxyError):
    """No event from the worker for ``request_idle_timeout`` seconds; the
    request's engine work is aborted (504)."""

    status = 504
    default_code = "timeout"


class StalledClient(ProxyError):
    """The client took none of its response's bytes for ``stalled_client_timeout``
    seconds, or its unread backlog grew past ``max_stream_buffer_mb``: its
    connection is cut (nothing more can reach it), its engine work aborted."""

    status = 408
    type = "invalid_request_error"
    default_code = "stalled_client"


class EngineInternalError(ProxyError):
    """The worker failed the request with an internal error (500)."""

    default_code = "internal_error"


_encode = msgspec.json.Encoder().encode


class ErrorDetail(msgspec.Struct, gc=False):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(msgspec.Struct, gc=False):
    """OpenAI's error body, also sent as the last SSE event of a failed stream."""

    error: ErrorDetail


def envelope(exc: ProxyError) -> ErrorEnvelope:
    """The OpenAI error envelope of ``exc`` (shape in the module docstring)."""
    return ErrorEnvelope(ErrorDetail(exc.message, exc.type, exc.param, exc.code))


class ErrorShape(Protocol):
    """How a dialect writes an error body (``proxy.dialects``)."""

    def body(self, exc: ProxyError) -> bytes:
        """The JSON body of ``exc``."""
        ...


class OpenAIErrors:
    """OpenAI's envelope: the shape of the OpenAI dialects and of every route
    that belongs to no dialect (probes, models, unknown routes, requests the
    HTTP parser refuses)."""

    __slots__ = ()

    def body(self, exc: ProxyError) -> bytes:
        return _encode(envelope(exc))


OPENAI_ERRORS: ErrorShape = OpenAIErrors()


def error_response(exc: ProxyError, shape: ErrorShape = OPENAI_ERRORS) -> web.Response:
    """A JSON response with ``exc.status``, its body in ``shape`` and its
    headers; it closes the connection when ``exc.close``."""
    resp = web.Response(
        status=exc.status, body=shape.body(exc), content_type="application/json", headers=exc.headers()
    )
    if exc.close:
        resp.force_close()
    return resp


_HEAD = re.compile(r"^[A-Za-z_]+")


@dataclass(frozen=True, slots=True)
class FieldNames:
    """A dialect's names for the fields the core and the worker name in errors.

    ``names`` maps a wire name (chat completions': ``messages``, ``max_tokens``,
    ``stop``, ``logprobs``, ``response_format``, ``tool_choice``, ``prompt``)
    to the dialect's (Responses: ``input``, ``max_output_tokens``; Messages:
    ``stop_sequences``, ``output_config.format``). A name not listed is the
    dialect's too. ``renumbered`` lists the wire names whose indices do not
    match the dialect's (Responses' ``input[i]`` items are not chat's
    ``messages[i]``): their index and what follows are dropped rather than
    given wrong."""

    names: Mapping[str, str] = field(default_factory=dict)
    renumbered: frozenset[str] = frozenset()

    def rename(self, exc: ProxyError) -> ProxyError:
        """``exc`` with its ``param`` and the names quoted in its message in
        the dialect's terms (changed in place: an error is raised once)."""
        if not self.names:
            return exc
        param = exc.param
        if param is not None:
            m = _HEAD.match(param)
            head = m.group(0) if m else ""
            if head in self.names:
                rest = "" if head in self.renumbered else param[len(head) :]
                exc.param = self.names[head] + rest
                # The worker writes "max_tokens must be >= 1": the head unquoted.
                exc.message = re.sub(rf"^{head}\b", self.names[head], exc.message)
        for wire, own in self.names.items():
            exc.message = exc.message.replace(f"'{wire}'", f"'{own}'")
        exc.args = (exc.message,)
        return exc


SAME_NAMES = FieldNames()
"""For a dialect whose names are the wire's (chat and text completions)."""


def from_request_error(ev: RequestError) -> ProxyError:
    """Map a worker ``RequestError`` to the exception that carries its status:
    invalid_request and context_length_exceeded -> 400, queue_full -> 429,
    overloaded and aborted -> 503, internal_error -> 500."""
    if ev.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED:
        return ContextLengthExceeded(ev.message, param=ev.param)
    if ev.code is ErrorCode.INVALID_REQUEST:
        return InvalidRequest(ev.message, param=ev.param)
    if ev.code is ErrorCode.QUEUE_FULL:
        return QueueFull(ev.message, param=ev.param)
    if ev.code is ErrorCode.OVERLOADED:
        return EngineOverloaded(ev.message, param=ev.param)
    if ev.code is ErrorCode.ABORTED:
        return RequestAborted(ev.message, param=ev.param)
    return EngineInternalError(ev.message, param=ev.param)


def from_http_exception(exc: web.HTTPException) -> ProxyError:
    """An aiohttp HTTP error (404 unknown route, 405, ...) as a ``ProxyError``
    keeping its status."""
    status = exc.status
    cls: type[ProxyError]
    if status == 404:
        cls = NotFound
    elif 400 <= status < 500:
        cls = InvalidRequest
    else:
        cls = ProxyError
    text = exc.text or ""
    err = cls(exc.reason if not text or text.startswith(f"{status}:") else text)
    err.status = status
    if status == 405:
        err.code = "method_not_allowed"
    return err
