"""OpenAI tool calling: request types, call formats, the output parser, the
fallback prompt for templates without tools, and grammars for forced calls.

| module | what |
|---|---|
| ``spec`` | request and history types, ``resolve_tools``, ``check_history``, ``ToolSpecError`` |
| ``formats/`` | one module per call format over ``formats.base``; registry, detection |
| ``parser`` | ``ToolCallParser`` (arguments streamed), ``parse_output``, ``finish_reason`` |
| ``render`` | ``render_fallback``: tools and tool turns as plain messages |
| ``grammar`` | grammars for forced calls and for tools beside ``response_format``; JSON options |
| ``jsontext`` | JSON spans, compaction, call objects, ``JsonPrefix`` (a value as written) |

Pure logic: no I/O, no aiohttp; the standard library, msgspec, ``protocol`` and ``proxy.errors``.
"""

from proxy.tools.formats import (
    FORMATS,
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    TOOL_CALL_FORMAT_CHOICES,
    FormatChoice,
    ToolCallFormat,
    choose_format,
    detect_format,
    get_format,
)
from proxy.tools.grammar import tool_call_grammar, tools_or_answer_grammar
from proxy.tools.parser import (
    ContentDelta,
    FunctionDelta,
    ParsedOutput,
    ParseEnd,
    StreamEvent,
    ToolCallDelta,
    ToolCallParser,
    finish_reason,
    parse_output,
)
from proxy.tools.render import render_fallback, tools_prompt
from proxy.tools.spec import (
    FunctionCall,
    FunctionIn,
    FunctionTool,
    HistoryMessage,
    NamedToolChoiceIn,
    ToolCall,
    ToolChoiceIn,
    ToolConfig,
    ToolIn,
    ToolSpecError,
    check_history,
    resolve_tools,
)

__all__ = [
    "FORMATS",
    "HARMONY",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "TOOL_CALL_FORMAT_CHOICES",
    "ContentDelta",
    "FormatChoice",
    "FunctionCall",
    "FunctionDelta",
    "FunctionIn",
    "FunctionTool",
    "HistoryMessage",
    "NamedToolChoiceIn",
    "ParseEnd",
    "ParsedOutput",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallParser",
    "ToolChoiceIn",
    "ToolConfig",
    "ToolIn",
    "ToolSpecError",
    "check_history",
    "choose_format",
    "detect_format",
    "finish_reason",
    "get_format",
    "parse_output",
    "render_fallback",
    "resolve_tools",
    "tool_call_grammar",
    "tools_or_answer_grammar",
    "tools_prompt",
]
