"""Grammars for forced tool calls and ``response_format`` (``proxy.grammar.check``): their text, and (with
llguidance installed) that llguidance compiles them and accepts exactly what
the parser reads."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest

from proxy.grammar.check import ANY_JSON_OBJECT, json_schema_grammar
from proxy.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat
from proxy.tools.grammar import (
    INTEGER_DIGITS,
    WHITESPACE_RUN,
    call_schema,
    json_rule_schema,
    named_call_grammar,
    named_call_prefix,
    strict_schema,
    tool_call_grammar,
    tools_or_answer_grammar,
)
from proxy.tools.parser import ParsedOutput, parse_output
from proxy.tools.spec import FunctionCall, FunctionTool, ToolConfig
from tests.unit.proxy.tools.conftest import WEATHER_PARAMS, config

NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def test_named_hermes_grammar_text() -> None:
    grammar = tool_call_grammar(HERMES, config(NAMED_TIME, parallel=False))
    wrapper = {
        "type": "object",
        # get_time declares no parameters: strict by default, so no argument at all.
        "properties": {
            "name": {"const": "get_time"},
            "arguments": {"type": "object", "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"whitespace_pattern": "\\x20?", "lenient": True},
    }
    assert grammar == (
        "start: call\n"
        'call: "<tool_call>" "\\n" fn "\\n" "</tool_call>"\n'
        "fn: fn_0\n"
        "// tools[1].function.parameters\n"  # get_time is TOOLS_JSON[1]
        f"fn_0: %json {json.dumps(wrapper, separators=(',', ':'))}\n"
    )


def test_required_parallel_shapes() -> None:
    cfg = config("required")
    assert tool_call_grammar(HERMES, cfg).splitlines()[:3] == [
        'start: call ("\\n" call)*',
        'call: "<tool_call>" "\\n" fn "\\n" "</tool_call>"',
        "fn: fn_0 | fn_1",
    ]
    assert tool_call_grammar(LLAMA3_JSON, cfg).splitlines()[:2] == ['start: call ("; " call)*', "call: fn"]
    assert tool_call_grammar(MISTRAL, cfg).splitlines()[:2] == [
        'start: "[TOOL_CALLS]" "[" call (", " call)* "]"',
        "call: fn",
    ]
    special = tool_call_grammar(MISTRAL, cfg, special={"[TOOL_CALLS]": "<[5]>"})
    assert special.splitlines()[0] == 'start: <[5]> "[" call (", " call)* "]"'


def test_arguments_key_follows_the_format() -> None:
    tool = FunctionTool(name="get_weather", parameters=WEATHER_PARAMS, strict=False)
    schema = call_schema(tool, "parameters")
    assert schema["properties"] == {"name": {"const": "get_weather"}, "parameters": WEATHER_PARAMS}
    assert schema["required"] == ["name", "parameters"]


def test_refs_and_defs_survive_embedding() -> None:
    params: dict[str, Any] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "where": {"$ref": "#/$defs/Place"},
            "old": {"$ref": "#/definitions/Old"},
            "again": {"$ref": "#"},
            "same": {"$ref": "#/properties/where"},
        },
        "$defs": {"Place": {"type": "object", "properties": {"parent": {"$ref": "#"}}}},
        "definitions": {"Old": {"type": "string"}},
    }
    schema = call_schema(FunctionTool(name="f", parameters=params, strict=False), lenient=False)
    assert schema == {
        "type": "object",
        "properties": {
            "name": {"const": "f"},
            "arguments": {
                "type": "object",
                "properties": {
                    "where": {"$ref": "#/$defs/Place"},
                    "old": {"$ref": "#/definitions/Old"},
                    "again": {"$ref": "#/properties/arguments"},
                    "same": {"$ref": "#/properties/arguments/properties/where"},
                },
            },
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "$defs": {"Place": {"type": "object", "properties": {"parent": {"$ref": "#/properties/arguments"}}}},
        "definitions": {"Old": {"type": "string"}},
        "x-guidance": {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{WHITESPACE_RUN}}}"},
    }
    assert "$defs" in params and params["properties"]["again"] == {"$ref": "#"}  # input untouched


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_no_grammar_unless_forced(choice: str) -> None:
    with pytest.raises(ValueError, match="does not force a call"):
        tool_call_grammar(HERMES, config(choice))


# ---------------------------------------------------------------- with llguidance


class _ByteTokenizer:
    """One token per byte plus an EOS: every text has exactly one tokenization."""

    eos_token_id = 256
    bos_token_id = None
    tokens: ClassVar[list[bytes]] = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids: ClassVar[list[int]] = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@pytest.fixture(scope="module")
def accepts() -> Any:
    lg = pytest.importorskip("llguidance")
    tokenizer = lg.LLTokenizer(lg.TokenizerWrapper(_ByteTokenizer()))

    def check(grammar: str, text: str) -> bool:
        assert lg.LLMatcher.validate_grammar(grammar) == ""
        matcher = lg.LLMatcher(tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
        return bool(ok) and not matcher.is_error() and matcher.is_accepting()

    return check


WEATHER = FunctionCall("get_weather", '{"city": "Paris", "unit": "c"}')
TIME = FunctionCall("get_time", "{}")


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_grammar_accepts_what_the_parser_reads(fmt: ToolCallFormat, accepts: Any) -> None:
    cfg = config("required")
    for calls in ([WEATHER], [TIME, WEATHER]):
        text = fmt.render_calls(calls)
        assert accepts(tool_call_grammar(fmt, cfg), text), text
        parsed = parse_output(fmt, cfg, text)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
            (c.name, json.loads(c.arguments)) for c in calls
        ]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_grammar_refuses(fmt: ToolCallFormat, accepts: Any) -> None:
    required = tool_call_grammar(fmt, config("required"))
    assert not accepts(required, fmt.render_calls([FunctionCall("get_stock", "{}")]))
    assert not accepts(
        required, fmt.render_calls([FunctionCall("get_weather", '{"unit": "c"}')])
    )  # city missing
    assert not accepts(required, "Sure, " + fmt.render_calls([TIME]))  # no text around the calls
    single = tool_call_grammar(fmt, config("required", parallel=False))
    assert accepts(single, fmt.render_calls([TIME]))
    assert not accepts(single, fmt.render_calls([TIME, TIME]))
    named = tool_call_grammar(fmt, config(NAMED_TIME))
    assert accepts(named, fmt.render_calls([TIME]))
    assert not accepts(named, fmt.render_calls([WEATHER]))


def test_lenient_ignores_unknown_formats(accepts: Any) -> None:
    lg = pytest.importorskip("llguidance")
    tools: dict[str, object] = {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "fancy-date"}},
    }
    cfg = config("required")
    cfg = type(cfg)(tools=(FunctionTool(name="f", parameters=tools),), mode="required")
    assert accepts(
        tool_call_grammar(HERMES, cfg), '<tool_call>\n{"name": "f", "arguments": {"when": "x"}}\n</tool_call>'
    )
    assert "fancy-date" in lg.LLMatcher.validate_grammar(tool_call_grammar(HERMES, cfg, lenient=False))


def test_response_format_grammars(accepts: Any) -> None:
    any_object = json_schema_grammar(ANY_JSON_OBJECT)
    assert accepts(any_object, '{"a": [1, 2]}')
    assert not accepts(any_object, "[1, 2]")
    schema: dict[str, object] = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
    }
    assert accepts(json_schema_grammar(schema), '{"a": 3}')
    assert not accepts(json_schema_grammar(schema), '{"a": "3"}')


# ---------------------------------------------------------------- strict and loose JSON


def test_strict_schema_closes_objects_it_does_not_open() -> None:
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "where": place,
            "tags": {"type": "array", "items": {"properties": {"k": {"type": "string"}}}},
            "extra": {"type": "object", "additionalProperties": {"type": "object"}},
            "pattern": {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
            "either": {"anyOf": [place, {"type": "null"}]},
            "both": {"allOf": [place, {"type": "object", "properties": {"zip": {"type": "string"}}}]},
            "one": {"allOf": [place]},
        },
        "$defs": {"P": place},
    }
    closed = {**place, "additionalProperties": False}
    assert strict_schema(schema) == {
        "type": "object",
        "properties": {
            "where": closed,
            "tags": {
                "type": "array",
                "items": {"properties": {"k": {"type": "string"}}, "additionalProperties": False},
            },
            # Opened by the client: kept open, what it allows closed in turn.
            "extra": {
                "type": "object",
                "additionalProperties": {"type": "object", "additionalProperties": False},
            },
            "pattern": {"type": "object", "patternProperties": {"^x": {"type": "string"}}},
            "either": {"anyOf": [closed, {"type": "null"}]},
            # Branches of a several-schema allOf are intersected: left open.
            "both": {"allOf": [place, {"type": "object", "properties": {"zip": {"type": "string"}}}]},
            "one": {"allOf": [closed]},
        },
        "$defs": {"P": closed},
        "additionalProperties": False,
    }
    assert "additionalProperties" not in schema["properties"]["where"]  # the input is untouched
    assert strict_schema(True) is True


def test_strict_schema_bounds_numbers() -> None:
    bound = 10**INTEGER_DIGITS - 1
    assert strict_schema({"type": "integer"}) == {"type": "integer", "minimum": -bound, "maximum": bound}
    assert strict_schema({"type": ["number", "null"]}) == {
        "type": ["number", "null"],
        "minimum": -bound,
        "maximum": bound,
        "multipleOf": 1e-10,
    }
    # The client's own bounds and step stay; only the missing side is added.
    assert strict_schema({"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5}) == {
        "type": "number",
        "exclusiveMinimum": 0,
        "multipleOf": 0.5,
        "maximum": bound,
    }
    assert strict_schema({"type": "string"}) == {"type": "string"}


def test_json_rule_schema_options() -> None:
    loose = json_rule_schema({"type": "object", "x-guidance": {"whitespace_flexible": True}}, strict=False)
    assert loose == {"type": "object", "x-guidance": {"whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{0,16}"}}
    strict = json_rule_schema({"type": "object"}, strict=True, lenient=True)
    assert strict == {
        "type": "object",
        "additionalProperties": False,
        "x-guidance": {"whitespace_pattern": "\\x20?", "lenient": True},
    }
    assert json_rule_schema(True, strict=True) == {"x-guidance": {"whitespace_pattern": "\\x20?"}}
    assert json_rule_schema(False, strict=True) is False


PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "population": {"type": "integer"}, "area": {"type": "number"}},
    "required": ["name"],
}


def test_strict_json_grammar(accepts: Any) -> None:
    strict = json_schema_grammar(PERSON, strict=True)
    assert accepts(strict, '{"name":"Paris","population":2102650}')
    assert accepts(strict, '{"name": "Paris", "area": 105.4}')
    assert not accepts(strict, '{"name": "Paris", "type": "string"}')  # undeclared
    assert not accepts(strict, '{\n    "name": "Paris"}')  # indentation
    assert not accepts(strict, '{"name":  "Paris"}')  # two spaces
    assert accepts(strict, '{"name": "P", "population": ' + "9" * 16 + "}")
    assert not accepts(strict, '{"name": "P", "population": ' + "1" * 17 + "}")
    assert accepts(strict, '{"name": "P", "area": 1.' + "5" * 10 + "}")
    assert not accepts(strict, '{"name": "P", "area": 1.' + "5" * 11 + "}")
    assert not accepts(strict, '{"name": "P", "area": 1e5}')
    # Without strict: JSON Schema's meaning, whitespace runs bounded.
    loose = json_schema_grammar(PERSON)
    assert accepts(loose, '{"name": "Paris", "type": "string"}')
    assert accepts(loose, '{"name": "P", "population": ' + "1" * 40 + "}")
    assert accepts(loose, "{\n" + " " * (WHITESPACE_RUN - 1) + '"name": "Paris"}')
    assert not accepts(loose, "{\n" + " " * WHITESPACE_RUN + '"name": "Paris"}')


def test_tool_arguments_are_strict_unless_the_function_says_not(accepts: Any) -> None:
    def grammar(strict: bool | None) -> str:
        tool = FunctionTool(name="get_weather", parameters=WEATHER_PARAMS, strict=strict)
        return tool_call_grammar(HERMES, ToolConfig(tools=(tool,), mode="required", parallel=False))

    padded = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "type": "string"}}\n</tool_call>'
    )
    indented = '<tool_call>\n{"name": "get_weather", "arguments": {\n    "city": "Paris"}}\n</tool_call>'
    for strict in (None, True):
        assert not accepts(grammar(strict), padded)
        assert not accepts(grammar(strict), indented)
    assert accepts(grammar(False), padded)
    assert accepts(grammar(False), indented)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_tools_or_answer(fmt: ToolCallFormat, accepts: Any) -> None:
    cfg = config("auto")
    answer = json_rule_schema(PERSON, strict=True)
    grammar = tools_or_answer_grammar(fmt, cfg, answer, "response_format.json_schema")
    assert grammar.splitlines()[0].endswith(" | answer")
    assert "// response_format.json_schema\nanswer: %json " in grammar
    assert accepts(grammar, fmt.render_calls([WEATHER]))
    assert accepts(grammar, fmt.render_calls([TIME, WEATHER]))
    assert accepts(grammar, '{"name": "Paris", "population": 2102650}')
    assert not accepts(grammar, '{"name": "Paris", "extra": 1}')
    assert not accepts(grammar, "Paris has 2 million people.")
    # The answer reads as content, the calls as calls.
    answer_text = '{"name": "Paris", "population": 2102650}'
    assert parse_output(fmt, cfg, answer_text) == ParsedOutput(answer_text, [])
    with pytest.raises(ValueError, match="allows no call"):
        tools_or_answer_grammar(fmt, config("none"), answer, "response_format")


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_named_call_prefix_pieces() -> None:
    cfg = config(NAMED_WEATHER)
    head = '{"name": "get_weather", "arguments": '
    assert [(p.text, p.control) for p in named_call_prefix(HERMES, cfg)] == [
        ("<tool_call>", True),
        ("\n", False),
        (head, False),
    ]
    assert [(p.text, p.control) for p in named_call_prefix(MISTRAL, cfg)] == [
        ("[TOOL_CALLS]", True),
        ("[", False),
        (head, False),
    ]
    assert [(p.text, p.control) for p in named_call_prefix(LLAMA3_JSON, cfg)] == [
        ('{"name": "get_weather", "parameters": ', False)
    ]
    with pytest.raises(ValueError, match="names no function"):
        named_call_prefix(HERMES, config("required"))
    with pytest.raises(ValueError, match="names no function"):
        named_call_grammar(HERMES, config("required"))


def test_named_hermes_rest_grammar_text() -> None:
    grammar = named_call_grammar(HERMES, config(NAMED_WEATHER))
    args = json_rule_schema(WEATHER_PARAMS, strict=True, lenient=True)
    assert grammar == (
        'start: args "}" "\\n" "</tool_call>"\n'
        "// tools[0].function.parameters\n"
        f"args: %json {json.dumps(args, separators=(',', ':'))}\n"
    )


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_named_call_prefix_and_rest_are_the_whole_call(fmt: ToolCallFormat, accepts: Any) -> None:
    """The server's prefix + what the grammar allows is the call as the format
    writes it; the primed parser reads the rest as that call, whole or cut."""
    cfg = config(NAMED_WEATHER)
    primer = "".join(p.text for p in named_call_prefix(fmt, cfg))
    whole = fmt.render_calls([WEATHER])
    assert whole.startswith(primer)
    rest = whole[len(primer) :]
    grammar = named_call_grammar(fmt, cfg)
    assert accepts(grammar, rest), rest
    assert not accepts(grammar, whole)  # the model never writes the name again
    assert not accepts(grammar, rest.replace('"Paris"', "1"))  # city is a string
    parsed = parse_output(fmt, cfg, rest, primer=primer)
    assert parsed.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})
    ]
    cut = parse_output(fmt, cfg, '{"city": "Par', primer=primer, cut=True)
    assert cut.content is None
    assert [(c.function.name, c.function.arguments) for c in cut.tool_calls] == [
        ("get_weather", '{"city":"Par')
    ]
    # Cut before a single argument token: still the call, arguments not begun.
    empty = parse_output(fmt, cfg, "", primer=primer, cut=True)
    assert [(c.function.name, c.function.arguments) for c in empty.tool_calls] == [("get_weather", "")]
