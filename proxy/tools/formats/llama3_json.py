"""``llama3_json`` (Llama 3.1/3.2/3.3 JSON tool calling)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
    {"name": "a", "parameters": {...}}; {"name": "b", "parameters": {...}}

an optional ``<|python_tag|>``, then a JSON object whose arguments key is
``parameters`` (``arguments`` is accepted too); several calls separated by
``;``. Without the tag, only an output that *starts* with ``{`` (or continues
with one right after a call) is taken for a call, and only when its first key
is ``name`` or ``type``; JSON later in a text answer stays text. Sources:
Meta's Llama 3.1 model card / ``llama-models`` prompt format and its HF chat
template (``"parameters"``, the ``ipython`` role); vLLM's ``llama3_json``
parser (``;``-separated objects, either key); llama.cpp's Llama 3.x handler.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.tools.formats.base import CallBlock, ToolCallFormat, Tools, call_object
from proxy.tools.formats.objects import JsonObjectBlock
from proxy.tools.spec import FunctionCall

_FIRST_KEYS = frozenset({"name", "type"})


def _block(marker: str, tools: Tools) -> CallBlock:
    # With the tag the model declared a call; a bare "{" might be a JSON answer.
    return JsonObjectBlock(tools, first_keys=None if marker else _FIRST_KEYS)


def _render(calls: Sequence[FunctionCall]) -> str:
    return "; ".join(call_object(c.name, c.arguments, "parameters") for c in calls)


def _template(source: str) -> bool:
    return "<|python_tag|>" in source or ("ipython" in source and '"parameters"' in source)


LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    markers=("<|python_tag|>",),
    open_block=_block,
    matches_template=_template,
    render_calls=_render,
    syntax_hint='{"name": <function-name>, "parameters": <arguments-json-object>}',
    arguments_key="parameters",
    bare_json=True,
    separators=";",
    grammar_joiner=("; ",),
)
