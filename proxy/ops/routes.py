"""HTTP handlers of the routes that belong to no dialect: models, health, readiness, metrics.

(Each dialect's generation route is ``proxy.serving.serve.endpoint``'s.)

- ``GET /v1/models``, ``GET /v1/models/{model}``: the one served model.
- ``GET /health``: liveness, 200 while the process serves HTTP.
- ``GET /ready``: readiness, 200 only once the worker handshake is done and the
  proxy is not draining, else 503.
- ``GET /metrics``: Prometheus text exposition (``proxy.ops.metrics``).
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from proxy.errors import EngineNotReady
from proxy.ops.metrics import CONTENT_TYPE
from proxy.ops.request_log import METRICS
from proxy.server.bodies import (
    Architecture,
    HealthStatus,
    LoadingStage,
    ModelCard,
    ModelList,
    ReadyStatus,
    encode,
)
from proxy.server.state import STATE, ProxyState

log = logging.getLogger(__name__)


def _json(body: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(body), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    """Liveness: ``{"status": "ok"}``, 200 while the process serves requests."""
    return _json(HealthStatus())


async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 ``{"status": "ready", "model": str, "worker_active_requests":
    int | null, "worker_waiting_requests": int | null, "worker_kv_cache_usage":
    float | null}`` once the worker is ready (the worker fields from its latest
    heartbeat, ``null`` before one); 503 ``{"status": "loading", "loading": {"stage",
    "label", "done", "total", "elapsed_s", "load_s"}}`` while the worker says it
    loads its model (``protocol.messages.Loading``), 503 ``{"status": "not_ready" |
    "draining"}`` otherwise."""
    state = request.app[STATE]
    if state.draining:
        return _json(ReadyStatus("draining"), 503)
    engine = state.engine
    if not engine.ready:
        ld = engine.loading
        if ld is None:
            return _json(ReadyStatus("not_ready"), 503)
        stage = LoadingStage(
            ld.stage, ld.label, ld.done, ld.total, round(ld.elapsed_ms / 1000, 1), round(ld.load_ms / 1000, 1)
        )
        return _json(ReadyStatus("loading", loading=stage), 503)
    hb = engine.heartbeat
    return _json(
        ReadyStatus(
            "ready",
            state.model_name(),
            engine.worker_active_requests,
            hb.waiting_requests if hb is not None else None,
            round(hb.kv_cache_usage, 4) if hb is not None else None,
        )
    )


def _model_card(state: ProxyState) -> ModelCard:
    name = state.model_name()
    if name is None:
        raise EngineNotReady("The model name is not known before the engine worker's handshake")
    worker = state.engine.worker
    return ModelCard(
        id=name,
        created=state.started_at,
        max_model_len=worker.max_context_tokens if worker is not None else msgspec.UNSET,
        architecture=Architecture(input_modalities=list(worker.modalities))
        if worker is not None
        else msgspec.UNSET,
    )


async def metrics(request: web.Request) -> web.Response:
    """The Prometheus scrape: every family of ``proxy.ops.metrics`` in the text
    exposition format."""
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def list_models(request: web.Request) -> web.Response:
    """``{"object": "list", "data": [model card]}``; 503 before the model name is known."""
    return _json(ModelList(data=[_model_card(request.app[STATE])]))


async def get_model(request: web.Request) -> web.Response:
    """The model card for any name, as the generation endpoints serve the one
    model under any ``model`` name (clients send their own: Claude Code a
    ``claude-*`` name, many ``any``): ``id`` is the name asked for, ``root`` the
    served model (vLLM's field for the model an alias serves). One rule for
    both: a name the POST endpoints serve is never a 404 here."""
    card = _model_card(request.app[STATE])
    asked = request.match_info["model"]
    return _json(msgspec.structs.replace(card, id=asked, root=card.id))


def add_routes(app: web.Application) -> None:
    """Register every route of this module on ``app``."""
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
