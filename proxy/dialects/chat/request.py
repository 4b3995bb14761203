"""``POST /v1/chat/completions`` request bodies and their conversion into a ``ChatTask``.

Shapes follow the OpenAI API reference for chat completions, plus the extras
other local servers accept (``proxy.dialects.openai.request.OpenAIFields``)
and vLLM's ``add_generation_prompt``. Every validation failure raises
``proxy.errors.InvalidRequest`` whose message and ``param`` name the field
(``max_tokens``, ``messages[0].content``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from protocol.messages import ImageInput
from proxy.core.fields import Count, Effort, Refusals, decode, never, thinking, tool_config
from proxy.core.images import data_url_image, join_parts
from proxy.core.task import ChatTask
from proxy.dialects.openai.request import ContentPart, OpenAIFields
from proxy.errors import InvalidRequest
from proxy.tools import HistoryMessage, ToolCall, ToolChoiceIn, ToolIn


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """One chat turn as clients send it; ``content`` may be a string, a list of
    text parts, or ``null`` (an assistant turn that only called tools).
    ``tool_calls`` (assistant), ``tool_call_id`` (tool) and ``name`` carry the
    tool side of the conversation (``proxy.tools``)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    """An assistant turn's thinking sent back (llama.cpp's, DeepSeek's name)."""
    reasoning: str | None = None
    """The same under vLLM's and Ollama's name."""


class ChatCompletionRequest(OpenAIFields, kw_only=True):
    """``POST /v1/chat/completions`` body. ``max_completion_tokens`` wins over the
    deprecated ``max_tokens``."""

    messages: list[ChatMessageIn]
    max_completion_tokens: Count | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Effort | None = None
    chat_template_kwargs: dict[str, object] | None = None
    reasoning_format: Literal["auto", "deepseek", "deepseek-legacy", "none"] | None = None
    """llama.cpp's per-request reasoning format: ``auto`` and ``deepseek`` put the
    thinking in ``reasoning_content`` (llama.cpp's field) whatever
    ``--reasoning-field`` says (``both`` keeps both names); ``none`` (thinking left in
    ``content``) and ``deepseek-legacy`` (its tags in ``content`` too) are refused: the
    thinking is never mixed into the answer here."""

    def logprobs_k(self) -> int | None:
        """``top_logprobs`` (0 when absent) when ``logprobs`` is true, else ``None``."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def completion_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else ``None``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# Fields the OpenAI API defines that this server does not implement, each with
# the values that ask for nothing.
REFUSED: Refusals = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "prediction": never,
    "modalities": lambda v: v == ["text"],
    "audio": never,
    "web_search_options": never,
}


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat completions body. Raises ``InvalidRequest``."""
    req = decode(body, ChatCompletionRequest, REFUSED, "/v1/chat/completions")
    if not req.messages:
        raise InvalidRequest("'messages' must contain at least one message", param="messages")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    if req.reasoning_format in ("none", "deepseek-legacy"):
        raise InvalidRequest(
            f"'reasoning_format' {req.reasoning_format!r} would put the thinking in 'content'; this "
            "server keeps it apart from the answer: use 'auto' or 'deepseek' (reasoning_content)",
            param="reasoning_format",
        )
    taken = sorted(set(req.chat_template_kwargs or ()) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise InvalidRequest(
            f"'chat_template_kwargs' may not set {', '.join(taken)}: the request's own fields do",
            param="chat_template_kwargs",
        )
    return req


_TEMPLATE_ARGUMENTS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "chat_template",
    }
)
"""Names ``apply_chat_template`` takes as its own arguments: not template variables."""


def content_and_images(
    content: str | list[ContentPart] | None, where: str, *, images: bool = True
) -> tuple[str | None, tuple[ImageInput, ...]]:
    """A message's ``content`` as text and its ``image_url`` parts (where ``images``)
    as images at their offsets (``proxy.core.images.join_parts``). Raises
    ``InvalidRequest`` naming ``where[j]`` for a part of another type, a text part
    without ``text``, an image part without ``image_url``, or an image that is
    not a base64 data URL of a format taken."""
    if content is None or isinstance(content, str):
        return content, ()
    parts: list[str | None] = []
    urls: list[tuple[str, str]] = []
    for j, part in enumerate(content):
        param = f"{where}[{j}]"
        if part.type == "text" and part.text is not None:
            parts.append(part.text)
        elif part.type == "image_url" and images and part.image_url is not None:
            parts.append(None)
            urls.append((part.image_url.url, param))
        else:
            taken = "text and image_url parts" if images else "text parts (images in user messages only)"
            problem = {
                "text": "a text part without 'text'",
                "image_url": "an image_url part without 'image_url'" if images else "an image",
            }.get(part.type, f"type '{part.type}'")
            raise InvalidRequest(f"Only {taken} are supported here; '{param}' is {problem}", param=param)
    text, offsets = join_parts(parts)
    return text, tuple(data_url_image(url, param, at) for (url, param), at in zip(urls, offsets, strict=True))


def _turn(i: int, m: ChatMessageIn) -> HistoryMessage:
    # OpenAI takes image parts in user messages only.
    content, images = content_and_images(m.content, f"messages[{i}].content", images=m.role == "user")
    return HistoryMessage(
        role=m.role,
        content=content,
        tool_calls=tuple(m.tool_calls or ()),
        tool_call_id=m.tool_call_id,
        name=m.name,
        reasoning=m.reasoning_content if m.reasoning_content is not None else m.reasoning,
        images=images,
    )


def chat_task(req: ChatCompletionRequest) -> ChatTask:
    """The request as a ``ChatTask``. Raises ``InvalidRequest``."""
    tools = tool_config(req.tools, req.tool_choice, req.parallel_tool_calls)
    messages = tuple(_turn(i, m) for i, m in enumerate(req.messages))
    sampling = req.sampling(max_tokens=req.completion_limit(), stop=req.stop, logprobs=req.logprobs_k())
    sampling, template_kwargs = thinking(sampling, req.reasoning_effort, req.chat_template_kwargs)
    return ChatTask(
        messages=messages,
        sampling=sampling,
        template_kwargs=template_kwargs,
        tools=tools,
        json_output=req.json_output(),
        n=req.n,
        add_generation_prompt=req.add_generation_prompt,
        parallel_asked=req.parallel_tool_calls is not None,
        cache_salt=req.cache_salt,
    )
