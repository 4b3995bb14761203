"""Application factory and the server's run loop.

``create_app`` wires the routes (the dialects' from ``proxy.dialects.registry.ROUTES``,
``GET /v1/status`` from ``proxy.ops.status``, the others from ``proxy.ops.routes``), the
requests in flight (``proxy.ops.inflight``), traces when ``OTEL_*`` asks
(``proxy.ops.tracing``), the middlewares (request record/log/metrics, then errors,
then ``Host``/``Origin`` (``proxy.server.host_check``), then API keys), the
response's ``X-Request-Id`` (``proxy.ops.request_log.echo_request_id``), the
``Metrics`` and the engine client's start/close (``cleanup_ctx``); tests build
the app from it.
``run_proxy`` serves it (with ``proxy.server.runner.make_runner``) until
SIGINT/SIGTERM, then runs the shutdown state machine of ``proxy.server.state``: stop
admitting, drain, abort the rest, close.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from proxy.dialects.registry import ROUTES
from proxy.engine.client import EngineClient
from proxy.errors import ProxyError, error_response, from_http_exception
from proxy.grammar.check import close_checker
from proxy.ops.inflight import INFLIGHT, InFlight
from proxy.ops.metrics import Metrics
from proxy.ops.request_log import METRICS, echo_request_id, observe_middleware, record_of
from proxy.ops.routes import add_routes
from proxy.ops.status import add_status_routes
from proxy.ops.tracing import setup_tracing
from proxy.server.host_check import host_check_middlewares
from proxy.server.intake import KEY_DIGEST, check_api_key, key_digest
from proxy.server.probes import PROBE_PATHS
from proxy.server.runner import make_runner
from proxy.server.state import STATE, ProxyState
from proxy.serving.serve import add_dialect_routes, error_shape
from proxy.settings import ProxySettings

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 4096
"""Pending connections the kernel queues for us (aiohttp's default, 128, overflows
when a few thousand clients connect within seconds; the kernel caps it at
``net.core.somaxconn``)."""

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """The one place where failures of the app become error bodies, in the
    shape of the dialect that owns the route (``proxy.serving.serve.error_shape``;
    OpenAI's envelope elsewhere): ``ProxyError`` keeps its status, aiohttp's HTTP errors (404, 405) keep
    theirs, anything else is a logged 500. (Requests the HTTP parser refuses
    never reach the app: ``proxy.server.runner.EnvelopeRequestHandler``.)"""
    try:
        return await handler(request)
    except ProxyError as e:
        err = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = from_http_exception(e)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("unhandled error in %s %s", request.method, request.path)
        err = ProxyError(f"Internal server error: {type(e).__name__}")
    record_of(request).fail(err)
    return error_response(err, error_shape(request))


@web.middleware
async def api_key_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """When API keys are configured, every route but ``PROBE_PATHS`` requires
    one (``proxy.server.intake.check_api_key``): checked before anything else."""
    keys = request.app[STATE].api_keys
    if keys:
        resource = request.match_info.route.resource
        if resource is None or resource.canonical not in PROBE_PATHS:
            request[KEY_DIGEST] = check_api_key(request, keys)
    return await handler(request)


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    engine = app[STATE].engine
    await engine.start()
    try:
        yield
    finally:
        await engine.close()
        # The grammar checker's children (proxy.grammar.check) go with the app.
        await asyncio.to_thread(close_checker)


def create_app(settings: ProxySettings, engine_client: EngineClient) -> web.Application:
    """The proxy's aiohttp application. ``engine_client`` is started on app
    startup and closed on cleanup; its state is ``app[proxy.server.state.STATE]``.

    Its connections never inflate a compressed body (``auto_decompress=False``;
    ``proxy.server.intake`` refuses such bodies with 415). Reads ``api_key_file``;
    raises ``ValueError`` naming it when it cannot be read or holds no key."""
    keys = frozenset(key_digest(k) for k in settings.api_keys())
    app = web.Application(
        middlewares=[
            observe_middleware,
            error_middleware,
            *host_check_middlewares(settings, has_keys=bool(keys)),
            api_key_middleware,
        ],
        handler_args={"auto_decompress": False},
    )
    app[STATE] = ProxyState(settings, engine_client, api_keys=keys)
    app[METRICS] = Metrics(engine_client)
    app.cleanup_ctx.append(_engine_lifetime)
    app.on_response_prepare.append(echo_request_id)
    app[INFLIGHT] = InFlight()
    add_routes(app)
    add_dialect_routes(app, ROUTES)
    add_status_routes(app)
    setup_tracing(app)
    return app


async def run_proxy(
    settings: ProxySettings, engine_client: EngineClient, *, stop: asyncio.Event | None = None
) -> None:
    """Serve on ``settings.host:settings.port`` until SIGINT/SIGTERM (or until
    ``stop`` is set, for tests), then drain for up to ``settings.shutdown_drain``
    seconds, fail what is left with 503 ``shutting_down``, and close.

    The runner is ``proxy.server.runner.make_runner``'s. Logging is configured by the
    caller (the CLI applies ``settings.log_level``). Raises ``OSError`` when the
    port cannot be bound, ``ValueError`` for an unreadable ``api_key_file``.
    """
    app = create_app(settings, engine_client)
    runner = make_runner(app)
    await runner.setup()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=LISTEN_BACKLOG)
        await site.start()
        keys = len(app[STATE].api_keys)
        log.info(
            "proxy listening on http://%s:%d (%s)",
            settings.host,
            settings.port,
            f"/v1/* requires one of {keys} API key(s)" if keys else "no API key required",
        )
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
