"""vLLM's ``POST /tokenize`` and ``POST /detokenize``; llama.cpp's ``POST /apply-template``.

Shapes (vLLM's ``TokenizeRequest``/``TokenizeResponse``)::

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true}
                                                                       # as /v1/completions would
                   or {"model"?, "messages": [...], "tools"?, "add_generation_prompt"?: true,
                       "add_special_tokens"?: false}                   # as /v1/chat/completions would
    -> {"count": int, "max_model_len": int, "tokens": [int, ...], "token_strs": null}

    POST /detokenize  {"model"?, "tokens": [int, ...], "skip_special_tokens"?: false}
    -> {"prompt": str}

    POST /apply-template  {chat completions body: "messages", "tools"?, ...}
    -> {"prompt": str}                                                 # llama.cpp's

``/apply-template`` answers the prompt text a chat request runs with (the template,
tools and thinking switch applied), as llama.cpp's does: the text of the ids
``/tokenize`` gives for the same messages, special tokens written out. A conversation
with an image is a 400 naming the image part (``_parse_template``).

The prompt is the one the generation endpoint would run: the chat template and
tools applied, client text tokenized as text (``proxy.serving.lookups``).
``add_special_tokens`` as vLLM's
(``TokenizeCompletionRequest``: default true, ``TokenizeChatRequest``: default false):
``false`` on a prompt leaves out the BOS the tokenizer would put first (what
llama.cpp's ``/tokenize`` counts, ``add_special`` off), ``true`` on messages puts the
tokenizer's leading specials before the template's text (a second BOS where the
template writes one, as vLLM's). ``skip_special_tokens`` on ``/detokenize``: special
tokens leave no text.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from proxy.core.dialect import Handler
from proxy.core.fields import REFUSE_NOTHING, TokenId, decode
from proxy.core.task import ChatTask, Sampling, TextTask, chat_submit, text_submits, tool_plan
from proxy.dialects.chat.request import ChatCompletionRequest, chat_task, parse_chat_request
from proxy.errors import InvalidRequest
from proxy.server.bodies import encode
from proxy.serving.lookups import detokenize, tokenize
from proxy.serving.side import side_request


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's fields; ``return_token_strs`` is a 400 naming it (no token strings)."""

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
    skip_special_tokens: bool = False


class DetokenizeResponse(msgspec.Struct, gc=False):
    prompt: str


def _parse_tokenize(body: bytes) -> tuple[TokenizeRequest, ChatTask | None]:
    """The body's fields and, for ``messages``, the conversation as
    ``/v1/chat/completions`` would take it. Raises ``InvalidRequest``."""
    head = decode(body, TokenizeRequest, REFUSE_NOTHING, "/tokenize")
    if head.return_token_strs:
        raise InvalidRequest("'return_token_strs' is not supported by this server", param="return_token_strs")
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
        specials = bool(head.add_special_tokens)  # vLLM's default for messages: false
    else:
        assert head.prompt is not None
        # false: no BOS; true or absent: the tokenizer's own choice, as generation makes it.
        bos = False if head.add_special_tokens is False else None
        text = TextTask(prompts=(head.prompt,), sampling=Sampling(max_tokens=1, add_bos_token=bos))
        submit = text_submits(text, "tokenize", context.max_context_tokens)[0]
        specials = False
    ids = await tokenize(request, submit, specials)
    out = TokenizeResponse(len(ids), side.worker.max_context_tokens, list(ids))
    return web.Response(body=encode(out), content_type="application/json")


async def detokenize_handler(request: web.Request) -> web.Response:
    """``POST /detokenize`` (module docstring)."""
    side = await side_request(
        request, lambda body: decode(body, DetokenizeRequest, REFUSE_NOTHING, "/detokenize")
    )
    text = await detokenize(request, tuple(side.req.tokens), side.req.skip_special_tokens)
    return web.Response(body=encode(DetokenizeResponse(text)), content_type="application/json")


def _parse_template(body: bytes) -> ChatTask:
    """The conversation as ``/v1/chat/completions`` would take it, without images.
    Raises ``InvalidRequest``: an image part is a 400 naming it, since its place in the
    prompt is embeddings, not text (llama.cpp writes a ``<__media__>`` marker there, a
    string its own ``/completion`` reads back and this server's would take as text)."""
    task = chat_task(parse_chat_request(body))
    image = next((i for m in task.messages for i in m.images), None)
    if image is not None:
        raise InvalidRequest(
            f"'{image.param}' is an image: '/apply-template' answers the prompt as text, and an"
            " image's place in it is embeddings; '/tokenize' counts its tokens",
            param=image.param,
        )
    return task


async def apply_template_handler(request: web.Request) -> web.Response:
    """llama.cpp's ``POST /apply-template`` (module docstring)."""
    side = await side_request(request, _parse_template)
    context = side.context
    submit = chat_submit(
        side.req, "template", context.max_context_tokens, tool_plan(side.req, context.tool_format)
    )
    text = await detokenize(request, await tokenize(request, submit))
    return web.Response(body=encode(DetokenizeResponse(text)), content_type="application/json")


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/tokenize", tokenize_handler),
    ("POST", "/detokenize", detokenize_handler),
    ("POST", "/apply-template", apply_template_handler),
)
