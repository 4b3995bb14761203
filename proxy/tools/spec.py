"""Request-side types of OpenAI tool calling and their validation.

Shapes (OpenAI API reference, ``POST /v1/chat/completions``)::

    "tools": [{"type": "function",
               "function": {"name": str,                 # ^[a-zA-Z0-9_-]{1,64}$
                            "description": str,          # optional
                            "parameters": {JSON schema},  # optional, an object
                            "strict": bool}}]            # optional
    "tool_choice": "none" | "auto" | "required"
                 | {"type": "function", "function": {"name": str}}
    "parallel_tool_calls": bool                           # default true

    history, assistant turn that called tools:
      {"role": "assistant", "content": str | null,
       "tool_calls": [{"id": str, "type": "function",
                       "function": {"name": str, "arguments": str}}]}   # arguments: JSON text
    history, a tool's result:
      {"role": "tool", "tool_call_id": str, "content": str}

The ``*In`` structs are the tolerant edge layer (they decode what clients send,
``type`` as any string), ``resolve_tools`` checks them once and returns the
strict ``ToolConfig``. Every refusal is a ``ToolSpecError`` carrying the
OpenAI ``param`` to report (``tools``, ``tool_choice``, ``messages[i]...``).
``ToolCall``/``FunctionCall`` are both the history shape and the response shape
(``choices[i].message.tool_calls``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import msgspec

from protocol.messages import ImageInput
from proxy.errors import quoted

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's rule for function names (``fullmatch``)."""


class ToolSpecError(ValueError):
    """A tool-related request field is invalid. ``param`` is the OpenAI error
    envelope's ``param`` (``tools``, ``tool_choice``, ``messages[2].tool_call_id``);
    the request layer reports it as a 400 ``invalid_request_error``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# ---------------------------------------------------------------- edge structs (tolerant)


class FunctionIn(msgspec.Struct, kw_only=True):
    """``tools[i].function`` as sent; ``name`` is checked by ``resolve_tools``."""

    name: str | None = None
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct, kw_only=True):
    """``tools[i]`` as sent. ``type`` is any string so that an unsupported kind
    (``custom``, ``web_search``, ...) is refused by ``resolve_tools`` with a clear
    message rather than by a decoder error."""

    type: str
    function: FunctionIn | None = None


class FunctionName(msgspec.Struct, kw_only=True):
    """``tool_choice.function``: ``{"name": str}``."""

    name: str | None = None


class NamedToolChoiceIn(msgspec.Struct, kw_only=True):
    """``tool_choice`` as an object: ``{"type": "function", "function": {"name"}}``."""

    type: str
    function: FunctionName | None = None


ToolChoiceIn = str | NamedToolChoiceIn
"""``tool_choice`` as sent: a string or ``NamedToolChoiceIn``."""


# ---------------------------------------------------------------- resolved (strict)


class FunctionTool(msgspec.Struct, frozen=True, kw_only=True):
    """One callable function, validated. ``parameters`` is the JSON schema of its
    arguments object (``None``: the client gave none: an object). ``strict``
    as the client sent it (``None``: absent); the arguments' grammar is strict
    unless it is false (``proxy.tools.grammar.tool_strict``)."""

    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


ToolMode = Literal["none", "auto", "required", "function"]
"""``function``: ``tool_choice`` named one function (``ToolConfig.function``)."""


class ToolConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The tool side of one request: its functions, what ``tool_choice`` asks
    for and whether several calls in one answer are allowed."""

    tools: tuple[FunctionTool, ...]
    mode: ToolMode = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tool calls can happen (``tool_choice`` is not ``none``)."""
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        """The answer must be a tool call (``required`` or a named function)."""
        return self.mode in ("required", "function")

    def callable_tools(self) -> tuple[FunctionTool, ...]:
        """The functions the model may call now: none for ``none``, the named one
        for a named ``tool_choice``, else all."""
        if self.mode == "none":
            return ()
        if self.mode == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools

    def callable_names(self) -> frozenset[str]:
        """Names of ``callable_tools()``."""
        return frozenset(t.name for t in self.callable_tools())

    def callable_by_name(self) -> dict[str, FunctionTool]:
        """``callable_tools()`` by name."""
        return {t.name: t for t in self.callable_tools()}


def _function_tool(i: int, tool: ToolIn) -> FunctionTool:
    where = f"tools[{i}]"
    if tool.type != "function":
        raise ToolSpecError(
            f"'{where}.type' is {quoted(tool.type)}; only 'function' tools are supported", param="tools"
        )
    fn = tool.function
    if fn is None:
        raise ToolSpecError(f"'{where}.function' is required for a 'function' tool", param="tools")
    if fn.name is None:
        raise ToolSpecError(f"'{where}.function.name' is required", param="tools")
    if not NAME_PATTERN.fullmatch(fn.name):
        raise ToolSpecError(
            f"'{where}.function.name' is {quoted(fn.name)}; a function name must be 1 to 64 characters "
            "among a-z, A-Z, 0-9, '_' and '-'",
            param="tools",
        )
    return FunctionTool(name=fn.name, description=fn.description, parameters=fn.parameters, strict=fn.strict)


_STRING_CHOICES: dict[str, ToolMode] = {"none": "none", "auto": "auto", "required": "required"}


def _choice(choice: ToolChoiceIn | None, names: Sequence[str]) -> tuple[ToolMode, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        mode = _STRING_CHOICES.get(choice)
        if mode is not None:
            return mode, None
        raise ToolSpecError(
            f"'tool_choice' is {quoted(choice)}; expected 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if choice.type != "function":
        raise ToolSpecError(
            f"'tool_choice.type' is {quoted(choice.type)}; only 'function' is supported", param="tool_choice"
        )
    name = choice.function.name if choice.function is not None else None
    if name is None:
        raise ToolSpecError("'tool_choice.function.name' is required", param="tool_choice")
    if name not in names:
        known = ", ".join(repr(n) for n in names)
        raise ToolSpecError(
            f"'tool_choice' names the function {quoted(name)}, which is not among 'tools' ({known})",
            param="tool_choice",
        )
    return "function", name


def resolve_tools(
    tools: Sequence[ToolIn] | None,
    tool_choice: ToolChoiceIn | None,
    parallel_tool_calls: bool | None,
) -> ToolConfig | None:
    """The request's ``ToolConfig``, or ``None`` when it has no tools (absent or
    ``[]``) and ``tool_choice`` is absent or ``"none"``. ``tool_choice`` defaults
    to ``auto`` and ``parallel_tool_calls`` to true, as OpenAI's.

    Raises ``ToolSpecError`` (param ``tools``) for a tool whose type is not
    ``function``, a missing or malformed function name, or two functions of one
    name; (param ``tool_choice``) for an unknown choice, a named function not
    among the tools, or a choice other than ``none`` without tools.
    """
    if not tools:
        if tool_choice is None or tool_choice == "none":
            return None
        raise ToolSpecError("'tool_choice' requires 'tools'", param="tool_choice")
    functions = tuple(_function_tool(i, t) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    seen: set[str] = set()
    for n in names:
        if n in seen:
            # Two schemas for one name: a call could not be checked against either.
            raise ToolSpecError(f"'tools' defines the function {quoted(n)} more than once", param="tools")
        seen.add(n)
    mode, function = _choice(tool_choice, names)
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolConfig(tools=functions, mode=mode, function=function, parallel=parallel)


# ---------------------------------------------------------------- calls and history


class FunctionCall(msgspec.Struct, frozen=True, gc=False):
    """``{"name": str, "arguments": str}``; ``arguments`` is JSON text (an object)."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """``{"id": str, "type": "function", "function": FunctionCall}``: a call in an
    assistant turn of the history, and in a non-stream response's
    ``message.tool_calls``. ``type`` defaults to ``function`` for clients that
    leave it out."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class HistoryMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of the conversation with its tool fields, ``content`` already
    flattened to text (``None``: an assistant turn that only called tools).
    ``role`` is the client's (``system``, ``developer``, ``user``, ``assistant``,
    ``tool``, ``function``)."""

    role: str
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    """An assistant turn's thinking, as the client sent it back (the template decides)."""
    images: tuple[ImageInput, ...] = ()
    """The turn's images, each at its ``offset`` in ``content`` (``protocol.ImageInput``)."""


def check_history(messages: Sequence[HistoryMessage]) -> None:
    """Refuse tool fields where OpenAI does: ``tool_calls`` on a turn that is
    not the assistant's (param ``messages[i].tool_calls``), a ``tool`` turn without
    ``tool_call_id`` (param ``messages[i].tool_call_id``). ``arguments`` is not
    required to be valid JSON (OpenAI passes it through as text)."""
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise ToolSpecError(
                f"'messages[{i}].tool_calls' is only allowed on an assistant message, not {quoted(m.role)}",
                param=f"messages[{i}].tool_calls",
            )
        if m.role == "tool" and not m.tool_call_id:
            raise ToolSpecError(
                f"'messages[{i}]' has role 'tool' and needs 'tool_call_id'",
                param=f"messages[{i}].tool_call_id",
            )
