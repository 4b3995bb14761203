"""vLLM's ``POST /tokenize`` and ``POST /detokenize``.

Shapes (vLLM's ``TokenizeRequest``/``TokenizeResponse``)::

    POST /tokenize    {"model"?, "prompt": str}                        # as /v1/completions would
                   or {"model"?, "messages": [...], "tools"?, "add_generation_prompt"?: true}
                                                                       # as /v1/chat/completions would
    -> {"count": int, "max_model_len": int, "tokens": [int, ...], "token_strs": null}

    POST /detokenize  {"model"?, "tokens": [int, ...]}  -> {"prompt": str}

The prompt is the one the generation endpoint would run: the chat template and
tools applied, client text tokenized as text (``proxy.serving.lookups``).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from proxy.core.dialect import Handler
from proxy.core.fields import REFUSE_NOTHING, TokenId, decode
from proxy.core.task import ChatTask, Sampling, TextTask, chat_submit, text_submits, tool_plan
from proxy.dialects.chat.request import ChatCompletionRequest, chat_task
from proxy.errors import InvalidRequest
from proxy.server.bodies import encode
from proxy.serving.lookups import detokenize, tokenize
from proxy.serving.side import side_request


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


def _parse_tokenize(body: bytes) -> tuple[TokenizeRequest, ChatTask | None]:
    """The body's fields and, for ``messages``, the conversation as
    ``/v1/chat/completions`` would take it. Raises ``InvalidRequest``."""
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
    if head.messages is not None:
        return head, chat_task(decode(body, ChatCompletionRequest, REFUSE_NOTHING, "/tokenize"))
    if head.prompt is None:
        raise InvalidRequest("'/tokenize' needs 'prompt' or 'messages'", param="prompt")
    return head, None


async def tokenize_handler(request: web.Request) -> web.Response:
    """``POST /tokenize`` (module docstring)."""
    side = await side_request(request, _parse_tokenize)
    head, task = side.req
    context = side.context
    if task is not None:
        submit = chat_submit(
            task, "tokenize", context.max_context_tokens, tool_plan(task, context.tool_format)
        )
    else:
        assert head.prompt is not None
        text = TextTask(prompts=(head.prompt,), sampling=Sampling(max_tokens=1))
        submit = text_submits(text, "tokenize", context.max_context_tokens)[0]
    ids = await tokenize(request, submit)
    out = TokenizeResponse(len(ids), side.worker.max_context_tokens, list(ids))
    return web.Response(body=encode(out), content_type="application/json")


async def detokenize_handler(request: web.Request) -> web.Response:
    """``POST /detokenize`` (module docstring)."""
    side = await side_request(
        request, lambda body: decode(body, DetokenizeRequest, REFUSE_NOTHING, "/detokenize")
    )
    text = await detokenize(request, tuple(side.req.tokens))
    return web.Response(body=encode(DetokenizeResponse(text)), content_type="application/json")


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/tokenize", tokenize_handler),
    ("POST", "/detokenize", detokenize_handler),
)
