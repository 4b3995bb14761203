"""TabbyAPI's read routes and llama.cpp's ``GET /props``, so SillyTavern's
"TabbyAPI" text-completion mode (and web UIs that read ``/props``) connect to
this server as they do to TabbyAPI. Mounted beside ``/v1/completions`` (its
error shape, OpenAI's), behind the API key like every route.

Shapes (TabbyAPI's ``endpoints/core/types/`` ``model.py``, ``token.py``,
``auth.py``; its router ``endpoints/core/router.py``)::

    GET  /v1/model          -> ModelCard {"id", "object": "model", "created", "owned_by",
                               "parameters": {"max_seq_len", "cache_size", "max_batch_size",
                               "prompt_template_content"}}
    GET  /v1/model/list     -> {"object": "list", "data": [ModelCard]}
    POST /v1/token/encode   {"text": str | [chat message], "add_bos_token"?, "encode_special_tokens"?}
                            -> {"tokens": [int], "length": int}
    POST /v1/token/decode   {"tokens": [int], "decode_special_tokens"?} -> {"text": str}
    GET  /v1/auth/permission -> {"permission": "api"}
    GET  /props             -> {"default_generation_settings": {"n_ctx": int}, "total_slots": int,
                               "chat_template": str}   (llama.cpp's server, as TabbyAPI answers it)

A string ``text`` is tokenized as ``/v1/completions`` would tokenize that prompt
(``add_bos_token`` as there: absent is the model's own choice), a list as
``/v1/chat/completions`` would render those messages. ``encode_special_tokens``
and ``decode_special_tokens`` are honoured at what this server does (control
tokens' text in a raw prompt is parsed as such; decoding writes special tokens
as their text): ``false`` is a 400 naming them. The permission of every
accepted key is ``api``: this server has no admin key.

TabbyAPI's admin routes (loading and unloading models, LoRAs, templates,
sampler overrides, downloading weights) answer 404 with a message saying why:
this server serves one model per worker (a pod per model), chosen when it starts.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from protocol.messages import MODALITY_IMAGE
from proxy.core.dialect import Handler
from proxy.core.fields import REFUSE_NOTHING, TokenId, decode
from proxy.core.task import Sampling, TextTask, chat_submit, text_submits, tool_plan
from proxy.dialects.chat.request import ChatCompletionRequest, chat_task
from proxy.errors import EngineNotReady, InvalidRequest, NotFound
from proxy.server.bodies import encode
from proxy.server.state import STATE, ProxyState
from proxy.serving.lookups import detokenize, tokenize
from proxy.serving.side import side_request

OWNED_BY = "exl3-sidecar"


class CardParameters(msgspec.Struct, kw_only=True, gc=False):
    """TabbyAPI's ``ModelCardParameters``, the fields this server knows."""

    max_seq_len: int
    cache_size: int
    max_batch_size: int
    prompt_template_content: str | None = None


class TabbyModelCard(msgspec.Struct, kw_only=True, gc=False):
    """TabbyAPI's ``ModelCard``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = OWNED_BY
    parameters: CardParameters


class TabbyModelList(msgspec.Struct, kw_only=True, gc=False):
    object: str = "list"
    data: list[TabbyModelCard]


class EncodeRequest(msgspec.Struct, kw_only=True):
    """TabbyAPI's ``TokenEncodeRequest``."""

    text: str | list[dict[str, object]]
    add_bos_token: bool | None = None
    encode_special_tokens: bool = True
    decode_special_tokens: bool = True


class EncodeResponse(msgspec.Struct, gc=False):
    tokens: list[int]
    length: int


class DecodeRequest(msgspec.Struct, kw_only=True):
    """TabbyAPI's ``TokenDecodeRequest``."""

    tokens: list[TokenId]
    add_bos_token: bool = True
    encode_special_tokens: bool = True
    decode_special_tokens: bool = True


class DecodeResponse(msgspec.Struct, gc=False):
    text: str


class Permission(msgspec.Struct, gc=False):
    permission: str


class GenerationSettings(msgspec.Struct, gc=False):
    n_ctx: int


class Modalities(msgspec.Struct, gc=False):
    """``/props``' ``modalities``, llama.cpp's shape: ``vision`` (images), ``audio``
    (never here)."""

    vision: bool
    audio: bool = False


class Props(msgspec.Struct, kw_only=True, gc=False):
    """llama.cpp's ``/props``, the part TabbyAPI answers (``ModelPropsResponse``)."""

    default_generation_settings: GenerationSettings
    total_slots: int
    chat_template: str = ""
    modalities: Modalities
    """llama.cpp's: what the model reads besides text (``Ready.modalities``)."""
    kernels: dict[str, str] | None = None
    """Not llama.cpp's: the CPU engine's kernel per product, chosen at start by
    measured speed (``Ready.kernels``); null for other engines."""


def _json(body: msgspec.Struct) -> web.Response:
    return web.Response(body=encode(body), content_type="application/json")


def _card(state: ProxyState) -> TabbyModelCard:
    worker, name = state.engine.worker, state.model_name()
    if worker is None or name is None or not state.engine.ready:
        raise EngineNotReady("The model is not known before the engine worker's handshake")
    return TabbyModelCard(
        id=name,
        created=state.started_at,
        parameters=CardParameters(
            max_seq_len=worker.max_context_tokens,
            cache_size=worker.kv_cache_tokens or worker.max_context_tokens,
            max_batch_size=worker.max_batch_size or 1,
            prompt_template_content=worker.chat_template,
        ),
    )


async def current_model(request: web.Request) -> web.Response:
    """``GET /v1/model``: the served model's card; 503 before the handshake."""
    return _json(_card(request.app[STATE]))


async def model_list(request: web.Request) -> web.Response:
    """``GET /v1/model/list``: the one served model."""
    return _json(TabbyModelList(data=[_card(request.app[STATE])]))


async def props(request: web.Request) -> web.Response:
    """``GET /props``: context size, slots (most sequences at once) and the chat template."""
    state = request.app[STATE]
    card = _card(state)
    p = card.parameters
    worker = state.engine.worker
    return _json(
        Props(
            default_generation_settings=GenerationSettings(p.max_seq_len),
            total_slots=p.max_batch_size,
            chat_template=p.prompt_template_content or "",
            modalities=Modalities(vision=worker is not None and MODALITY_IMAGE in worker.modalities),
            kernels=worker.kernels if worker is not None else None,
        )
    )


async def permission(request: web.Request) -> web.Response:
    """``GET /v1/auth/permission``: ``api`` for any key the server accepted."""
    return _json(Permission("api"))


def _only_true(value: bool, name: str) -> None:
    if not value:
        raise InvalidRequest(
            f"'{name}' can only be true here: that is what the generation endpoints do", param=name
        )


def _parse_encode(body: bytes) -> EncodeRequest:
    req = decode(body, EncodeRequest, REFUSE_NOTHING, "/v1/token/encode")
    _only_true(req.encode_special_tokens, "encode_special_tokens")
    if isinstance(req.text, list) and req.add_bos_token is not None:
        raise InvalidRequest(
            "'add_bos_token' applies to a text prompt; a chat template places BOS", param="add_bos_token"
        )
    return req


async def encode_tokens(request: web.Request) -> web.Response:
    """``POST /v1/token/encode`` (module docstring)."""
    side = await side_request(request, _parse_encode)
    req, context = side.req, side.context
    if isinstance(req.text, str):
        task = TextTask(prompts=(req.text,), sampling=Sampling(max_tokens=1, add_bos_token=req.add_bos_token))
        submit = text_submits(task, "tokenize", context.max_context_tokens)[0]
    else:
        chat = chat_task(
            decode(
                msgspec.json.encode({"messages": req.text}),
                ChatCompletionRequest,
                REFUSE_NOTHING,
                "/v1/token/encode",
            )
        )
        submit = chat_submit(
            chat, "tokenize", context.max_context_tokens, tool_plan(chat, context.tool_format)
        )
    ids = await tokenize(request, submit)
    return _json(EncodeResponse(list(ids), len(ids)))


def _parse_decode(body: bytes) -> DecodeRequest:
    req = decode(body, DecodeRequest, REFUSE_NOTHING, "/v1/token/decode")
    _only_true(req.decode_special_tokens, "decode_special_tokens")
    return req


async def decode_tokens(request: web.Request) -> web.Response:
    """``POST /v1/token/decode`` (module docstring)."""
    side = await side_request(request, _parse_decode)
    return _json(DecodeResponse(await detokenize(request, tuple(side.req.tokens))))


ONE_MODEL = (
    "This server serves one model per worker (a pod per model), chosen when it starts; "
    "it does not load, unload or download models, LoRAs, templates or sampler overrides"
)


async def admin(request: web.Request) -> web.Response:
    """TabbyAPI's admin routes: 404 saying why (module docstring)."""
    raise NotFound(f"{request.method} {request.path}: {ONE_MODEL}")


ADMIN_PATHS: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/model/load"),
    ("POST", "/v1/model/unload"),
    ("GET", "/v1/model/draft/list"),
    ("POST", "/v1/download"),
    ("GET", "/v1/loras"),
    ("GET", "/v1/lora/list"),
    ("POST", "/v1/lora/load"),
    ("POST", "/v1/lora/unload"),
    ("GET", "/v1/model/embedding/list"),
    ("POST", "/v1/model/embedding/load"),
    ("POST", "/v1/model/embedding/unload"),
    ("POST", "/v1/template/switch"),
    ("POST", "/v1/template/unload"),
    ("POST", "/v1/sampling/override/switch"),
    ("POST", "/v1/sampling/override/unload"),
)

ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/v1/model", current_model),
    ("GET", "/v1/model/list", model_list),
    ("POST", "/v1/token/encode", encode_tokens),
    ("POST", "/v1/token/decode", decode_tokens),
    ("GET", "/v1/auth/permission", permission),
    ("GET", "/props", props),
    *((method, path, admin) for method, path in ADMIN_PATHS),
)
"""Mounted as ``/v1/completions``'s further routes."""
