"""The OpenAI chat completions dialect: ``POST /v1/chat/completions``.

| module | what |
|---|---|
| ``request`` | the request body, its validation and its ``ChatTask`` |
| ``frames`` | ``chat.completion.chunk`` stream events and the ``chat.completion`` body |
| ``tokenize`` | vLLM's ``POST /tokenize`` and ``POST /detokenize`` (chat messages rendered as here) |
"""

from __future__ import annotations

import dataclasses

from protocol.messages import Submit
from proxy.core.dialect import Context, Dialect, Header, RequestJob, chat_submits
from proxy.core.generation import Frames, Generation, Options
from proxy.dialects.chat.frames import ChatFrames, chat_body
from proxy.dialects.chat.request import ChatCompletionRequest, chat_task, parse_chat_request
from proxy.dialects.chat.tokenize import ROUTES as TOKENIZE_ROUTES
from proxy.errors import OPENAI_ERRORS


class ChatJob(RequestJob[ChatCompletionRequest]):
    """One chat completions request."""

    __slots__ = ()

    def submits(self, request_id: str, context: Context) -> tuple[list[Submit], Options]:
        submits, options = chat_submits(chat_task(self.req), request_id, context)
        if self.req.reasoning_format is not None and options.reasoning_field == "reasoning":
            # llama.cpp's formats name the field reasoning_content (ChatCompletionRequest).
            options = dataclasses.replace(options, reasoning_field="reasoning_content")
        return submits, options

    def frames(self, generation: Generation, header: Header) -> Frames:
        req = self.req
        return ChatFrames(
            generation,
            header,
            "chat.completion.chunk",
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            timings=req.timings_per_token,
        )

    def body(self, generation: Generation, header: Header) -> bytes:
        return chat_body(generation, header, self.req.timings_per_token)


CHAT = Dialect(
    name="chat",
    id_prefix="chatcmpl-",
    errors=OPENAI_ERRORS,
    parse=lambda body: ChatJob(parse_chat_request(body)),
    extra_routes=TOKENIZE_ROUTES,
)
"""``POST /v1/chat/completions``; vLLM's ``/tokenize`` and ``/detokenize``."""

__all__ = ["CHAT", "ChatCompletionRequest", "ChatJob", "parse_chat_request"]
