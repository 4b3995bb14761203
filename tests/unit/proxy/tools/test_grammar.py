"""Grammars for forced tool calls and ``response_format`` (``proxy.constraints``): their text, and (with
llguidance installed) that llguidance compiles them and accepts exactly what
the parser reads."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest

from proxy.constraints import ANY_JSON_OBJECT, json_schema_grammar
from proxy.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat
from proxy.tools.grammar import call_schema, tool_call_grammar
from proxy.tools.parser import parse_output
from proxy.tools.spec import FunctionCall, FunctionTool
from tests.unit.proxy.tools.conftest import WEATHER_PARAMS, config

NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def test_named_hermes_grammar_text() -> None:
    grammar = tool_call_grammar(HERMES, config(NAMED_TIME, parallel=False))
    wrapper = {
        "type": "object",
        "properties": {"name": {"const": "get_time"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": {"lenient": True},
    }
    assert grammar == (
        "start: call\n"
        'call: "<tool_call>" "\\n" fn "\\n" "</tool_call>"\n'
        "fn: fn_0\n"
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
    schema = call_schema(FunctionTool(name="get_weather", parameters=WEATHER_PARAMS), "parameters")
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
    schema = call_schema(FunctionTool(name="f", parameters=params), lenient=False)
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
    any_object = json_schema_grammar(ANY_JSON_OBJECT, "response_format")
    assert accepts(any_object, '{"a": [1, 2]}')
    assert not accepts(any_object, "[1, 2]")
    schema: dict[str, object] = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
    }
    assert accepts(json_schema_grammar(schema, "response_format"), '{"a": 3}')
    assert not accepts(json_schema_grammar(schema, "response_format"), '{"a": "3"}')
