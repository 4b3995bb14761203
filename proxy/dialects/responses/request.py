"""``POST /v1/responses`` request bodies and their conversion into a ``ChatTask``.

Stateless: ``input`` is a string or a list of items, and the whole conversation
comes with every request (``previous_response_id`` and stored items need a
response store, which this server does not keep: refused naming the field).

Items (OpenAI API reference, "Create a model response", ``input``)::

    {"role": "user" | "assistant" | "system" | "developer",
     "content": str | [{"type": "input_text" | "output_text", "text": str}, ...],
     "type"?: "message"}
    {"type": "function_call", "call_id": str, "name": str, "arguments": str}
    {"type": "function_call_output", "call_id": str, "output": str | [input_text parts]}
    {"type": "reasoning", "content"?: [{"type": "reasoning_text", "text"}],
     "summary"?: [{"type": "summary_text", "text"}]}   # the next assistant turn's thinking

Consecutive ``function_call`` items join the assistant turn before them (one
turn with its calls, as chat history has it); ``instructions`` is a system
message in front; a ``reasoning`` item is the thinking of the assistant turn after
it (given to the template, which keeps or drops it; never content).
``reasoning.effort`` ``none`` switches thinking off, another effort goes to the
template (``proxy.core.fields.thinking``); ``reasoning.summary`` is accepted (no
summary is written: the thinking itself comes as ``reasoning_text``). Fields that
change nothing here (``store``, ``include``, ``prompt_cache_key``, ``metadata``, ...)
are accepted; what would
change the output and cannot be honoured (images, files, audio, built-in tools,
``previous_response_id``, ``background``) is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

from protocol.messages import ImageInput
from proxy.core.fields import (
    Count,
    Effort,
    Refusals,
    SamplerFields,
    decode,
    function_tool,
    json_output,
    named_choice,
    never,
    thinking,
    tool_config,
)
from proxy.core.images import data_url_image, join_parts
from proxy.core.task import ChatTask, JsonOutput
from proxy.errors import FieldNames, InvalidRequest, quoted
from proxy.tools import FunctionCall, HistoryMessage, ToolCall, ToolChoiceIn


class TextFormatIn(msgspec.Struct, kw_only=True):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (with
    ``name``, ``schema``, ``strict``, ``description`` beside ``type``)."""

    type: str
    name: str | None = None
    description: str | None = None
    schema: dict[str, object] | bool | None = None
    strict: bool | None = None


class TextConfigIn(msgspec.Struct, kw_only=True):
    """``text``: its ``format``; ``verbosity`` is accepted (a hint for
    reasoning models; it changes nothing here)."""

    format: TextFormatIn | None = None
    verbosity: str | None = None


class FunctionToolIn(msgspec.Struct, kw_only=True):
    """``tools[i]``: ``{"type": "function", "name", "description", "parameters",
    "strict"}``; any other ``type`` (built-in tools) is refused by name."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ReasoningIn(msgspec.Struct, kw_only=True):
    """``reasoning``: ``effort`` (``none`` = no thinking) and ``summary`` (accepted)."""

    effort: Effort | None = None
    summary: str | None = None


class ToolChoiceObjectIn(msgspec.Struct, kw_only=True):
    """``tool_choice`` as an object: ``{"type": "function", "name": str}``."""

    type: str
    name: str | None = None


class ResponsesRequest(SamplerFields, kw_only=True):
    """``POST /v1/responses`` body (module docstring), with the sampler fields
    every dialect takes (``proxy.core.fields.SamplerFields``: ``top_k``,
    ``min_p``, penalties, ``seed``, ``return_progress``, ...) and ``stop``."""

    input: str | list[dict[str, object]]
    instructions: str | None = None
    tools: list[FunctionToolIn] | None = None
    tool_choice: str | ToolChoiceObjectIn | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfigIn | None = None
    max_output_tokens: Count | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    include: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, object] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stop: str | list[str] | None = None
    reasoning: ReasoningIn | None = None

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token when the output text's logprobs were asked for
        (``include`` ``message.output_text.logprobs``, or ``top_logprobs``)."""
        if self.top_logprobs is not None or (self.include and LOGPROBS_INCLUDE in self.include):
            return self.top_logprobs or 0
        return None


LOGPROBS_INCLUDE = "message.output_text.logprobs"

REFUSED: Refusals = {
    "previous_response_id": never,
    "conversation": never,
    "prompt": never,
    "background": lambda v: v is False,
    "max_tool_calls": never,
}
"""Fields that would change the answer and need what this server does not
keep (a response store, prompt templates, background runs)."""

FIELDS = FieldNames(
    {
        "messages": "input",
        "max_tokens": "max_output_tokens",
        "logprobs": "top_logprobs",
        "response_format": "text.format",
    },
    renumbered=frozenset({"messages"}),
)
"""The wire's names in this dialect's terms: ``input`` items are not chat
messages one for one (``instructions`` comes first, calls join their turn)."""


def parse_responses_request(body: bytes) -> ResponsesRequest:
    """Decode and validate a Responses body. Raises ``InvalidRequest``."""
    req = decode(body, ResponsesRequest, REFUSED, "/v1/responses")
    if isinstance(req.input, list) and not req.input:
        raise InvalidRequest("'input' must be a string or a non-empty list of items", param="input")
    return req


def _content_of(
    content: object, where: str, kinds: frozenset[str], *, images: bool
) -> tuple[str, tuple[ImageInput, ...]]:
    """A message's content or a tool output as text and, where ``images``, its ``input_image`` parts
    as images at their offsets (``proxy.core.images.join_parts``): a string, or
    parts (text ``type`` among ``kinds``). ``input_image`` takes an ``image_url``
    (a base64 data URL); a ``file_id`` is refused by name: this server stores no
    files."""
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of content parts", param=where)
    parts: list[str | None] = []
    urls: list[tuple[str, str]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, Mapping):
            raise InvalidRequest(f"'{at}' must be a content part object", param=at)
        kind = part.get("type")
        if kind == "input_image" and images:
            if part.get("file_id") is not None:
                raise InvalidRequest(
                    f"'{at}.file_id': this server stores no files; send the image as 'image_url' "
                    "(a data URL)",
                    param=f"{at}.file_id",
                )
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequest(f"'{at}' needs a string 'image_url'", param=at)
            parts.append(None)
            urls.append((url, at))
            continue
        if kind not in kinds:
            taken = ", ".join(sorted(kinds | ({"input_image"} if images else set())))
            raise InvalidRequest(
                f"'{at}' is of type {quoted(kind)}; only these parts are supported here: {taken} (no "
                "files or audio; images in user messages and tool outputs)",
                param=at,
            )
        text = part.get("text") if kind != "refusal" else part.get("refusal")
        if not isinstance(text, str):
            raise InvalidRequest(f"'{at}' needs a string 'text'", param=at)
        parts.append(text)
    joined, offsets = join_parts(parts)
    return joined, tuple(data_url_image(url, at, o) for (url, at), o in zip(urls, offsets, strict=True))


_MESSAGE_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_OUTPUT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = frozenset({"user", "assistant", "system", "developer"})


def _string(item: Mapping[str, object], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{where}.{key}' must be a non-empty string", param=f"{where}.{key}")
    return value


def history(req: ResponsesRequest) -> tuple[HistoryMessage, ...]:
    """``instructions`` and ``input`` as chat turns (module docstring). Raises
    ``InvalidRequest`` naming ``input[i]...``."""
    turns: list[HistoryMessage] = []
    if req.instructions:
        turns.append(HistoryMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        turns.append(HistoryMessage(role="user", content=req.input))
        return tuple(turns)
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if thought is not None and kind not in ("message", "function_call", "reasoning"):
            thought = None
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequest(
                    f"'{where}.role' must be one of {', '.join(sorted(_ROLES))}", param=f"{where}.role"
                )
            assert isinstance(role, str)
            if "content" not in item:  # as OpenAI's API: "Missing required parameter"
                raise InvalidRequest(
                    f"Missing required parameter: '{where}.content'", param=f"{where}.content"
                )
            text, images = _content_of(
                item["content"], f"{where}.content", _MESSAGE_PARTS, images=role == "user"
            )
            reasoning = thought if role == "assistant" else None
            thought = None
            turns.append(HistoryMessage(role=role, content=text, reasoning=reasoning, images=images))
        elif kind == "function_call":
            call = ToolCall(
                id=_string(item, "call_id", where),
                function=FunctionCall(_string(item, "name", where), str(item.get("arguments") or "{}")),
            )
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant":
                turns[-1] = msgspec.structs.replace(last, tool_calls=(*last.tool_calls, call))
            else:
                turns.append(
                    HistoryMessage(role="assistant", content=None, tool_calls=(call,), reasoning=thought)
                )
            thought = None
        elif kind == "function_call_output":
            if "output" not in item:
                raise InvalidRequest(f"Missing required parameter: '{where}.output'", param=f"{where}.output")
            output, images = _content_of(item["output"], f"{where}.output", _OUTPUT_PARTS, images=True)
            call_id = _string(item, "call_id", where)
            turns.append(HistoryMessage(role="tool", content=output, tool_call_id=call_id, images=images))
        elif kind == "reasoning":
            thought = _reasoning_text(item, where)
        else:
            raise InvalidRequest(
                f"'{where}' is an item of type {quoted(kind)}; this server takes messages, function_call, "
                "function_call_output and reasoning items (no built-in tool calls, no item references: "
                "it stores no responses)",
                param=where,
            )
    if not turns:
        raise InvalidRequest("'input' holds no message", param="input")
    return tuple(turns)


def _reasoning_text(item: Mapping[str, object], where: str) -> str | None:
    """A reasoning item's thinking: its ``reasoning_text`` parts, else its summary's
    text (``None`` when it has neither, e.g. only ``encrypted_content``)."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if not parts:
            continue
        if not isinstance(parts, list):
            raise InvalidRequest(f"'{where}.{key}' must be a list of parts", param=f"{where}.{key}")
        texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == part_type]
        if any(not isinstance(t, str) for t in texts) or not texts:
            raise InvalidRequest(
                f"'{where}.{key}' parts must be {{'type': '{part_type}', 'text': str}}",
                param=f"{where}.{key}",
            )
        return "\n".join(str(t) for t in texts)
    return None


def _tool_choice(choice: str | ToolChoiceObjectIn | None) -> ToolChoiceIn | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise InvalidRequest(
            f"'tool_choice' of type {quoted(choice.type)} is not supported; use 'none', 'auto', "
            """'required' or {"type": "function", "name": ...}""",
            param="tool_choice",
        )
    return named_choice(choice.name)


def _json_output(text: TextConfigIn | None) -> JsonOutput | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    return json_output(
        fmt.type, fmt.schema, param="text.format", schema_param="text.format.schema", strict=bool(fmt.strict)
    )


def _check_tool_types(tools: list[FunctionToolIn] | None) -> None:
    """Refuse, naming ``tools[i]``, any tool that is not a ``function``: the
    built-in ones (``web_search``, ``file_search``, ``local_shell``, ...) run
    on OpenAI's side, ``custom`` tools take free text under a grammar of
    theirs, and ``namespace`` groups (Codex CLI's sub-agent tools) call
    back with a ``namespace`` this server does not write."""
    for i, t in enumerate(tools or ()):
        if t.type != "function":
            raise InvalidRequest(
                f"'tools[{i}]' is a tool of type {quoted(t.type)}; this server runs function tools only "
                "(no built-in, custom or namespace tools)",
                param=f"tools[{i}]",
            )


def responses_task(req: ResponsesRequest) -> ChatTask:
    """The request as a ``ChatTask``. Raises ``InvalidRequest``."""
    _check_tool_types(req.tools)
    tools_in = [function_tool(t.name, t.description, t.parameters, t.strict) for t in req.tools or ()]
    tools = tool_config(tools_in, _tool_choice(req.tool_choice), req.parallel_tool_calls)
    sampling = req.sampling(max_tokens=req.max_output_tokens, stop=req.stop, logprobs=req.logprobs_k)
    effort = req.reasoning.effort if req.reasoning is not None else None
    sampling, template_kwargs = thinking(sampling, effort, None)
    return ChatTask(
        template_kwargs=template_kwargs,
        messages=history(req),
        sampling=sampling,
        tools=tools,
        json_output=_json_output(req.text),
        parallel_asked=req.parallel_tool_calls is not None,
        cache_salt=req.cache_salt,
    )
