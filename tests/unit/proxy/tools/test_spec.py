"""``tools`` / ``tool_choice`` / ``parallel_tool_calls`` validation and the history types."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from proxy.tools.spec import (
    FunctionCall,
    HistoryMessage,
    ToolCall,
    ToolChoiceIn,
    ToolSpecError,
    check_history,
    resolve_tools,
)
from tests.unit.proxy.tools.conftest import TOOLS_JSON, WEATHER_PARAMS, config, tools_in


def fn_tool(name: str, **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **extra}}


def test_defaults_are_auto_and_parallel() -> None:
    c = config()
    assert (c.mode, c.function, c.parallel) == ("auto", None, True)
    assert [t.name for t in c.tools] == ["get_weather", "get_time"]
    assert c.tools[0].parameters == WEATHER_PARAMS
    assert c.tools[0].description == "Weather in a city"
    assert c.tools[1].parameters is None
    assert c.active and not c.forced
    assert c.callable_names() == frozenset({"get_weather", "get_time"})


@pytest.mark.parametrize(
    ("choice", "mode", "function", "callable_names"),
    [
        ("auto", "auto", None, {"get_weather", "get_time"}),
        ("required", "required", None, {"get_weather", "get_time"}),
        ("none", "none", None, set()),
        ({"type": "function", "function": {"name": "get_time"}}, "function", "get_time", {"get_time"}),
    ],
)
def test_tool_choice(choice: Any, mode: str, function: str | None, callable_names: set[str]) -> None:
    c = config(choice)
    assert (c.mode, c.function) == (mode, function)
    assert c.callable_names() == callable_names
    assert c.forced == (mode in ("required", "function"))
    assert c.active == (mode != "none")


def test_parallel_false_is_kept() -> None:
    assert config(parallel=False).parallel is False


@pytest.mark.parametrize("tools", [None, []])
@pytest.mark.parametrize("choice", [None, "none"])
def test_no_tools_is_no_config(tools: list[Any] | None, choice: str | None) -> None:
    assert resolve_tools(tools, choice, None) is None


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_tool_choice_without_tools(choice: Any) -> None:
    decoded = msgspec.convert(choice, ToolChoiceIn)
    with pytest.raises(ToolSpecError) as e:
        resolve_tools([], decoded, None)
    assert e.value.param == "tool_choice"
    assert "requires 'tools'" in e.value.message


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"type": "retrieval"}, "'tools[0].type' is 'retrieval'"),
        ({"type": "custom", "custom": {"name": "x"}}, "only 'function' tools"),
        ({"type": "function"}, "'tools[0].function' is required"),
        (
            {"type": "function", "function": {"description": "no name"}},
            "'tools[0].function.name' is required",
        ),
    ],
)
def test_bad_tool_entries(raw: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ToolSpecError) as e:
        resolve_tools(tools_in([raw]), None, None)
    assert e.value.param == "tools"
    assert fragment in e.value.message
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", ["", "has space", "dot.name", "naïve", "x" * 65, "a/b"])
def test_bad_function_names(name: str) -> None:
    with pytest.raises(ToolSpecError) as e:
        resolve_tools(tools_in([fn_tool("ok"), fn_tool(name)]), None, None)
    assert e.value.param == "tools"
    assert "'tools[1].function.name'" in e.value.message
    # Quoted whole up to 64 characters, a prefix and the length beyond (proxy.errors.quoted).
    shown = repr(name) if len(name) <= 64 else repr(name[:64]) + "... (65 characters)"
    assert shown in e.value.message


@pytest.mark.parametrize("name", ["a", "x" * 64, "get-weather_V2", "0"])
def test_good_function_names(name: str) -> None:
    c = resolve_tools(tools_in([fn_tool(name)]), None, None)
    assert c is not None and c.tools[0].name == name


def test_duplicate_function_names() -> None:
    with pytest.raises(ToolSpecError) as e:
        resolve_tools(tools_in([fn_tool("f"), fn_tool("g"), fn_tool("f")]), None, None)
    assert e.value.param == "tools"
    assert "'f' more than once" in e.value.message


@pytest.mark.parametrize(
    ("choice", "fragment"),
    [
        ("any", "'tool_choice' is 'any'"),
        ({"type": "function", "function": {"name": "get_stock"}}, "'get_stock', which is not among"),
        ({"type": "allowed_tools"}, "'tool_choice.type' is 'allowed_tools'"),
        ({"type": "function"}, "'tool_choice.function.name' is required"),
        ({"type": "function", "function": {}}, "'tool_choice.function.name' is required"),
    ],
)
def test_bad_tool_choice(choice: Any, fragment: str) -> None:
    decoded = msgspec.convert(choice, ToolChoiceIn)
    with pytest.raises(ToolSpecError) as e:
        resolve_tools(tools_in(TOOLS_JSON), decoded, None)
    assert e.value.param == "tool_choice"
    assert fragment in e.value.message


def test_missing_function_lists_known_names() -> None:
    with pytest.raises(ToolSpecError) as e:
        config({"type": "function", "function": {"name": "nope"}})
    assert "'get_weather', 'get_time'" in e.value.message


def test_history_decodes_openai_shapes() -> None:
    raw = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                # some clients leave "type" out
                {"id": "call_2", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    msgs = msgspec.convert(raw, list[HistoryMessage])
    assert msgs[1].content is None
    assert msgs[1].tool_calls == (
        ToolCall(id="call_1", function=FunctionCall("get_weather", '{"city":"Paris"}')),
        ToolCall(id="call_2", function=FunctionCall("get_time", "{}")),
    )
    assert msgs[1].tool_calls[1].type == "function"
    assert msgs[2].tool_call_id == "call_1"
    check_history(msgs)


def test_tool_call_encodes_in_openai_key_order() -> None:
    call = ToolCall(id="call_1", function=FunctionCall("get_time", "{}"))
    assert msgspec.json.encode(call) == (
        b'{"id":"call_1","type":"function","function":{"name":"get_time","arguments":"{}"}}'
    )


def test_tool_message_needs_tool_call_id() -> None:
    msgs = [HistoryMessage(role="user", content="hi"), HistoryMessage(role="tool", content="18C")]
    with pytest.raises(ToolSpecError) as e:
        check_history(msgs)
    assert e.value.param == "messages[1].tool_call_id"


def test_tool_calls_only_on_assistant() -> None:
    call = ToolCall(id="c", function=FunctionCall("get_time", "{}"))
    with pytest.raises(ToolSpecError) as e:
        check_history([HistoryMessage(role="user", content="hi", tool_calls=(call,))])
    assert e.value.param == "messages[0].tool_calls"
