"""Exceptions of the proxy and their one translation into OpenAI's error envelope.

    ProxyError                        any failure a client is told about
     +-- InvalidRequest               400 invalid_request_error: bad JSON, types, ranges
     |    +-- ContextLengthExceeded   400, code "context_length_exceeded"
     +-- NotFound                     404 invalid_request_error: unknown route or model
     +-- ServiceUnavailable           503 server_error
     |    +-- EngineNotReady          no worker handshake yet (or the worker is dead)
     |    +-- EngineUnavailable       the worker's input queue refused the request
     |    +-- EngineDead              the worker died or restarted with the request in flight
     |    +-- EngineOverloaded        the worker refused the request as overloaded
     |    +-- TooManyRequests         ``ProxySettings.max_in_flight`` requests already running
     |    +-- ShuttingDown            the proxy is draining after SIGINT/SIGTERM
     +-- EngineInternalError          500 server_error: the worker failed the request

Every exception carries its HTTP ``status`` and the envelope fields ``type``,
``code`` and ``param``. ``envelope``/``error_response`` are the only places that
produce the envelope, ``from_request_error`` the only place that maps the
worker's ``RequestError`` codes, and ``from_http_exception`` the only place that
maps aiohttp's own HTTP errors (unknown route, wrong method, body too large).

Envelope (OpenAI API reference, error object; ``proxy.responses.ErrorEnvelope``)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}
"""

from __future__ import annotations

from typing import ClassVar

from aiohttp import web

from protocol.messages import ErrorCode, RequestError
from proxy.responses import ErrorDetail, ErrorEnvelope, encode

NOT_READY_MESSAGE = "The engine worker is not ready (handshake pending, worker down or restarting)"


class ProxyError(Exception):
    """Base: a failure reported to the client as ``status`` + envelope."""

    status: int = 500
    type: str = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code


class InvalidRequest(ProxyError):
    """The request body is malformed or a parameter is out of range (400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt alone does not fit the model's context (400). A ``max_tokens``
    reaching past the context is not an error: generation stops at the context
    end with ``finish_reason: "length"``, as llama.cpp's server does."""

    default_code = "context_length_exceeded"


class NotFound(ProxyError):
    """Unknown route or model (404)."""

    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ServiceUnavailable(ProxyError):
    """The request cannot be served now; retrying later may work (503)."""

    status = 503
    type = "server_error"
    default_code = "service_unavailable"


class EngineNotReady(ServiceUnavailable):
    """The worker has not completed the handshake, speaks another protocol
    version, or was declared dead and has not come back yet."""

    default_code = "engine_not_ready"


class EngineUnavailable(ServiceUnavailable):
    """Sending to the worker would block: its input queue is full or no worker
    is connected (ZeroMQ ``EAGAIN``)."""

    default_code = "engine_unavailable"


class EngineDead(ServiceUnavailable):
    """The worker stopped answering (heartbeat timeout, socket disconnect) or
    restarted while the request was in flight; the request's work is lost."""

    default_code = "engine_dead"


class EngineOverloaded(ServiceUnavailable):
    """The worker refused the request because it is overloaded."""

    default_code = "overloaded"


class TooManyRequests(ServiceUnavailable):
    """``ProxySettings.max_in_flight`` requests are already being served."""

    default_code = "too_many_requests"


class ShuttingDown(ServiceUnavailable):
    """The proxy stopped admitting requests (SIGINT/SIGTERM), or aborted this
    one when the drain period (``ProxySettings.shutdown_drain``) ran out."""

    default_code = "shutting_down"


class EngineInternalError(ProxyError):
    """The worker failed the request with an internal error (500)."""

    default_code = "internal_error"


def envelope(exc: ProxyError) -> ErrorEnvelope:
    """The OpenAI error envelope of ``exc`` (shape in the module docstring)."""
    return ErrorEnvelope(ErrorDetail(exc.message, exc.type, exc.param, exc.code))


def error_response(exc: ProxyError) -> web.Response:
    """A JSON response with ``exc.status`` and its envelope as the body."""
    return web.Response(status=exc.status, body=encode(envelope(exc)), content_type="application/json")


def from_request_error(ev: RequestError) -> ProxyError:
    """Map a worker ``RequestError`` to the exception that carries its status:
    invalid_request and context_length_exceeded -> 400, overloaded -> 503,
    internal_error -> 500."""
    if ev.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED:
        return ContextLengthExceeded(ev.message, param=ev.param)
    if ev.code is ErrorCode.INVALID_REQUEST:
        return InvalidRequest(ev.message, param=ev.param)
    if ev.code is ErrorCode.OVERLOADED:
        return EngineOverloaded(ev.message, param=ev.param)
    return EngineInternalError(ev.message, param=ev.param)


def from_http_exception(exc: web.HTTPException) -> ProxyError:
    """An aiohttp HTTP error (404 unknown route, 405, 413 body too large, ...)
    as a ``ProxyError`` keeping its status."""
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
