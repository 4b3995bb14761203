"""Application factory and the server's run loop.

``create_app`` wires routes, the error middleware and the engine client's
start/close (``cleanup_ctx``); tests build the app from it. ``run_proxy`` serves
it until SIGINT/SIGTERM, then runs the shutdown state machine of
``proxy.state``: stop admitting, drain, abort the rest, close.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from aiohttp.web_log import AccessLogger

from proxy.engine_client import EngineClient
from proxy.errors import ProxyError, error_response, from_http_exception
from proxy.handlers import add_routes
from proxy.settings import ProxySettings
from proxy.state import STATE, ProxyState

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body accepted (a 128k-token prompt is well under 1 MiB of
text; aiohttp's 1 MiB default is too tight for long-context chats); 413 beyond."""

HANDLER_SHUTDOWN_S = 5.0
"""After the drain, how long aiohttp waits for handlers before cancelling them."""

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Paths Kubernetes and Prometheus poll every few seconds; their access lines
appear only when the log level is DEBUG."""


class ProbeQuietAccessLogger(AccessLogger):
    """aiohttp's access log, without the lines of ``PROBE_PATHS`` unless DEBUG
    is on: a probe every 2 s would otherwise bury the requests that matter."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path in PROBE_PATHS and not self.logger.isEnabledFor(logging.DEBUG):
            return
        super().log(request, response, time)


@web.middleware
async def error_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """The one place where failures become OpenAI error envelopes: ``ProxyError``
    keeps its status, aiohttp's HTTP errors (404, 405, 413) keep theirs, anything
    else is a logged 500."""
    try:
        return await handler(request)
    except ProxyError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(from_http_exception(e))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ProxyError(f"Internal server error: {type(e).__name__}"))


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    engine = app[STATE].engine
    await engine.start()
    try:
        yield
    finally:
        await engine.close()


def create_app(settings: ProxySettings, engine_client: EngineClient) -> web.Application:
    """The proxy's aiohttp application. ``engine_client`` is started on app
    startup and closed on cleanup; its state is ``app[proxy.state.STATE]``."""
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[STATE] = ProxyState(settings, engine_client)
    app.cleanup_ctx.append(_engine_lifetime)
    add_routes(app)
    return app


async def run_proxy(
    settings: ProxySettings, engine_client: EngineClient, *, stop: asyncio.Event | None = None
) -> None:
    """Serve on ``settings.host:settings.port`` until SIGINT/SIGTERM (or until
    ``stop`` is set, for tests), then drain for up to ``settings.shutdown_drain``
    seconds, fail what is left with 503 ``shutting_down``, and close.

    The runner uses ``handler_cancellation=True``: a client disconnect cancels
    its handler, which aborts the engine request even during a silent prefill.
    Logging is configured by the caller (the CLI applies ``settings.log_level``).
    Raises ``OSError`` when the port cannot be bound.
    """
    app = create_app(settings, engine_client)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=HANDLER_SHUTDOWN_S,
        access_log_class=ProbeQuietAccessLogger,
    )
    await runner.setup()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        log.info("proxy listening on http://%s:%d", settings.host, settings.port)
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down: draining for up to %g s (shutdown_drain)", settings.shutdown_drain)
        aborted = await app[STATE].drain(settings.shutdown_drain)
        if aborted:
            log.warning("aborted %d request(s) still in flight after shutdown_drain", aborted)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)  # returns False for one never added
        await runner.cleanup()
