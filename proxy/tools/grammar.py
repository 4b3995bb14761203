"""llguidance grammars (its Lark dialect) for a forced tool call
(``response_format``'s are ``proxy.constraints``'s).

Lark with embedded JSON schemas (``rule: %json {...}``) is llguidance's syntax
(``docs/syntax.md`` of guidance-ai/llguidance; ``docs/toolcalls.md`` has the
same shape for Qwen's ``<tool_call>`` blocks). For ``tool_choice: required``
(any callable function) or a named function, in the Hermes format::

    start: call ("\\n" call)*                 # just "start: call" without parallel calls
    call: "<tool_call>" "\\n" fn "\\n" "</tool_call>"
    fn: fn_0 | fn_1
    fn_0: %json {"type": "object",
                 "properties": {"name": {"const": "get_weather"},
                                "arguments": <get_weather's parameters>},
                 "required": ["name", "arguments"], "additionalProperties": false,
                 "x-guidance": {"lenient": true}}

Other formats differ only in the pieces around each call (``ToolCallFormat``'s
``grammar_*`` fields): Llama 3 JSON objects joined by ``"; "`` with
``parameters`` for ``arguments``, Mistral ``[TOOL_CALLS][`` + objects joined by
``", "`` + ``]``. What the grammar allows is what ``proxy.tools.parser`` reads.

Each function is its own ``%json`` root so that ``$ref``s into its ``$defs``
keep working: its top-level ``$defs``/``definitions`` move to the wrapper's
root, and any other local ``$ref`` (``#``, ``#/properties/...``) is re-pointed
under ``#/properties/arguments``. llguidance keeps properties in schema order,
so ``name`` comes before the arguments (the parser takes either order).
``lenient`` makes llguidance ignore keywords and ``format``s it does not
implement instead of failing the grammar (clients' tool schemas carry many);
leave it on unless the caller checks grammars first.

Markers that are special tokens of the model (``[TOOL_CALLS]``, ``<|python_tag|>``)
are written as text unless ``special`` maps them to a token reference such as
``"<[5]>"`` (llguidance's numeric token syntax) or ``"<|python_tag|>"``.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from proxy.tools.formats import ToolCallFormat
from proxy.tools.spec import FunctionTool, ToolConfig

_encode = msgspec.json.Encoder().encode
_ANY_OBJECT: dict[str, object] = {"type": "object"}
_DEFS_KEYS = ("$defs", "definitions")


def _literal(text: str) -> str:
    # A JSON string literal is a valid Lark literal for the escapes used here.
    return _encode(text).decode()


def _pieces(parts: tuple[str, ...], special: Mapping[str, str]) -> list[str]:
    return [special.get(p) or _literal(p) for p in parts]


def _repoint(node: object, base: str) -> object:
    """``node`` with every local ``$ref`` outside ``$defs``/``definitions``
    re-pointed under ``base``."""
    if isinstance(node, dict):
        out: dict[str, object] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                pointer = value[1:]
                kept = any(pointer.startswith(f"/{k}/") for k in _DEFS_KEYS)
                out[key] = value if kept else f"#{base}{pointer}"
            else:
                out[key] = _repoint(value, base)
        return out
    if isinstance(node, list):
        return [_repoint(v, base) for v in node]
    return node


def call_schema(
    tool: FunctionTool, arguments_key: str = "arguments", *, lenient: bool = True
) -> dict[str, object]:
    """The JSON schema of one call object of ``tool``:
    ``{"name": <const>, arguments_key: <its parameters>}``, nothing else."""
    params: dict[str, object] = dict(tool.parameters) if tool.parameters is not None else dict(_ANY_OBJECT)
    hoisted = {k: params.pop(k) for k in _DEFS_KEYS if k in params}
    params.pop("$schema", None)  # only meaningful at a root
    schema: dict[str, object] = {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            arguments_key: _repoint(params, f"/properties/{arguments_key}"),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }
    schema.update({k: _repoint(v, f"/properties/{arguments_key}") for k, v in hoisted.items()})
    if lenient:
        schema["x-guidance"] = {"lenient": True}
    return schema


def tool_call_grammar(
    fmt: ToolCallFormat,
    config: ToolConfig,
    *,
    special: Mapping[str, str] | None = None,
    lenient: bool = True,
) -> str:
    """The grammar of an answer that is only tool calls of ``config``'s callable
    functions (for ``required``: any of them; for a named function: that one),
    one or more when ``config.parallel``, else exactly one. Raises
    ``ValueError`` unless ``config.forced``."""
    if not config.forced:
        raise ValueError(f"tool_choice {config.mode!r} does not force a call; no grammar applies")
    tools = config.callable_tools()
    special = special or {}
    call = [
        *_pieces(fmt.grammar_call_prefix, special),
        "fn",
        *_pieces(fmt.grammar_call_suffix, special),
    ]
    repeat = f" ({' '.join([*_pieces(fmt.grammar_joiner, special), 'call'])})*" if config.parallel else ""
    start = [*_pieces(fmt.grammar_open, special), f"call{repeat}", *_pieces(fmt.grammar_close, special)]
    lines = [
        f"start: {' '.join(start)}",
        f"call: {' '.join(call)}",
        "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        schema = call_schema(tool, fmt.arguments_key, lenient=lenient)
        lines.append(f"fn_{i}: %json {_encode(schema).decode()}")
    return "\n".join(lines) + "\n"
