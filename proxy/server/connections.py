"""What one client's connections may cost the others, below the HTTP layer.

``proxy.server.runner`` serves every connection with these rules (its
``EnvelopeRequestHandler`` and protocol factory):

- **A cap on open connections** (``ProxySettings.connection_cap()``, below the
  open-file limit). A connection over the cap is still accepted, but may only
  ask one of ``PROBE_PATHS`` (the probes and the scrape keep answering under
  a flood of idle sockets); any other request, or none within
  ``OVER_CAP_GRACE_S``, gets 503 ``too_many_connections`` and the connection is
  closed. At most ``over_cap_allowance(cap)`` such connections are served at
  once; beyond them a connection gets the 503 at once (``Refusal``) without
  being read.
- **Header deadlines**: a request line and headers must arrive within
  ``header_read_timeout`` (from the connection's start for its first request, as
  nginx's ``client_header_timeout``; from the first byte for later ones, whose
  idle wait is aiohttp's ``keepalive_timeout``). A slow-headers client
  ("slowloris") is closed, with 408 when part of a request came.
- **Accept errors** (``EMFILE``: the process is out of file descriptors) are
  logged at most once a second (``install_accept_error_throttle``). asyncio
  reports each failed ``accept()`` through the loop's exception handler, and
  CPython 3.11's ``BaseSelectorEventLoop._accept_connection`` keeps calling
  ``accept()`` up to the listen backlog times after the first failure, so one
  readiness event could log thousands of tracebacks.

Events of a kind are logged through ``Throttled``: one line a second at most,
carrying the count of those it left out.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from collections.abc import Callable
from typing import Any

from proxy.errors import ProxyError, ServiceUnavailable, envelope
from proxy.server.bodies import encode

log = logging.getLogger(__name__)


OVER_CAP_GRACE_S = 1.0
"""How long a connection over the cap has to send its request (a probe sends it
at once)."""

OVER_CAP_MAX = 256
"""Connections over the cap served at once, at most (and at most
``OVER_CAP_SHARE`` of the cap); beyond them the 503 is written as soon as the
connection is accepted."""

OVER_CAP_SHARE = 0.125
"""``over_cap_allowance``: the share of the cap that may be served over it, so
that the default cap (3/4 of the open-file limit) plus these stay well below the
limit."""


def over_cap_allowance(cap: int) -> int:
    """How many connections over ``cap`` are served at once (``OVER_CAP_MAX``,
    ``OVER_CAP_SHARE``), at least 1."""
    return max(1, min(OVER_CAP_MAX, int(cap * OVER_CAP_SHARE)))


ACCEPT_ERROR_MESSAGE = "socket.accept() out of system resource"
"""The context ``message`` asyncio's selector loop reports a failed ``accept()``
with (``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``), retrying 1 s later."""


class TooManyConnections(ServiceUnavailable):
    """The connection is over ``max_connections`` (503, ``Retry-After: 1``)."""

    default_code = "too_many_connections"
    close = True


def over_cap_error(cap: int) -> TooManyConnections:
    return TooManyConnections(f"The server has {cap} client connections open (max_connections); retry later")


def raw_response(err: ProxyError) -> bytes:
    """``err`` as a complete HTTP/1.1 response that closes the connection: its
    status, envelope body and headers, for answers written below aiohttp (no
    request object exists yet)."""
    body = encode(envelope(err))
    head = [
        f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in err.headers().items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


class Refusal(asyncio.Protocol):
    """A connection answered with ``response`` as soon as it is accepted, and
    closed (the bytes it sent are never read)."""

    __slots__ = ("_response",)

    def __init__(self, response: bytes) -> None:
        self._response = response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self._response)
        transport.close()  # after the write buffer is flushed


class Throttled:
    """A log call made at most once per ``interval`` seconds: the calls in
    between are counted, and the next line says how many were left out. (The
    count of the last window is not written until the next call.)"""

    __slots__ = ("_clock", "_interval", "_level", "_logger", "_next", "_skipped")

    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._level = level
        self._interval = interval
        self._clock = clock
        self._next = float("-inf")
        self._skipped = 0

    def __call__(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless a line was written less than ``interval``
        ago; returns whether it was written."""
        now = self._clock()
        if now < self._next:
            self._skipped += 1
            return False
        self._next = now + self._interval
        if self._skipped:
            msg += " (and %d more since the last such line)"
            args = (*args, self._skipped)
            self._skipped = 0
        self._logger.log(self._level, msg, *args)
        return True


_ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def install_accept_error_throttle(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Make ``loop`` log failed ``accept()`` calls (``ACCEPT_ERROR_MESSAGE``) as
    one WARNING a second at most, without a traceback; every other context goes
    to the handler that was there (or the loop's default one). Returns the
    function that puts the previous handler back."""
    previous: _ExceptionHandler | None = loop.get_exception_handler()
    warn = Throttled(log, logging.WARNING)

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == ACCEPT_ERROR_MESSAGE:
            exc = context.get("exception")
            reason = getattr(exc, "strerror", None) or repr(exc)
            warn("cannot accept connections: %s (open-file limit, max_connections); retrying", reason)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    return lambda: loop.set_exception_handler(previous)
