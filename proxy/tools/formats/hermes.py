"""``hermes`` (Hermes 2/3 Pro, Qwen 2.5/3 and most ChatML tool models)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, several blocks for parallel calls. Sources: the chat
templates Qwen2.5-Instruct and NousResearch Hermes-2-Pro publish (their system
prompt asks for exactly this); vLLM's ``hermes`` tool parser; llama.cpp's
Hermes 2 Pro handler (chosen when the template contains ``<tool_call>``).
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.tools.formats.base import CallBlock, ToolCallFormat, Tools, call_object
from proxy.tools.formats.objects import JsonObjectBlock
from proxy.tools.spec import FunctionCall


def _block(marker: str, tools: Tools) -> CallBlock:
    return JsonObjectBlock(tools, end_tag="</tool_call>")


def _render(calls: Sequence[FunctionCall]) -> str:
    return "\n".join(
        f"<tool_call>\n{call_object(c.name, c.arguments, 'arguments')}\n</tool_call>" for c in calls
    )


HERMES = ToolCallFormat(
    name="hermes",
    markers=("<tool_call>",),
    open_block=_block,
    matches_template=lambda source: "<tool_call>" in source,
    render_calls=_render,
    syntax_hint='<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>',
    grammar_call_prefix=("<tool_call>", "\n"),
    grammar_call_suffix=("\n", "</tool_call>"),
    grammar_joiner=("\n",),
)
