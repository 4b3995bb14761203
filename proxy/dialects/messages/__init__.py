"""Anthropic's Messages dialect: ``POST /v1/messages`` (``?beta=true`` too) and
``POST /v1/messages/count_tokens``.

| module | what |
|---|---|
| ``request`` | the request body, its content blocks and their ``ChatTask`` |
| ``frames`` | the message object, the stream events and Anthropic's error shape |
| ``claude_code`` | Claude Code's billing block, kept out of the prompt (it would defeat the prefix cache) |

``max_tokens`` is required, as Anthropic's, and is a cap: a value beyond what
the context leaves is clamped by the worker, never a 400 (Claude Code sends
32,000 to any model). Keys are taken from ``x-api-key`` as well as
``Authorization`` (``proxy.server.intake``).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from protocol.messages import Submit
from proxy.core.dialect import Context, Dialect, Header, RequestJob, chat_submits
from proxy.core.generation import Frames, Generation, Options
from proxy.core.task import chat_submit, tool_plan
from proxy.dialects.messages.frames import MessagesErrors, MessagesFrames, messages_body
from proxy.dialects.messages.request import (
    FIELDS,
    MessagesRequest,
    chat_task,
    parse_count_tokens_request,
    parse_messages_request,
)
from proxy.server.bodies import encode
from proxy.serving.lookups import tokenize
from proxy.serving.serve import check_grammars
from proxy.serving.side import side_request


class MessagesJob(RequestJob[MessagesRequest]):
    """One Messages request."""

    __slots__ = ()

    def submits(self, request_id: str, context: Context) -> tuple[list[Submit], Options]:
        return chat_submits(chat_task(self.req), request_id, context)

    def frames(self, generation: Generation, header: Header) -> Frames:
        return MessagesFrames(generation, header, self.req.show_thinking)

    def body(self, generation: Generation, header: Header) -> bytes:
        return messages_body(generation, header, self.req.show_thinking)


class TokenCount(msgspec.Struct, gc=False):
    input_tokens: int


async def count_tokens(request: web.Request) -> web.Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": int}``, the whole
    prompt the same Messages request would run with (its ``input_tokens`` plus
    ``cache_read_input_tokens``)."""
    # The task is built with the parse (images decoded), in a thread for a large body.
    side = await side_request(request, lambda body: chat_task(parse_count_tokens_request(body)))
    context, task = side.context, side.req
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
    fields=FIELDS,
)
"""``POST /v1/messages`` (``?beta=true`` too), ``POST /v1/messages/count_tokens``."""
