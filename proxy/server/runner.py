"""The HTTP server under the app: the event loop it runs on, how connections
are run, and the JSON envelope for requests the HTTP parser refuses.

``run(main)`` runs a proxy process (``exl3-sidecar proxy``, ``serve``): its
garbage collector settled (``settle_gc``) and its event loop, uvloop's when it
is installed, asyncio's otherwise. Both are the process's, so they are set
there, not in ``proxy.app.run_proxy``, which tests also run in-process.

``make_runner(app)`` builds the ``web.AppRunner`` that ``proxy.app.run_proxy``
serves (and that tests serve on a real socket):

- ``handler_cancellation=True``: a client that disconnects cancels its handler,
  which aborts its engine request even during a silent prefill;
- no aiohttp access log: ``proxy.ops.request_log`` writes the one line per request
  (with its tokens and latencies), probes only at DEBUG;
- connections are ``EnvelopeRequestHandler``s: a request aiohttp's parser
  refuses (too many headers, a request line or header line over 8190 bytes, a
  bad ``Content-Length``, an invalid method, TLS on the plain port) gets the
  OpenAI error envelope instead of aiohttp's ``text/plain`` echo of the bad
  bytes, and costs one INFO log line instead of an ERROR with a traceback;
- what a connection may cost (``proxy.server.connections``): at most
  ``ProxySettings.connection_cap()`` of them open (beyond it: probes only, else
  503), ``header_read_timeout`` for a request's headers,
  ``keepalive_timeout`` (aiohttp's) for an idle keep-alive connection, and
  accept errors logged once a second at most.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from aiohttp import web
from aiohttp.streams import StreamReader

from proxy.errors import BadHttpRequest, GatewayTimeout, ProxyError, RequestTimeout, error_response
from proxy.server.connections import (
    OVER_CAP_GRACE_S,
    Refusal,
    Throttled,
    install_accept_error_throttle,
    over_cap_allowance,
    over_cap_error,
    raw_response,
)
from proxy.server.probes import PROBE_PATHS
from proxy.server.state import STATE

log = logging.getLogger(__name__)

HANDLER_SHUTDOWN_S = 5.0
"""After the drain, how long aiohttp waits for handlers before cancelling them."""

GC_THRESHOLDS = (50_000, 10, 10)
"""``gc.set_threshold`` once the server is up (``settle_gc``): the youngest
generation's threshold far above the default 700, the others as they are."""

_T = TypeVar("_T")


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """Settle the garbage collector, then run ``main`` on a new event loop,
    uvloop's when installed, and close it. (uvloop is not a dependency:
    ``docs/performance.md`` measured it within the noise of asyncio's loop on
    the proxy's path.) Call it once the process has imported what it serves."""
    settle_gc()
    try:
        uvloop = importlib.import_module("uvloop")  # by name: typed or not, installed or not
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def settle_gc() -> None:
    """Once start-up is done: move everything allocated so far (modules, classes,
    functions: most of a process's objects) out of the collector's sight for
    good (``gc.freeze``), and let it run only every ``GC_THRESHOLDS[0]`` net new
    container objects.

    Why: the default threshold (700) makes the collector run in the middle of
    nearly every engine step of hundreds of streams, whose transient objects
    (decoded events, chunks) it cannot free anyway (reference counting does),
    and every 100th run scans every live object, those of start-up included. A
    higher threshold still catches reference cycles, just in bigger batches."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _reason(exc: BaseException | None, message: str | None) -> str:
    """aiohttp's words for a parse error, without the client's bytes it quotes
    after a colon, on one line of ASCII."""
    text = getattr(exc, "message", None) or message or (type(exc).__name__ if exc else "")
    lines = str(text).strip().splitlines()
    first = lines[0].split(":", 1)[0].strip() if lines else ""
    return first.encode("ascii", "backslashreplace").decode("ascii")[:200] or "malformed request"


_over_cap_log = Throttled(log, logging.WARNING)
_header_timeout_log = Throttled(log, logging.INFO)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What ``_EnvelopeServer`` enforces per connection (``proxy.server.connections``):
    ``cap`` connections open at once, ``header_read_timeout`` seconds for a
    request's line and headers."""

    cap: int
    header_read_timeout: float


class EnvelopeRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering the errors it handles itself with
    the OpenAI envelope (``proxy.errors``), and enforcing the header deadline and
    the over-cap rule of ``proxy.server.connections``.

    Why a subclass: a request the HTTP parser refuses never reaches the app or
    its middlewares; ``RequestHandler.handle_error`` answers it, with a
    ``text/plain`` body quoting the offending bytes, and logs it at ERROR with a
    traceback. aiohttp has no supported hook for this (aio-libs/aiohttp#3287 is
    open) and no parameter naming the handler class, so ``ProxyRunner`` makes
    its connections instances of this class; ``handle_error`` keeps the
    contract of the method it overrides (the connection is closed after the
    response; ``ConnectionError`` once a response has started). aiohttp has no
    header-read deadline either: ``data_received`` arms one (below).

    4xx (the parser's 400s): ``BadHttpRequest`` with the parser's status, one
    INFO line naming the peer and aiohttp's reason, no traceback. 504 (a
    ``TimeoutError`` out of a handler): ``GatewayTimeout``. Anything else
    (500): an ERROR with the traceback, as it is a bug of this proxy.

    Header deadline: armed when the connection is made (its first request) and
    at the first byte of each later request while no request is in progress;
    disarmed when the parser has a request's headers. Bytes of a body never arm
    it (``body_read_timeout`` in the app covers those). On expiry the
    connection is closed: after a 408 envelope when part of a request came, a
    503 ``too_many_connections`` when it is over the cap, silently otherwise.
    """

    __slots__ = (
        "__weakref__",
        "_app_handler",
        "_body",
        "_deadline",
        "_header_timeout",
        "_over_cap",
        "_partial",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        loop: asyncio.AbstractEventLoop,
        header_read_timeout: float,
        over_cap: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._header_timeout = header_read_timeout
        self._over_cap = over_cap  # the cap this connection is over, else None
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False  # bytes of a request came since the last whole request
        self._body: StreamReader | None = None  # the body of the last request parsed
        self._app_handler = self._request_handler
        if over_cap is not None:
            self._request_handler = self._answer_over_cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm(OVER_CAP_GRACE_S if self._over_cap is not None else self._header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # the parser has a request's headers
            self._partial = False
            self._body = self._messages[-1][1] if self._messages else None
            self._disarm()
            return
        if not data or self.transport is None or (self._body is not None and not self._body.is_eof()):
            return
        self._partial = True
        if self._deadline is None and not self._request_in_progress and not self._messages:
            self._arm(self._header_timeout)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self._loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        transport = self.transport
        if transport is None or self._request_in_progress or self._messages:
            return
        peer = transport.get_extra_info("peername")
        if self._over_cap is not None:
            transport.write(raw_response(over_cap_error(self._over_cap)))
        elif self._partial:
            limit = f"header_read_timeout={self._header_timeout:g} s"
            transport.write(
                raw_response(RequestTimeout(f"The request headers did not arrive within {limit}"))
            )
            _header_timeout_log(
                "closed a connection whose request headers took over header_read_timeout=%g s (from %s)",
                self._header_timeout,
                peer,
            )
        self.force_close()

    async def _answer_over_cap(self, request: web.BaseRequest) -> web.StreamResponse:
        """The one request of a connection over the cap: a probe is served, any
        other request gets 503; the connection closes after it."""
        self.close()
        if request.path in PROBE_PATHS and self._app_handler is not None:
            resp = await self._app_handler(request)
        else:
            resp = error_response(over_cap_error(self._over_cap or 0))
        if not resp.prepared:
            resp.force_close()  # says "Connection: close"
        return resp

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response")
        err: ProxyError
        if 400 <= status < 500:
            reason = _reason(exc, message)
            log.info("bad HTTP request from %s: %s (%d)", request.remote, reason, status)
            err = BadHttpRequest(f"Bad HTTP request: {reason}")
        elif status == 504:
            err = GatewayTimeout("The request took too long")
        else:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
            err = ProxyError("Internal server error")
        err.status = status
        resp = error_response(err)
        resp.force_close()
        return resp


class _EnvelopeServer(web.Server):
    """``web.Server`` whose connections are ``EnvelopeRequestHandler``s (its
    ``__call__`` is the protocol factory a site listens with), counted against
    ``limits.cap``. ``ProxyRunner._make_server`` sets the three attributes."""

    limits: ConnectionLimits
    admitted: weakref.WeakSet[web.RequestHandler]  # within the cap
    over_cap: weakref.WeakSet[web.RequestHandler]  # over it, answering one probe at most

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]  # a Refusal too
        # Counted here, not in connection_made: one loop turn may accept a burst
        # of connections (up to the listen backlog) before any of them is made.
        # WeakSets: a handler whose transport could not be built never reaches
        # connection_lost; it leaves the set when it is collected.
        cap = self.limits.cap
        if len(self.admitted) < cap:
            handler = self._handler(None)
            self.admitted.add(handler)
            return handler
        _over_cap_log(
            "connection cap reached (max_connections=%d): new connections get 503 (probes excepted)", cap
        )
        if len(self.over_cap) < over_cap_allowance(cap):
            handler = self._handler(cap)
            self.over_cap.add(handler)
            return handler
        return Refusal(raw_response(over_cap_error(cap)))

    def _handler(self, over_cap: int | None) -> EnvelopeRequestHandler:
        return EnvelopeRequestHandler(
            self,
            loop=self._loop,
            header_read_timeout=self.limits.header_read_timeout,
            over_cap=over_cap,
            **self._kwargs,
        )

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        self.admitted.discard(handler)
        self.over_cap.discard(handler)
        super().connection_lost(handler, exc)


class ProxyRunner(web.AppRunner):
    """``web.AppRunner`` serving ``EnvelopeRequestHandler`` connections under
    ``limits``, with accept errors throttled on its loop while it is set up.

    ``_make_server`` (the method each runner implements) lets the app build its
    ``web.Server`` as usual (startup, middlewares, ``handler_args``), then
    retypes it as ``_EnvelopeServer``: a subclass that adds only the protocol
    factory and its counters. Rebuilding the server instead would copy aiohttp's
    private ``Application._make_handler``. Should ``web.Server`` ever get
    ``__slots__``, the assignment fails at startup, not at the first bad request.
    """

    __slots__ = ("_limits", "_restore_handler")

    def __init__(self, app: web.Application, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._limits = limits
        self._restore_handler: Callable[[], None] | None = None

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer
        envelope_server = cast(_EnvelopeServer, server)
        envelope_server.limits = self._limits
        envelope_server.admitted = weakref.WeakSet()
        envelope_server.over_cap = weakref.WeakSet()
        return server

    async def setup(self) -> None:
        await super().setup()
        self._restore_handler = install_accept_error_throttle(asyncio.get_running_loop())

    async def cleanup(self) -> None:
        try:
            await super().cleanup()
        finally:
            if self._restore_handler is not None:
                self._restore_handler()
                self._restore_handler = None


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner ``run_proxy`` serves ``app`` with (module docstring), its
    limits from ``app[proxy.server.state.STATE].settings``; call ``await
    runner.setup()``, then start a site on it."""
    settings = app[STATE].settings
    return ProxyRunner(
        app,
        limits=ConnectionLimits(settings.connection_cap(), settings.header_read_timeout),
        handler_cancellation=True,
        shutdown_timeout=HANDLER_SHUTDOWN_S,
        access_log=None,
        keepalive_timeout=settings.keepalive_timeout,
    )
