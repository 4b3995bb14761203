"""The HTTP server under the app: how connections are run, and the JSON
envelope for requests the HTTP parser refuses.

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

import logging

from aiohttp import web

from proxy.errors import BadHttpRequest, GatewayTimeout, ProxyError, error_response

log = logging.getLogger(__name__)

HANDLER_SHUTDOWN_S = 5.0
"""After the drain, how long aiohttp waits for handlers before cancelling them."""

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
