"""llguidance grammars (its Lark dialect) for a forced tool call, for tools
beside a ``response_format``, and the JSON-schema options every JSON grammar of
the proxy is built with (``proxy.grammar.check`` builds ``response_format``'s).

Lark with embedded JSON schemas (``rule: %json {...}``) is llguidance's syntax
(``docs/syntax.md`` of guidance-ai/llguidance; ``docs/toolcalls.md`` has the
same shape for Qwen's ``<tool_call>`` blocks). For ``tool_choice: required``
(any callable function) or a named function, in the Hermes format::

    start: call ("\\n" call)*                 # just "start: call" without parallel calls
    call: "<tool_call>" "\\n" fn "\\n" "</tool_call>"
    fn: fn_0 | fn_1
    // tools[0].function.parameters
    fn_0: %json {"type": "object",
                 "properties": {"name": {"const": "get_weather"},
                                "arguments": <get_weather's parameters>},
                 "required": ["name", "arguments"], "additionalProperties": false,
                 "x-guidance": {...}}

Other formats differ only in the pieces around each call (``ToolCallFormat``'s
``grammar_*`` fields): Llama 3 JSON objects joined by ``"; "`` with
``parameters`` for ``arguments``, Mistral ``[TOOL_CALLS][`` + objects joined by
``", "`` + ``]``. What the grammar allows is what ``proxy.tools.parser`` reads.
With ``tool_choice: auto`` and a JSON ``response_format``, ``tools_or_answer_grammar``
allows either those calls or one JSON answer (``start: calls | answer``).

Each ``%json`` rule follows a ``// <request field>`` comment naming where its
schema came from (``proxy.grammar.check.validate`` names that field when the
schema is refused). Each function is its own ``%json`` root so that ``$ref``s
into its ``$defs`` keep working: its top-level ``$defs``/``definitions`` move
to the wrapper's root, and any other local ``$ref`` (``#``,
``#/properties/...``) is re-pointed under ``#/properties/arguments``.
llguidance keeps properties in schema order, so ``name`` comes before the
arguments (the parser takes either order).

**Strict and loose JSON** (``json_rule_schema``). ``x-guidance`` (llguidance's
JSON compile options, ``parser/src/json/README.md``; recognised only at a
``%json`` root) replaces any the client sent:

- strict (``json_schema.strict: true``; tool arguments unless the function says
  ``strict: false``): ``strict_schema`` closes every object the schema does not
  open itself (OpenAI's strict mode is ``additionalProperties: false``
  everywhere; xgrammar's strict mode forbids undeclared properties) and bounds
  numbers; JSON is compact: at most one space between tokens, no newline
  (``whitespace_pattern``), so both ``{"a":1}`` (how history calls are
  rendered) and ``{"a": 1}`` (the spacing of the call syntax the tools prompt
  shows) are written, and indentation never.
- loose (``strict`` absent or false): JSON Schema's own meaning, whitespace
  runs of at most ``WHITESPACE_RUN`` characters (llguidance's default is any
  run, which lets a model pad until ``max_tokens``).

``lenient`` makes llguidance ignore keywords and ``format``s it does not
implement instead of failing the grammar.

Markers that are special tokens of the model (``[TOOL_CALLS]``, ``<|python_tag|>``)
are written as text unless ``special`` maps them to a token reference such as
``"<[5]>"`` (llguidance's numeric token syntax) or ``"<|python_tag|>"``.

**A named function** (``tool_choice: {"type": "function", ...}`` and its
Responses and Messages forms) is not generated whole: the server writes the
call's opening and the function's name itself (``named_call_prefix``, put
after the chat template by the worker: ``protocol.messages.Submit.forced_prefix``)
and the model generates only the arguments and the close
(``named_call_grammar``), as vLLM does for a named ``tool_choice`` (its docs,
``features/tool_calling.md``, "Named Function Calling": guided decoding to the
function's ``parameters`` schema, the name filled in by the server). The parser
reads the output as if it had read the prefix first (``ToolCallParser(primer=...)``),
so a call cut by ``max_tokens`` is still that call with its arguments as far as
written, and no token is spent on the name. In the Hermes format::

    prefix:  <tool_call>\n{"name": "get_weather", "arguments":
    start: args "}" "\n" "</tool_call>"
    // tools[0].function.parameters
    args: %json <get_weather's parameters>
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from protocol.messages import PromptPiece
from proxy.tools.formats import ToolCallFormat
from proxy.tools.spec import FunctionTool, ToolConfig

_encode = msgspec.json.Encoder().encode
_ANY_OBJECT: dict[str, object] = {"type": "object"}
_DEFS_KEYS = ("$defs", "definitions")

INTEGER_DIGITS = 16
"""Strict JSON: most digits of an integer, and of a number's integer part.
llama.cpp's JSON-schema grammars use the same bound (``[1-9][0-9]{0,15}``);
every integer a double holds exactly (up to 2**53, 16 digits) fits."""
FRACTION_DIGITS = 10
"""Strict JSON: most digits after a number's decimal point (no exponent). Ten is
the finest ``multipleOf`` llguidance takes exactly (``1e-11`` and below are
refused as having "too many digits"); a double has 15 to 17 significant digits."""
WHITESPACE_RUN = 16
"""Loose JSON: most whitespace characters in a row (a newline and indentation
seven levels deep at two spaces)."""

_INT_BOUND = 10**INTEGER_DIGITS - 1
_COMPACT: dict[str, object] = {"whitespace_pattern": "\\x20?"}
_LOOSE: dict[str, object] = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{WHITESPACE_RUN}}}"}

# Keywords whose value is one subschema / a list of them / a name -> subschema map.
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", *_DEFS_KEYS)
# An object that lists any of these already says which other properties it takes.
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _types(node: dict[str, object]) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _strict_node(node: object, composed: bool) -> object:
    if isinstance(node, list):  # ``items`` in its old tuple form
        return [_strict_node(v, False) for v in node]
    if not isinstance(node, dict):
        return node  # a boolean schema
    out: dict[str, object] = {}
    all_of = node.get("allOf")
    # Branches of an allOf of several schemas are intersected: closing each
    # would forbid the properties the others declare. They stay as written,
    # and so does the schema holding them.
    merging = isinstance(all_of, list) and len(all_of) > 1
    for key, value in node.items():
        if key in _SUBSCHEMA:
            out[key] = _strict_node(value, False)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [_strict_node(v, merging and key == "allOf") for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _strict_node(v, False) for k, v in value.items()}
        else:
            out[key] = value
    types = _types(node)
    is_object = "object" in types or (not types and "properties" in node)
    if is_object and not composed and not merging and not any(k in node for k in _OPENERS):
        out["additionalProperties"] = False
    if types & {"integer", "number"}:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -_INT_BOUND
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = _INT_BOUND
        if "number" in types and "multipleOf" not in node:
            out["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")
    return out


def strict_schema(schema: dict[str, object] | bool) -> dict[str, object] | bool:
    """``schema`` as strict structured output reads it (OpenAI's strict mode):

    - every object schema (``type`` object, or ``properties`` without a
      ``type``) that has none of ``additionalProperties``,
      ``patternProperties``, ``unevaluatedProperties`` gets
      ``additionalProperties: false``: no property the schema does not declare.
      Left open: the branches of an ``allOf`` of several schemas, and the schema
      holding that ``allOf`` (its branches are intersected, so closing one would
      forbid the others' properties);
    - ``integer``/``number`` schemas without a lower (upper) bound get
      ``minimum`` (``maximum``) of -(10**16-1) (10**16-1): at most
      ``INTEGER_DIGITS`` digits; ``number`` schemas without ``multipleOf`` get
      ``multipleOf: 1e-10``: at most ``FRACTION_DIGITS`` decimals. llguidance
      writes bounded numbers without an exponent.

    Subschemas are found under the keywords that hold them (``properties``,
    ``items``, ``prefixItems``, ``anyOf``/``oneOf``/``allOf``, ``$defs``,
    ``definitions``, ``additionalProperties``, ``not``, ``if``/``then``/``else``,
    ...). A new schema is returned; the input is not changed."""
    out = _strict_node(schema, False)
    assert isinstance(out, dict | bool)
    return out


def json_rule_schema(
    schema: dict[str, object] | bool, *, strict: bool, lenient: bool = False
) -> dict[str, object] | bool:
    """The schema to compile for one ``%json`` root (or ``grammar_from_json_schema``):
    ``strict_schema`` of it when ``strict``, with llguidance's ``x-guidance``
    options for strict or loose JSON (see the module's docstring) replacing the
    client's own. ``false`` (nothing is valid) stays ``false``; ``true`` becomes
    ``{}``."""
    if schema is False:
        return False
    if schema is True:
        schema = {}
    checked = strict_schema(schema) if strict else schema
    body: dict[str, object] = dict(checked) if isinstance(checked, dict) else {}
    options = dict(_COMPACT if strict else _LOOSE)
    if lenient:
        options["lenient"] = True
    body["x-guidance"] = options
    return body


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


def tool_strict(tool: FunctionTool) -> bool:
    """Whether ``tool``'s arguments are strict JSON: unless its ``strict`` is false."""
    return tool.strict is not False


def call_schema(
    tool: FunctionTool, arguments_key: str = "arguments", *, lenient: bool = True
) -> dict[str, object]:
    """The JSON schema of one call object of ``tool``:
    ``{"name": <const>, arguments_key: <its parameters>}``, nothing else; the
    parameters strict unless ``tool.strict`` is false (``tool_strict``), with the
    ``x-guidance`` options of ``json_rule_schema``."""
    params: dict[str, object] = dict(tool.parameters) if tool.parameters is not None else dict(_ANY_OBJECT)
    hoisted = {k: params.pop(k) for k in _DEFS_KEYS if k in params}
    params.pop("$schema", None)  # only meaningful at a root
    params.pop("x-guidance", None)  # only read at a root; the wrapper's own replace it
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
    out = json_rule_schema(schema, strict=tool_strict(tool), lenient=lenient)
    assert isinstance(out, dict)
    return out


def _json_rule(name: str, schema: dict[str, object] | bool, param: str) -> list[str]:
    return [f"// {param}", f"{name}: %json {_encode(schema).decode()}"]


def _call_rules(
    fmt: ToolCallFormat, config: ToolConfig, special: Mapping[str, str], lenient: bool
) -> tuple[str, list[str]]:
    """``calls`` (the start rule's body for one or more calls) and the rules it uses."""
    tools = config.callable_tools()
    if fmt.grammar_rules is not None:
        fields = [(t, f"tools[{config.tools.index(t)}].function.parameters") for t in tools]
        return fmt.grammar_rules(fields, config.parallel, special)
    call = [
        *_pieces(fmt.grammar_call_prefix, special),
        "fn",
        *_pieces(fmt.grammar_call_suffix, special),
    ]
    repeat = f" ({' '.join([*_pieces(fmt.grammar_joiner, special), 'call'])})*" if config.parallel else ""
    calls = " ".join(
        [*_pieces(fmt.grammar_open, special), f"call{repeat}", *_pieces(fmt.grammar_close, special)]
    )
    lines = [
        f"call: {' '.join(call)}",
        "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
    ]
    for i, tool in enumerate(tools):
        schema = call_schema(tool, fmt.arguments_key, lenient=lenient)
        lines += _json_rule(f"fn_{i}", schema, f"tools[{config.tools.index(tool)}].function.parameters")
    return calls, lines


def tool_call_grammar(
    fmt: ToolCallFormat,
    config: ToolConfig,
    *,
    special: Mapping[str, str] | None = None,
    lenient: bool = True,
) -> str:
    """The grammar of an answer that is only tool calls of ``config``'s callable
    functions (for ``required``: any of them; for a named function: that one),
    one or more when ``config.parallel``, else exactly one. Not validated
    (``proxy.grammar.check.validate``). Raises ``ValueError`` unless
    ``config.forced``."""
    if not config.forced:
        raise ValueError(f"tool_choice {config.mode!r} does not force a call; no grammar applies")
    calls, lines = _call_rules(fmt, config, special or {}, lenient)
    return "\n".join([f"start: {calls}", *lines]) + "\n"


def tools_or_answer_grammar(
    fmt: ToolCallFormat,
    config: ToolConfig,
    answer: dict[str, object] | bool,
    answer_param: str,
    *,
    special: Mapping[str, str] | None = None,
    lenient: bool = True,
) -> str:
    """The grammar of an answer that is either tool calls of ``config`` (as
    ``tool_call_grammar``'s) or one JSON value of ``answer``, the schema to
    compile as it is (``json_rule_schema``'s output; ``answer_param`` names its
    request field). For ``tool_choice: auto`` beside a JSON ``response_format``
    (the OpenAI Agents SDK's agent with tools and an ``output_type``): the
    parser reads the calls as calls and the JSON as content. Raises
    ``ValueError`` unless ``config.active``."""
    if not config.active:
        raise ValueError("tool_choice 'none' allows no call; no grammar of calls applies")
    calls, lines = _call_rules(fmt, config, special or {}, lenient)
    answer_rule = _json_rule("answer", answer, answer_param)
    return "\n".join([f"start: ({calls}) | answer", *lines, *answer_rule]) + "\n"


def _named_tool(config: ToolConfig) -> FunctionTool:
    if config.mode != "function":
        raise ValueError(f"tool_choice {config.mode!r} names no function")
    (tool,) = config.callable_tools()
    return tool


def named_call_prefix(fmt: ToolCallFormat, config: ToolConfig) -> tuple[PromptPiece, ...]:
    """What the server writes of a named function's call before the model
    writes its arguments: ``fmt``'s opening pieces (``grammar_open``,
    ``grammar_call_prefix``; a piece that is one of ``fmt.markers`` marked
    ``control``), then the call object up to its arguments, spaced as
    ``render_calls`` writes history calls: ``{"name": "get_weather", "arguments": ``.
    The name is a validated function name (``spec.NAME_PATTERN``: letters,
    digits, ``_``, ``-``), never a control token. Raises ``ValueError`` unless
    ``config`` names a function."""
    tool = _named_tool(config)
    pieces = [PromptPiece(p, p in fmt.markers) for p in (*fmt.grammar_open, *fmt.grammar_call_prefix)]
    head = '{"name": ' + _literal(tool.name) + ", " + _literal(fmt.arguments_key) + ": "
    pieces.append(PromptPiece(head))
    return tuple(pieces)


def named_call_grammar(
    fmt: ToolCallFormat,
    config: ToolConfig,
    *,
    special: Mapping[str, str] | None = None,
    lenient: bool = True,
) -> str:
    """The grammar of what follows ``named_call_prefix``: the named function's
    arguments (its ``parameters`` schema, strict unless the tool says
    ``strict: false``, with ``json_rule_schema``'s options), the call object's
    ``}``, then ``fmt``'s closing pieces (``grammar_call_suffix``,
    ``grammar_close``): one call, never parallel. Not validated
    (``proxy.grammar.check.validate``). Raises ``ValueError`` unless
    ``config`` names a function."""
    tool = _named_tool(config)
    special = special or {}
    params: dict[str, object] = dict(tool.parameters) if tool.parameters is not None else dict(_ANY_OBJECT)
    schema = json_rule_schema(params, strict=tool_strict(tool), lenient=lenient)
    rest = ['"}"', *_pieces(fmt.grammar_call_suffix, special), *_pieces(fmt.grammar_close, special)]
    param = f"tools[{config.tools.index(tool)}].function.parameters"
    return "\n".join([f"start: args {' '.join(rest)}", *_json_rule("args", schema, param)]) + "\n"
