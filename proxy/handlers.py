"""HTTP handlers: the OpenAI endpoints, health and readiness.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: stream (SSE) or one
  JSON response; shapes in ``proxy.responses``, per-request rules in
  ``proxy.streaming``.
- ``GET /v1/models``, ``GET /v1/models/{model}``: the one served model.
- ``GET /health``: liveness, 200 while the process serves HTTP.
- ``GET /ready``: readiness, 200 only once the worker handshake is done and the
  proxy is not draining, else 503.
- ``GET /metrics``: Prometheus text exposition (``proxy.metrics``).

A completion request passes ``proxy.intake`` first (media type, body size and
read time; the API key is checked by ``proxy.app``'s middleware), is parsed, is
checked against this server's limits (``max_n``; a prompt text longer than the
context can hold at ``Ready.longest_token_chars`` per token is refused without
being sent), and only then takes one of the ``max_in_flight`` slots and goes to
the worker as one ``Submit``.

How the events then reach the client (the SSE stream or the one JSON body,
the idle limit, when the SSE headers go out, pings, errors after the headers)
is ``proxy.delivery``'s; a request whose ``request_idle_timeout`` passes is
aborted here like any other that ends unfinished.

Disconnects: the server runs with ``handler_cancellation=True``, so a client
that goes away cancels its handler wherever it waits (a silent prefill
included); every exit path sends ``Abort`` for the choices that did not finish.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import msgspec
from aiohttp import web

from protocol.messages import Ready, Submit, choice_ids
from proxy.constraints import validate
from proxy.delivery import complete_response, stream_response
from proxy.errors import (
    NOT_READY_MESSAGE,
    ContextLengthExceeded,
    EngineNotReady,
    InvalidRequest,
    NotFound,
)
from proxy.intake import check_json_body, max_prompt_chars, read_body
from proxy.metrics import CONTENT_TYPE
from proxy.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
    prompt_chars,
    to_submits,
    tool_plan,
)
from proxy.request_log import METRICS, record_of
from proxy.responses import (
    CHAT,
    TEXT,
    ChunkHeader,
    HealthStatus,
    ModelCard,
    ModelList,
    ReadyStatus,
    ResponseFormat,
    encode,
)
from proxy.state import STATE, ProxyState
from proxy.streaming import ResponseState, StreamFlags

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
    heartbeat, ``null`` before one); 503 ``{"status": "not_ready" | "draining"}``
    otherwise."""
    state = request.app[STATE]
    if state.draining:
        return _json(ReadyStatus("draining"), 503)
    engine = state.engine
    if not engine.ready:
        return _json(ReadyStatus("not_ready"), 503)
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
    )


async def metrics(request: web.Request) -> web.Response:
    """The Prometheus scrape: every family of ``proxy.metrics`` in the text
    exposition format."""
    body = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def list_models(request: web.Request) -> web.Response:
    """``{"object": "list", "data": [model card]}``; 503 before the model name is known."""
    return _json(ModelList(data=[_model_card(request.app[STATE])]))


async def get_model(request: web.Request) -> web.Response:
    """The model card of the served model; 404 for any other name."""
    card = _model_card(request.app[STATE])
    if request.match_info["model"] != card.id:
        raise NotFound(
            f"The model '{request.match_info['model']}' does not exist", param="model", code="model_not_found"
        )
    return _json(card)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _serve(request, parse_chat_request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions`` (legacy text completions)."""
    return await _serve(request, parse_completion_request, TEXT)


async def _serve(
    request: web.Request,
    parse: Callable[[bytes], ChatCompletionRequest | CompletionRequest],
    fmt: ResponseFormat,
) -> web.StreamResponse:
    state = request.app[STATE]
    settings = state.settings
    check_json_body(request)
    state.check_admissible()
    limit = settings.body_limit_bytes(max_prompt_chars(state.engine.worker))
    body = await read_body(request, limit, settings)
    req = parse(body)
    worker = state.engine.worker
    if worker is None or not state.engine.ready:
        raise EngineNotReady(NOT_READY_MESSAGE)
    request_id = fmt.id_prefix + uuid.uuid4().hex
    record = record_of(request)
    record.request_id = request_id
    record.stream = req.stream
    tools = tool_plan(req, state.tool_format())
    submits = to_submits(req, request_id, worker.max_context_tokens, tools)
    for grammar, param in dict.fromkeys((s.params.grammar, s.params.grammar_param or "") for s in submits):
        if grammar is not None:  # checked off the event loop, bounded (proxy.constraints)
            await validate(grammar, param)
    _check_limits(submits, settings.max_n, worker)
    several = len(submits) > 1
    echo = isinstance(req, CompletionRequest) and req.echo
    header = ChunkHeader(fmt, request_id, int(time.time()), state.model_name() or worker.model_id)
    flags = StreamFlags(
        req.progress,
        req.stream and req.include_usage,
        req.stream and req.continuous_usage,
        logprobs=req.logprobs_k() is not None,
        timings=req.timings_per_token,
        echo=tuple(s.prompt or "" for s in submits) if echo else (),
        tools=tools if tools is not None and tools.config.active else None,
        per_prompt=req.n if several else 0,
    )
    ids = [rid for s in submits for rid in choice_ids(s.request_id, s.n)]
    response = ResponseState(header, ids, flags)
    state.admit()
    try:
        stream = state.engine.submit(*submits)
        state.active.add(stream)
        try:
            if req.stream:
                return await stream_response(request, settings, stream, response, record)
            return await complete_response(stream, response, settings.request_idle_timeout)
        finally:
            state.active.discard(stream)
            if response.done:
                record.complete(response.final_usage(), response.finished(), response.first_token_at)
            unfinished = response.unfinished_ids()
            if unfinished:
                state.engine.abort(unfinished)
    finally:
        state.release()


def _check_limits(submits: list[Submit], max_n: int, worker: Ready) -> None:
    """This server's limits on a valid request: ``max_n`` choices (over all
    prompts of a prompt list), and prompt texts no longer than the context can
    hold (refused without being sent)."""
    choices = sum(s.n for s in submits)
    if choices > max_n:
        what = f"'n' is {submits[0].n}" + (f" for each of {len(submits)} prompts" if len(submits) > 1 else "")
        raise InvalidRequest(
            f"{what}; this server runs at most max_n={max_n} choices per request",
            param="n" if len(submits) == 1 else "prompt",
        )
    most = max_prompt_chars(worker)
    for i, submit in enumerate(submits):
        if most is None:
            break
        chars, param = prompt_chars(submit)
        if len(submits) > 1:
            param = f"prompt[{i}]"
        if chars > most:
            raise ContextLengthExceeded(
                f"The prompt has {chars} characters; no text over {most} characters fits this "
                f"model's context of {worker.max_context_tokens} tokens (a token is at most "
                f"{worker.longest_token_chars} characters)",
                param=param,
            )


def add_routes(app: web.Application) -> None:
    """Register every route of this module on ``app``."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
