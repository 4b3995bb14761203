"""Anthropic's Messages dialect: ``POST /v1/messages`` (``?beta=true`` too) and
``POST /v1/messages/count_tokens``.

| module | what |
|---|---|
| ``request`` | the request body, its content blocks and their ``ChatTask`` |
| ``frames`` | the message object, the stream events and Anthropic's error shape |

``max_tokens`` is required, as Anthropic's, and is a cap: a value beyond what
the context leaves is clamped by the worker, never a 400 (Claude Code sends
32,000 to any model). Keys are taken from ``x-api-key`` as well as
``Authorization`` (``proxy.intake``).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from protocol.messages import Submit
from proxy.dialect import Context, Dialect, Header, chat_submits
from proxy.dialects.messages.frames import MessagesErrors, MessagesFrames, messages_body
from proxy.dialects.messages.request import (
    MessagesRequest,
    chat_task,
    parse_count_tokens_request,
    parse_messages_request,
)
from proxy.generation import Frames, Generation, Options
from proxy.lookups import tokenize
from proxy.responses import encode
from proxy.serve import check_grammars, context_of, read_request, ready_worker
from proxy.state import STATE
from proxy.task import chat_submit, tool_plan


class MessagesJob:
    """One Messages request."""

    __slots__ = ("req",)

    def __init__(self, req: MessagesRequest) -> None:
        self.req = req

    @property
    def stream(self) -> bool:
        return self.req.stream

    def submits(self, request_id: str, context: Context) -> tuple[list[Submit], Options]:
        progress = self.req.stream and self.req.return_progress
        return chat_submits(chat_task(self.req), request_id, context, progress=progress)

    def frames(self, generation: Generation, header: Header) -> Frames:
        return MessagesFrames(generation, header)

    def body(self, generation: Generation, header: Header) -> bytes:
        return messages_body(generation, header)


class TokenCount(msgspec.Struct, gc=False):
    input_tokens: int


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": int}``, the whole
    prompt the same Messages request would run with (its ``input_tokens`` plus
    ``cache_read_input_tokens``)."""
    body = await read_request(request)
    req = parse_count_tokens_request(body)
    state = request.app[STATE]
    context = context_of(state, ready_worker(state))
    task = chat_task(req)
    submit = chat_submit(task, "count", context.max_context_tokens, tool_plan(task, context.tool_format))
    await check_grammars([submit])  # as the same Messages request would be refused
    ids = await tokenize(request, submit)
    return web.Response(body=encode(TokenCount(len(ids))), content_type="application/json")


MESSAGES = Dialect(
    name="messages",
    id_prefix="msg_",
    errors=MessagesErrors(),
    parse=lambda body: MessagesJob(parse_messages_request(body)),
    extra_routes=(("POST", "/v1/messages/count_tokens", count_tokens),),
)
"""``POST /v1/messages`` (``?beta=true`` too), ``POST /v1/messages/count_tokens``."""
