"""vLLM's ``POST /tokenize`` and ``POST /detokenize``.

Shapes (vLLM's ``TokenizeRequest``/``TokenizeResponse``)::

    POST /tokenize    {"model"?, "prompt": str}                        # as /v1/completions would
                   or {"model"?, "messages": [...], "tools"?, "add_generation_prompt"?: true}
                                                                       # as /v1/chat/completions would
    -> {"count": int, "max_model_len": int, "tokens": [int, ...], "token_strs": null}

    POST /detokenize  {"model"?, "tokens": [int, ...]}  -> {"prompt": str}

The prompt is the one the generation endpoint would run: the chat template and
tools applied, client text tokenized as text (``proxy.lookups``).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from proxy.dialect import Handler
from proxy.dialects.chat.request import ChatCompletionRequest, chat_task
from proxy.dialects.openai_common import REFUSE_NOTHING, TokenId, decode
from proxy.errors import InvalidRequest
from proxy.lookups import detokenize, tokenize
from proxy.responses import encode
from proxy.serve import context_of, read_request, ready_worker
from proxy.state import STATE
from proxy.task import Sampling, TextTask, chat_submit, text_submits, tool_plan


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's fields; ``add_special_tokens`` and ``return_token_strs`` are
    honoured only at what this server does (special tokens as the generation
    endpoint adds them, no token strings): anything else is a 400 naming them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, object]] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeResponse(msgspec.Struct, gc=False):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct, gc=False):
    prompt: str


async def tokenize_handler(request: web.Request) -> web.Response:
    """``POST /tokenize`` (module docstring)."""
    body = await read_request(request)
    head = decode(body, TokenizeRequest, REFUSE_NOTHING, "/tokenize")
    if head.return_token_strs:
        raise InvalidRequest("'return_token_strs' is not supported by this server", param="return_token_strs")
    # What the generation endpoint does: a raw prompt gets the tokenizer's special
    # tokens (BOS), a conversation only what its template writes.
    if head.add_special_tokens is not None and head.add_special_tokens != (head.messages is None):
        raise InvalidRequest(
            "'add_special_tokens' can only be what the generation endpoint does here (true for "
            "'prompt', false for 'messages')",
            param="add_special_tokens",
        )
    state = request.app[STATE]
    worker = ready_worker(state)
    context = context_of(state, worker)
    if head.messages is not None:
        task = chat_task(decode(body, ChatCompletionRequest, REFUSE_NOTHING, "/tokenize"))
        submit = chat_submit(
            task, "tokenize", context.max_context_tokens, tool_plan(task, context.tool_format)
        )
    elif head.prompt is not None:
        text = TextTask(prompts=(head.prompt,), sampling=Sampling(max_tokens=1))
        submit = text_submits(text, "tokenize", context.max_context_tokens)[0]
    else:
        raise InvalidRequest("'/tokenize' needs 'prompt' or 'messages'", param="prompt")
    ids = await tokenize(request, submit)
    out = TokenizeResponse(len(ids), worker.max_context_tokens, list(ids))
    return web.Response(body=encode(out), content_type="application/json")


async def detokenize_handler(request: web.Request) -> web.Response:
    """``POST /detokenize`` (module docstring)."""
    body = await read_request(request)
    req = decode(body, DetokenizeRequest, REFUSE_NOTHING, "/detokenize")
    ready_worker(request.app[STATE])
    text = await detokenize(request, tuple(req.tokens))
    return web.Response(body=encode(DetokenizeResponse(text)), content_type="application/json")


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/tokenize", tokenize_handler),
    ("POST", "/detokenize", detokenize_handler),
)
