"""Tools for a model whose chat template knows none (the embedded SmolLM2's
ChatML template): the tools and the tool turns of the history become plain
``(role, content)`` messages any template renders.

``render_fallback(config, messages, fmt)`` is a pure function:

- With tools callable (``tool_choice`` other than ``none``), a tools section is
  appended to the first system message (one is inserted first if the
  conversation has none)::

      # Tools

      You can call functions to help with the user's request. Their
      definitions, one JSON object per line:
      <tools>
      {"type":"function","function":{"name":...,"description":...,"parameters":{...}}}
      </tools>

      To call a function, write:
      <tool_call>
      {"name": <function-name>, "arguments": <arguments-json-object>}
      </tool_call>
      <one line for tool_choice: auto / required / the named function>
      <one line for parallel_tool_calls>
      Each result comes back in a user message inside <tool_response></tool_response>.

  (The call syntax line is the format's ``syntax_hint``; Hermes by default.)
  The wording is this project's; the layout (definitions inside ``<tools>``,
  one JSON per line, calls in ``<tool_call>`` blocks, results in
  ``<tool_response>``) is the one Qwen2.5's and Hermes 2 Pro's published chat
  templates use, so models tuned on either recognise it.
- An assistant turn with ``tool_calls`` becomes its text (if any), a newline,
  then the calls as the model would write them (``fmt.render_calls``).
- ``tool`` (and legacy ``function``) turns become one ``user`` message per run
  of consecutive results, each ``<tool_response>\\n{content}\\n</tool_response>``
  (Qwen2.5's template does the same).
- ``developer`` becomes ``system``; other roles pass through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from protocol.messages import ImageInput
from proxy.tools.formats import HERMES, ToolCallFormat
from proxy.tools.spec import FunctionTool, HistoryMessage, ToolConfig

_encode = msgspec.json.Encoder().encode


def _tool_line(tool: FunctionTool) -> str:
    function: dict[str, object] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    return _encode({"type": "function", "function": function}).decode()


def _choice_line(config: ToolConfig) -> str:
    if config.mode == "function":
        return f"You must call the function {config.function} in your reply."
    if config.mode == "required":
        return "You must call at least one function in your reply."
    return "Call a function only when it helps; otherwise answer directly."


def tools_prompt(config: ToolConfig, fmt: ToolCallFormat = HERMES) -> str:
    """The tools section of the system prompt for the functions the model may
    call now (``config.callable_tools()``); ``""`` when there are none."""
    tools = config.callable_tools()
    if not tools:
        return ""
    parallel = (
        "You may call several functions in one reply."
        if config.parallel
        else "Call at most one function per reply."
    )
    return "\n".join(
        [
            "# Tools",
            "",
            "You can call functions to help with the user's request. "
            "Their definitions, one JSON object per line:",
            "<tools>",
            *(_tool_line(t) for t in tools),
            "</tools>",
            "",
            "To call a function, write:",
            fmt.syntax_hint,
            _choice_line(config),
            parallel,
            "Each result comes back in a user message inside <tool_response></tool_response>.",
        ]
    )


_RESPONSE_OPEN = "<tool_response>\n"


def _tool_response(content: str | None) -> str:
    return f"{_RESPONSE_OPEN}{content or ''}\n</tool_response>"


def _results_turn(results: list[HistoryMessage]) -> Turn:
    """Tool results as one user turn, each result's images moved with its text."""
    texts: list[str] = []
    images: list[ImageInput] = []
    at = 0
    for m in results:
        shift = at + len(_RESPONSE_OPEN)
        images += (msgspec.structs.replace(im, offset=im.offset + shift) for im in m.images)
        texts.append(_tool_response(m.content))
        at += len(texts[-1]) + 1  # the newline the results are joined with
    return Turn("user", "\n".join(texts), tuple(images))


class Turn(NamedTuple):
    """One rendered turn: ``role``, ``content`` and the turn's ``images``, each still
    at its offset (text is only ever added after a turn's own content)."""

    role: str
    content: str
    images: tuple[ImageInput, ...] = ()


def render_fallback(
    config: ToolConfig | None, messages: Sequence[HistoryMessage], fmt: ToolCallFormat = HERMES
) -> list[Turn]:
    """Turns for a template without tool support: the tools section in the
    system prompt, tool calls and results as text (see the module docstring).
    ``config`` ``None`` (no tools) still renders tool turns of the history."""
    out: list[Turn] = []
    results: list[HistoryMessage] = []
    for m in messages:
        if m.role in ("tool", "function"):
            results.append(m)
            continue
        if results:
            out.append(_results_turn(results))
            results = []
        content = m.content or ""
        if m.role == "assistant" and m.tool_calls:
            calls = fmt.render_calls([c.function for c in m.tool_calls])
            content = f"{content}\n{calls}" if content else calls
        out.append(Turn("system" if m.role == "developer" else m.role, content, m.images))
    if results:
        out.append(_results_turn(results))
    section = tools_prompt(config, fmt) if config is not None else ""
    if section:
        if out and out[0].role == "system":
            first = out[0]
            out[0] = first._replace(content=f"{first.content}\n\n{section}" if first.content else section)
        else:
            out.insert(0, Turn("system", section))
    return out
