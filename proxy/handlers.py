"""HTTP handlers: the OpenAI endpoints, health and readiness.

- ``POST /v1/chat/completions``, ``POST /v1/completions``: stream (SSE) or one
  JSON response; shapes in ``proxy.responses``, per-request rules in
  ``proxy.streaming``.
- ``GET /v1/models``, ``GET /v1/models/{model}``: the one served model.
- ``GET /health``: liveness, 200 while the process serves HTTP.
- ``GET /ready``: readiness, 200 only once the worker handshake is done and the
  proxy is not draining, else 503.

When the SSE headers go out: a stream first waits for every choice's first event
(``Started``, or a ``RequestError`` such as ``context_length_exceeded``, which
then becomes a real 400), but at most ``sse_ping_interval_s``; after that the
headers are sent with a ``: ping`` and later errors can only be error events.

Disconnects: the server runs with ``handler_cancellation=True``, so a client
that goes away cancels its handler wherever it waits (a silent prefill
included); every exit path sends ``Abort`` for the choices that did not finish.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import msgspec
from aiohttp import web

from proxy import sse
from proxy.engine_client import RequestStream
from proxy.errors import (
    NOT_READY_MESSAGE,
    EngineInternalError,
    EngineNotReady,
    NotFound,
    ProxyError,
    envelope,
)
from proxy.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    choice_request_ids,
    parse_chat_request,
    parse_completion_request,
    to_submits,
)
from proxy.responses import (
    CHAT,
    TEXT,
    ChunkHeader,
    HealthStatus,
    ModelCard,
    ModelList,
    ReadyStatus,
    ResponseFormat,
    StreamChunk,
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
    int | null}`` once the worker is ready; 503 ``{"status": "not_ready" |
    "draining"}`` otherwise."""
    state = request.app[STATE]
    if state.draining:
        return _json(ReadyStatus("draining"), 503)
    if not state.engine.ready:
        return _json(ReadyStatus("not_ready"), 503)
    return _json(ReadyStatus("ready", state.model_name(), state.engine.worker_active_requests))


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
    state.admit()
    try:
        body = await request.read()
        req = parse(body)
        worker = state.engine.worker
        if worker is None or not state.engine.ready:
            raise EngineNotReady(NOT_READY_MESSAGE)
        request_id = fmt.id_prefix + uuid.uuid4().hex
        submits = to_submits(req, request_id, worker.max_context_tokens)
        header = ChunkHeader(fmt, request_id, int(time.time()), state.model_name() or worker.model_id)
        flags = StreamFlags(
            req.progress, req.stream and req.include_usage, req.stream and req.continuous_usage
        )
        response = ResponseState(header, choice_request_ids(request_id, req.n), flags)
        stream = state.engine.submit(submits)
        state.active.add(stream)
        try:
            if req.stream:
                return await _stream(request, state, stream, response)
            return await _complete(stream, response)
        finally:
            state.active.discard(stream)
            unfinished = response.unfinished_ids()
            if unfinished:
                state.engine.abort(unfinished)
    finally:
        state.release()


async def _complete(stream: RequestStream, response: ResponseState) -> web.Response:
    # The stream chunks are not needed, but feeding is what assembles the response.
    scratch: list[StreamChunk] = []
    while not response.done:
        for ev in await stream.get():
            response.feed(ev, scratch)
        scratch.clear()
    return _json(response.response())


async def _stream(
    request: web.Request, state: ProxyState, stream: RequestStream, response: ResponseState
) -> web.StreamResponse:
    ping_s = state.settings.sse_ping_interval
    out: list[StreamChunk] = []
    # Before the headers: errors are still HTTP statuses (ProxyError propagates).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ping_s
    silent = False
    while not (response.started or response.done):
        remaining = deadline - loop.time()
        if remaining <= 0:
            silent = True
            break
        for ev in await stream.get(remaining):
            response.feed(ev, out)

    resp = web.StreamResponse(headers=sse.HEADERS)
    await resp.prepare(request)
    last_write = loop.time()
    buf = [sse.event(c) for c in out]
    if silent:
        buf.append(sse.PING)
    try:
        while True:
            if response.done:
                if response.flags.include_usage:
                    buf.append(sse.event(response.usage_chunk()))
                buf.append(sse.DONE)
                await resp.write(b"".join(buf))
                break
            if buf:
                await resp.write(b"".join(buf))
                buf.clear()
                last_write = loop.time()
            # Silence is measured from the last write, not the last event: events
            # that make no chunk (held-back text, dropped re-prefill progress) can
            # keep arriving for a long time.
            wait_s = ping_s - (loop.time() - last_write)
            events = await stream.get(wait_s) if wait_s > 0 else []
            if not events:
                buf.append(sse.PING)
                continue
            out.clear()
            try:
                for ev in events:
                    response.feed(ev, out)
            finally:
                buf.extend(sse.event(c) for c in out)
        await resp.write_eof()
    except ProxyError as e:
        await _write_error(resp, buf, e)
    except ConnectionResetError:
        log.debug("client of %s went away", response.header.id)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("stream %s failed", response.header.id)
        await _write_error(resp, buf, EngineInternalError(f"Internal error: {type(e).__name__}"))
    return resp


async def _write_error(resp: web.StreamResponse, buf: list[bytes], exc: ProxyError) -> None:
    """After the headers the status is fixed: the chunks still pending, one
    ``data: {"error": ...}`` event, then ``[DONE]``."""
    buf.append(sse.event(envelope(exc)))
    buf.append(sse.DONE)
    try:
        await resp.write(b"".join(buf))
        await resp.write_eof()
    except ConnectionResetError:
        pass


def add_routes(app: web.Application) -> None:
    """Register every route of this module on ``app``."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
