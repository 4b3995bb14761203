"""``POST /v1/messages`` (Anthropic Messages) request bodies and their ``ChatTask``.

Shapes follow Anthropic's API reference ("Messages", "Count message tokens")::

    {"model": str, "max_tokens": int,                  # required; a cap, clamped to the context
     "system"?: str | [{"type": "text", "text": str}],
     "messages": [{"role": "user" | "assistant" | "system", "content": str | [block, ...]}],
     "tools"?: [{"name", "description"?, "input_schema": {JSON schema}, "type"?: "custom",
                 "defer_loading"?: bool}],
     "tool_choice"?: {"type": "auto" | "any" | "tool" | "none", "name"?,
                      "disable_parallel_tool_use"?: bool},
     "stop_sequences"?, "temperature"? (0..1), "top_p"?, "top_k"?, "stream"?}

    block: {"type": "text", "text"} | {"type": "tool_use", "id", "name", "input": {...}}
         | {"type": "tool_result", "tool_use_id", "content": str | [text blocks], "is_error"?}
         | {"type": "thinking", "thinking": str, "signature": str}  # the turn's thinking
         | {"type": "redacted_thinking", "data": str}   # accepted, dropped (opaque)

``tool_use`` blocks join their assistant turn as calls; ``tool_result`` blocks
become tool turns. A ``system`` message inside ``messages`` (Claude Code 2.1
sends its environment notes as one, after the user's turn) is a system turn at
its place, text only. A tool with ``defer_loading: true`` is one the client
will load later through its own tool search: it is left out of what the model
sees, as Anthropic's API leaves it out of the context until it is loaded (a
``tool_reference`` block that would load it is refused, as every non-text
block in a tool result is). ``thinking``: ``{"type": "enabled", "budget_tokens"}``
is the thinking budget, ``{"type": "disabled"}`` no thinking, ``{"type":
"adaptive"}`` the model's own choice (``display: "omitted"`` sends the thinking
block empty, signature only). A ``thinking`` block sent back is its assistant
turn's thinking, given to the template (which keeps or drops it), its signature
not checked (it is no secret here: the client may send any history).
What changes nothing here (
``context_management``, ``cache_control``, ``metadata``, ``service_tier``) is
accepted; what would change the answer and cannot be honoured (images,
documents, server tools, MCP servers) is a 400 naming it. Claude Code's billing
line at the start of ``system`` never reaches the prompt (``claude_code``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

import msgspec

from protocol.messages import ImageInput
from proxy.core.fields import (
    MESSAGES_MAX_STOPS,
    Count,
    Refusals,
    SamplerFields,
    decode,
    function_tool,
    json_output,
    named_choice,
    tool_config,
)
from proxy.core.images import base64_image, data_url_image, join_parts
from proxy.core.task import ChatTask, JsonOutput, Sampling
from proxy.dialects.messages.claude_code import without_billing_header
from proxy.errors import FieldNames, InvalidRequest, quoted
from proxy.tools import FunctionCall, HistoryMessage, ToolCall, ToolChoiceIn, ToolIn


class ToolIn_(msgspec.Struct, kw_only=True):
    """``tools[i]``: a client tool (``type`` absent or ``custom``) with its
    ``input_schema``; server tools (``web_search_...``, ``bash_...``) are refused."""

    name: str | None = None
    description: str | None = None
    input_schema: dict[str, object] | None = None
    type: str | None = None
    defer_loading: bool = False


class ToolChoiceIn_(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormatIn(msgspec.Struct, kw_only=True):
    """Structured outputs: ``{"type": "json_schema", "schema": {...}}``."""

    type: str
    schema: dict[str, object] | bool | None = None


class OutputConfigIn(msgspec.Struct, kw_only=True):
    """``output_config``: ``format`` is honoured (a JSON schema grammar);
    ``effort`` is accepted (a hint for reasoning models)."""

    format: OutputFormatIn | None = None
    effort: str | None = None


class ThinkingIn(msgspec.Struct, kw_only=True):
    """``thinking`` (module docstring)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, object]]


class MessagesRequest(SamplerFields, kw_only=True):
    """``POST /v1/messages`` body (module docstring), with the sampler fields
    every dialect takes (``proxy.core.fields.SamplerFields``: ``min_p``,
    ``seed``, penalties, ``return_progress``, ...); ``temperature`` in
    Anthropic's range, 0 to 1; up to ``MESSAGES_MAX_STOPS`` stop sequences."""

    MAX_STOPS: ClassVar[int] = MESSAGES_MAX_STOPS

    max_tokens: Count
    messages: list[MessageIn]
    system: str | list[dict[str, object]] | None = None
    tools: list[ToolIn_] | None = None
    tool_choice: ToolChoiceIn_ | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    output_config: OutputConfigIn | None = None
    output_format: OutputFormatIn | None = None
    thinking: ThinkingIn | None = None

    def thinking_budget_of(self) -> int | None:
        """The thinking budget: the sampler fields' (llama.cpp's name), else
        ``thinking``'s. Raises ``InvalidRequest`` for ``enabled`` without a budget."""
        own = self.thinking_budget()
        t = self.thinking
        if own is not None or t is None:
            return own
        if t.type == "disabled":
            return 0
        if t.type == "enabled":
            if t.budget_tokens is None:
                raise InvalidRequest(
                    "'thinking' of type 'enabled' needs 'budget_tokens'", param="thinking.budget_tokens"
                )
            return t.budget_tokens
        return None

    @property
    def show_thinking(self) -> bool:
        return self.thinking is None or self.thinking.display != "omitted"


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens`` body: a Messages body without ``max_tokens``."""

    model: str | None = None
    messages: list[MessageIn]
    system: str | list[dict[str, object]] | None = None
    tools: list[ToolIn_] | None = None
    tool_choice: ToolChoiceIn_ | None = None
    output_config: OutputConfigIn | None = None
    output_format: OutputFormatIn | None = None


def _empty(v: object) -> bool:
    return v in ([], None)


REFUSED: Refusals = {"mcp_servers": _empty, "container": _empty}
"""Fields that would change the answer and cannot be honoured here."""

FIELDS = FieldNames({"stop": "stop_sequences", "response_format": "output_config.format"})
"""The wire's names in this dialect's terms."""


def parse_messages_request(body: bytes) -> MessagesRequest:
    """Decode and validate a Messages body. Raises ``InvalidRequest``; also for a
    last message of the assistant (Anthropic's prefill: the reply would continue
    that text, which the worker's chat template cannot do: it closes every turn)."""
    req = decode(body, MessagesRequest, REFUSED, "/v1/messages")
    if not req.messages:
        raise InvalidRequest("'messages' must contain at least one message", param="messages")
    if req.messages[-1].role == "assistant":
        last = f"messages[{len(req.messages) - 1}]"
        raise InvalidRequest(
            f"'{last}' is the assistant's: continuing a prefilled assistant turn is not supported by "
            "this server; end the conversation with a user message",
            param=last,
        )
    return req


def parse_count_tokens_request(body: bytes) -> CountTokensRequest:
    """Decode and validate a count_tokens body. Raises ``InvalidRequest``."""
    req = decode(body, CountTokensRequest, REFUSED, "/v1/messages/count_tokens")
    if not req.messages:
        raise InvalidRequest("'messages' must contain at least one message", param="messages")
    return req


def _block_text(block: Mapping[str, object], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"'{where}.text' must be a string", param=f"{where}.text")
    return text


def _text_blocks(content: object, where: str) -> str:
    """A ``system`` content: a string or text blocks, joined with a newline."""
    text, _ = _result_blocks(content, where, images=False)
    return text


def _result_blocks(content: object, where: str, *, images: bool = True) -> tuple[str, tuple[ImageInput, ...]]:
    """A ``tool_result`` content (a string, or text and, where ``images``, image
    blocks: a screenshot a tool returned) as text and its images at their offsets
    (``proxy.core.images.join_parts``)."""
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of text blocks", param=where)
    parts: list[str | None] = []
    found: list[tuple[Mapping[str, object], str]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
        if isinstance(block, Mapping) and kind == "image" and images:
            parts.append(None)
            found.append((block, at))
        elif isinstance(block, Mapping) and kind == "text":
            parts.append(_block_text(block, at))
        else:
            taken = "text and image blocks" if images else "text blocks"
            message = f"'{at}' is of type {quoted(kind)}; only {taken} are supported here"
            raise InvalidRequest(message, param=at)
    text, offsets = join_parts(parts)
    return text, tuple(_image(b, at, o) for (b, at), o in zip(found, offsets, strict=True))


_DROPPED = frozenset({"redacted_thinking"})


def history(system: object, messages: list[MessageIn]) -> tuple[HistoryMessage, ...]:
    """``system`` and ``messages`` as chat turns (module docstring). Raises
    ``InvalidRequest`` naming ``messages[i].content[j]``, also where Anthropic's
    API refuses a conversation (``_check_result``, empty content)."""
    turns: list[HistoryMessage] = []
    system = without_billing_header(system)
    if system:
        turns.append(HistoryMessage(role="system", content=_text_blocks(system, "system")))
    seen_ids: set[str] = set()
    asked: set[str] = set()  # tool_use ids of the message just before
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if not m.content and not (i == len(messages) - 1 and m.role == "assistant"):
            raise InvalidRequest(
                f"'messages[{i}]': all messages must have non-empty content except for the optional "
                "final assistant message",
                param=where,
            )
        if m.role == "system":
            turns.append(HistoryMessage(role="system", content=_text_blocks(m.content, where)))
            asked = set()
            continue
        if isinstance(m.content, str):
            turns.append(HistoryMessage(role=m.role, content=m.content))
            asked = set()
            continue
        texts: list[str | None] = []  # None: an image, at its place among the texts
        images: list[tuple[Mapping[str, object], str]] = []
        thoughts: list[str] = []
        calls: list[ToolCall] = []
        results: list[HistoryMessage] = []
        answered: set[str] = set()
        for j, block in enumerate(m.content):
            at = f"{where}[{j}]"
            kind = block.get("type")
            if kind == "text":
                texts.append(_block_text(block, at))
            elif kind == "image" and m.role == "user":
                texts.append(None)
                images.append((block, at))
            elif kind == "tool_use" and m.role == "assistant":
                tool_id, name = block.get("id"), block.get("name")
                if not isinstance(tool_id, str) or not isinstance(name, str):
                    raise InvalidRequest(f"'{at}' needs a string 'id' and 'name'", param=at)
                tool_input = block.get("input", {})
                if not isinstance(tool_input, Mapping):
                    raise InvalidRequest(f"'{at}.input' must be an object", param=f"{at}.input")
                if tool_id in seen_ids:
                    raise InvalidRequest(
                        f"'{at}': `tool_use` ids must be unique, {quoted(tool_id)} is not", param=at
                    )
                seen_ids.add(tool_id)
                args = msgspec.json.encode(tool_input).decode()
                calls.append(ToolCall(id=tool_id, function=FunctionCall(name, args)))
            elif kind == "tool_result" and m.role == "user":
                tool_id = block.get("tool_use_id")
                if not isinstance(tool_id, str):
                    raise InvalidRequest(f"'{at}.tool_use_id' must be a string", param=f"{at}.tool_use_id")
                _check_result(tool_id, asked, answered, at)
                text, pictures = _result_blocks(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    marker = "Error: "
                    text = marker + text
                    pictures = tuple(
                        msgspec.structs.replace(p, offset=p.offset + len(marker)) for p in pictures
                    )
                results.append(
                    HistoryMessage(role="tool", content=text, tool_call_id=tool_id, images=pictures)
                )
            elif kind == "thinking" and m.role == "assistant":
                thought = block.get("thinking")
                if not isinstance(thought, str):
                    raise InvalidRequest(f"'{at}.thinking' must be a string", param=f"{at}.thinking")
                thoughts.append(thought)
            elif kind in _DROPPED and m.role == "assistant":
                continue  # opaque: nothing the template could render
            else:
                raise InvalidRequest(
                    f"'{at}' is a block of type {quoted(kind)} in a {m.role} message; this server takes "
                    "text, image (user), tool_use (assistant) and tool_result (user) blocks (no "
                    "documents or server tools)",
                    param=at,
                )
        asked = {c.id for c in calls}
        # A user turn's results come first: they answer the assistant turn before it.
        turns += results
        if texts or calls or not results:
            content, offsets = join_parts(texts) if texts else (None, ())
            reasoning = "\n".join(thoughts) if thoughts else None
            pictures = tuple(_image(b, at, o) for (b, at), o in zip(images, offsets, strict=True))
            turns.append(
                HistoryMessage(
                    role=m.role,
                    content=content,
                    tool_calls=tuple(calls),
                    reasoning=reasoning,
                    images=pictures,
                )
            )
    return tuple(turns)


def _image(block: Mapping[str, object], at: str, offset: int) -> ImageInput:
    """An ``image`` block's image: a ``base64`` source (``media_type``, ``data``); a
    ``url`` source is refused (``proxy.core.images``: no fetching), a ``file`` one
    too (this server stores no files)."""
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise InvalidRequest(f"'{at}.source' must be an object", param=f"{at}.source")
    kind = source.get("type")
    if kind == "url":
        url = source.get("url")
        return data_url_image(url if isinstance(url, str) else "", at, offset)
    if kind != "base64":
        raise InvalidRequest(
            f"'{at}.source' is of type {quoted(kind)}; this server takes base64 images (no files)",
            param=f"{at}.source",
        )
    media_type, data = source.get("media_type"), source.get("data")
    if not isinstance(media_type, str) or not isinstance(data, str):
        raise InvalidRequest(f"'{at}.source' needs a string 'media_type' and 'data'", param=f"{at}.source")
    return base64_image(media_type, data, at, offset)


def _check_result(tool_id: str, asked: set[str], answered: set[str], at: str) -> None:
    """A ``tool_result`` answers a ``tool_use`` of the message just before, once,
    as Anthropic's API requires ("Each `tool_result` block must have a
    corresponding `tool_use` block in the previous message"). Raises
    ``InvalidRequest`` naming ``at.tool_use_id``."""
    param = f"{at}.tool_use_id"
    if tool_id not in asked:
        raise InvalidRequest(
            f"'{param}': unexpected `tool_use_id` found in `tool_result` blocks: {quoted(tool_id)}. Each "
            "`tool_result` block must have a corresponding `tool_use` block in the previous message.",
            param=param,
        )
    if tool_id in answered:
        raise InvalidRequest(f"'{param}': {quoted(tool_id)} has more than one `tool_result`", param=param)
    answered.add(tool_id)


def _tools(
    tools: list[ToolIn_] | None, choice: ToolChoiceIn_ | None
) -> tuple[list[ToolIn], ToolChoiceIn | None, bool | None]:
    tools_in = []
    for i, t in enumerate(tools or ()):
        if t.type not in (None, "custom"):
            raise InvalidRequest(
                f"'tools[{i}]' is a server tool of type {quoted(t.type)}; only client tools (with "
                "'input_schema') are supported",
                param=f"tools[{i}]",
            )
        if t.defer_loading:
            continue  # not loaded yet: the model does not see it (module docstring)
        tools_in.append(function_tool(t.name, t.description, t.input_schema))
    if choice is None:
        return tools_in, None, None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return tools_in, named_choice(choice.name), parallel
    return tools_in, {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _json_output(config: OutputConfigIn | None, legacy: OutputFormatIn | None) -> JsonOutput | None:
    """``output_config.format`` (or the older ``output_format``) as a JSON output."""
    fmt, where = (config.format, "output_config.format") if config is not None else (None, "")
    if fmt is None:
        fmt, where = legacy, "output_format"
    if fmt is None:
        return None
    return json_output(
        fmt.type, fmt.schema, param=where, schema_param=f"{where}.schema", strict=True, kinds=("json_schema",)
    )


def chat_task(req: MessagesRequest | CountTokensRequest) -> ChatTask:
    """The request as a ``ChatTask`` (count_tokens: with 1 token to generate,
    which the count does not depend on). Raises ``InvalidRequest``."""
    tools_in, choice, parallel = _tools(req.tools, req.tool_choice)
    tools = tool_config(tools_in, choice, parallel)
    if isinstance(req, MessagesRequest):
        sampling = req.sampling(max_tokens=req.max_tokens, stop=req.stop_sequences, logprobs=None)
        sampling = dataclasses.replace(sampling, reasoning_budget=req.thinking_budget_of())
    else:
        sampling = Sampling(max_tokens=1)
    return ChatTask(
        messages=history(req.system, req.messages),
        sampling=sampling,
        tools=tools,
        json_output=_json_output(req.output_config, req.output_format),
        parallel_asked=parallel is not None,
        cache_salt=req.cache_salt if isinstance(req, MessagesRequest) else None,
    )
