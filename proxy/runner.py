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
- no aiohttp access log: ``proxy.request_log`` writes the one line per request
  (with its tokens and latencies), probes only at DEBUG;
- connections are ``EnvelopeRequestHandler``s: a request aiohttp's parser
  refuses (too many headers, a request line or header line over 8190 bytes, a
  bad ``Content-Length``, an invalid method, TLS on the plain port) gets the
  OpenAI error envelope instead of aiohttp's ``text/plain`` echo of the bad
  bytes, and costs one INFO log line instead of an ERROR with a traceback.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

from proxy.errors import BadHttpRequest, GatewayTimeout, ProxyError, error_response

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


class EnvelopeRequestHandler(web.RequestHandler):
    """aiohttp's connection handler, answering the errors it handles itself with
    the OpenAI envelope (``proxy.errors``).

    Why a subclass: a request the HTTP parser refuses never reaches the app or
    its middlewares; ``RequestHandler.handle_error`` answers it, with a
    ``text/plain`` body quoting the offending bytes, and logs it at ERROR with a
    traceback. aiohttp has no supported hook for this (aio-libs/aiohttp#3287 is
    open) and no parameter naming the handler class, so ``ProxyRunner`` makes
    its connections instances of this class; ``handle_error`` keeps the
    contract of the method it overrides (the connection is closed after the
    response; ``ConnectionError`` once a response has started).

    4xx (the parser's 400s): ``BadHttpRequest`` with the parser's status, one
    INFO line naming the peer and aiohttp's reason, no traceback. 504 (a
    ``TimeoutError`` out of a handler): ``GatewayTimeout``. Anything else
    (500): an ERROR with the traceback, as it is a bug of this proxy.
    """

    __slots__ = ()

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
    ``__call__`` is the protocol factory a site listens with)."""

    def __call__(self) -> web.RequestHandler:
        return EnvelopeRequestHandler(self, loop=self._loop, **self._kwargs)


class ProxyRunner(web.AppRunner):
    """``web.AppRunner`` serving ``EnvelopeRequestHandler`` connections.

    ``_make_server`` (the method each runner implements) lets the app build its
    ``web.Server`` as usual (startup, middlewares, ``handler_args``), then
    retypes it as ``_EnvelopeServer``: a subclass that adds no state, only the
    protocol factory. Rebuilding the server instead would copy aiohttp's
    private ``Application._make_handler``. Should ``web.Server`` ever get
    ``__slots__``, the assignment fails at startup, not at the first bad request.
    """

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _EnvelopeServer
        return server


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner ``run_proxy`` serves ``app`` with (module docstring); call
    ``await runner.setup()``, then start a site on it."""
    return ProxyRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=HANDLER_SHUTDOWN_S,
        access_log=None,
    )
