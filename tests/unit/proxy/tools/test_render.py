"""The fallback for chat templates without tools: plain (role, content) messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol.messages import ImageInput
from proxy.tools.formats import HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat
from proxy.tools.parser import parse_output
from proxy.tools.render import render_fallback, tools_prompt
from proxy.tools.spec import FunctionCall, HistoryMessage, ToolCall, ToolConfig
from tests.unit.proxy.tools.conftest import WEATHER_PARAMS, config
from tests.unit.proxy.tools.test_formats import SMOLLM2

WEATHER_LINE = json.dumps(
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
    },
    separators=(",", ":"),
)
TIME_LINE = '{"type":"function","function":{"name":"get_time"}}'


def fallback(*args: Any, **kwargs: Any) -> list[tuple[str, str]]:
    """``render_fallback``'s turns as ``(role, content)``: these tests have no images."""
    turns = render_fallback(*args, **kwargs)
    assert all(t.images == () for t in turns)
    return [(t.role, t.content) for t in turns]


def expected_section(lines: list[str], choice: str, parallel: str, syntax: str) -> str:
    return (
        "# Tools\n\n"
        "You can call functions to help with the user's request. "
        "Their definitions, one JSON object per line:\n"
        "<tools>\n" + "".join(line + "\n" for line in lines) + "</tools>\n\n"
        "To call a function, write:\n" + syntax + "\n" + choice + "\n" + parallel + "\n"
        "Each result comes back in a user message inside <tool_response></tool_response>."
    )


HERMES_SYNTAX = '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'
AUTO_LINE = "Call a function only when it helps; otherwise answer directly."
PARALLEL_LINE = "You may call several functions in one reply."

CALLS = (
    ToolCall(id="call_a", function=FunctionCall("get_weather", '{"city": "Paris"}')),
    ToolCall(id="call_b", function=FunctionCall("get_time", "{}")),
)
HISTORY = [
    HistoryMessage(role="developer", content="Be brief."),
    HistoryMessage(role="user", content="Weather in Paris, and the time?"),
    HistoryMessage(role="assistant", content=None, tool_calls=CALLS),
    HistoryMessage(role="tool", tool_call_id="call_a", content="18C, sunny"),
    HistoryMessage(role="tool", tool_call_id="call_b", content="14:05"),
    HistoryMessage(role="assistant", content="18C and sunny; it is 14:05."),
    HistoryMessage(role="user", content="Thanks"),
]


def test_full_conversation() -> None:
    section = expected_section([WEATHER_LINE, TIME_LINE], AUTO_LINE, PARALLEL_LINE, HERMES_SYNTAX)
    assert fallback(config(), HISTORY) == [
        ("system", "Be brief.\n\n" + section),
        ("user", "Weather in Paris, and the time?"),
        (
            "assistant",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ),
        ("user", "<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"),
        ("assistant", "18C and sunny; it is 14:05."),
        ("user", "Thanks"),
    ]


def test_system_message_inserted_when_absent() -> None:
    out = fallback(config(), [HistoryMessage(role="user", content="Hi")])
    assert out[0] == (
        "system",
        expected_section([WEATHER_LINE, TIME_LINE], AUTO_LINE, PARALLEL_LINE, HERMES_SYNTAX),
    )
    assert out[1:] == [("user", "Hi")]


@pytest.mark.parametrize(
    ("choice", "parallel", "lines", "choice_line", "parallel_line"),
    [
        (
            "required",
            None,
            [WEATHER_LINE, TIME_LINE],
            "You must call at least one function in your reply.",
            PARALLEL_LINE,
        ),
        (
            {"type": "function", "function": {"name": "get_time"}},
            None,
            [TIME_LINE],
            "You must call the function get_time in your reply.",
            PARALLEL_LINE,
        ),
        ("auto", False, [WEATHER_LINE, TIME_LINE], AUTO_LINE, "Call at most one function per reply."),
    ],
)
def test_choice_and_parallel_lines(
    choice: Any, parallel: bool | None, lines: list[str], choice_line: str, parallel_line: str
) -> None:
    cfg = config(choice, parallel)
    assert tools_prompt(cfg) == expected_section(lines, choice_line, parallel_line, HERMES_SYNTAX)


def test_no_section_without_callable_tools() -> None:
    history = HISTORY[1:4]
    expected = [
        ("user", "Weather in Paris, and the time?"),
        (
            "assistant",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ),
        ("user", "<tool_response>\n18C, sunny\n</tool_response>"),
    ]
    assert fallback(None, history) == expected
    assert fallback(config("none"), history) == expected


def test_assistant_text_and_non_json_arguments() -> None:
    call = ToolCall(id="c", function=FunctionCall("get_time", "not json"))
    out = fallback(None, [HistoryMessage(role="assistant", content="Checking.", tool_calls=(call,))])
    assert out == [
        ("assistant", 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": "not json"}\n</tool_call>')
    ]


def test_empty_system_message_gets_only_the_section() -> None:
    cfg = config()
    out = fallback(cfg, [HistoryMessage(role="system", content=""), HistoryMessage(role="user", content="x")])
    assert out[0] == ("system", tools_prompt(cfg))


def test_pure() -> None:
    cfg = config()
    assert fallback(cfg, HISTORY) == fallback(cfg, HISTORY)
    assert HISTORY[2].content is None


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_rendered_calls_parse_back(fmt: ToolCallFormat, auto: ToolConfig) -> None:
    text = fmt.render_calls([c.function for c in CALLS])
    parsed = parse_output(fmt, auto, text)
    assert parsed.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


def test_renders_through_the_embedded_template() -> None:
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    assert jinja2 is not None
    pairs = fallback(config(), HISTORY)
    template = ImmutableSandboxedEnvironment().from_string(SMOLLM2)
    prompt = template.render(
        messages=[{"role": r, "content": c} for r, c in pairs], add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "SmolLM" not in prompt  # our system message replaced the default one
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather"' in prompt
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_images_keep_their_place_through_the_rendering() -> None:
    """A user turn's images keep their offsets; tool results' images move with
    their result's text into the one user turn the results become."""
    shot, other, photo = (ImageInput(b, o, p) for b, o, p in ((b"1", 2, "a"), (b"2", 0, "b"), (b"3", 1, "c")))
    history = [
        HistoryMessage(role="user", content="hi\n", images=(photo,)),
        HistoryMessage(role="tool", content="ok\n", tool_call_id="1", images=(shot,)),
        HistoryMessage(role="tool", content="\n", tool_call_id="2", images=(other,)),
    ]
    user, results = render_fallback(None, history)
    assert user == ("user", "hi\n", (photo,))
    first = "<tool_response>\nok\n\n</tool_response>"
    assert results.content == first + "\n<tool_response>\n\n\n</tool_response>"
    assert [im.offset for im in results.images] == [len("<tool_response>\nok"), len(first) + 1 + 16]
    assert [results.content[: im.offset].count("<tool_response>") for im in results.images] == [1, 2]
