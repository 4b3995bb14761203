"""The test chat templates in ``tests/data/tool_templates/`` render each tool-call family's format.

Each template was written for these tests from the family's published template (cited in its
leading comment). Rendered here as ``transformers`` renders a chat template (an immutable
sandbox with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, its ``tojson``) over one
conversation: two parallel calls, their two results, a second user turn. The expected call
and result text is written out by hand from the format facts, so a template that drifts from
its family's format fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATES = Path(__file__).resolve().parents[3] / "data" / "tool_templates"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``transformers``' replacement for Jinja's ``tojson`` (no HTML escaping, no key sorting)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def render(name: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    template = env.from_string((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"))
    return template.render(messages=messages, tools=TOOLS, add_generation_prompt=True, **kwargs)


def conversation(
    ids: tuple[str, str] = ("call_1", "call_2"), weather_args: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """System, user, an assistant turn with two calls (arguments decoded to objects, as the
    proxy hands them to the template), the two results, a second user turn."""
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": ids[0],
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": weather_args or {"city": "Paris", "days": 3},
                    },
                },
                {"id": ids[1], "type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": ids[0], "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": ids[1], "content": "12:00"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]


KIMI_IDS = ("functions.get_weather:0", "functions.get_time:1")


def ds(*words: str) -> str:
    """A DeepSeek marker: U+FF5C (fullwidth bar) on each side of the words joined by U+2581."""
    return "<\uff5c" + "\u2581".join(words) + "\uff5c>"


DS_USER, DS_ASSISTANT, DS_EOS = ds("User"), ds("Assistant"), ds("end", "of", "sentence")
DS_CALLS_BEGIN, DS_CALLS_END = ds("tool", "calls", "begin"), ds("tool", "calls", "end")
DS_CALL_BEGIN, DS_SEP, DS_CALL_END = ds("tool", "call", "begin"), ds("tool", "sep"), ds("tool", "call", "end")
DS_OUT_BEGIN, DS_OUT_END = ds("tool", "output", "begin"), ds("tool", "output", "end")

# family -> (the assistant turn's calls, the two results, the prompt's end), each written by hand.
EXPECTED: dict[str, tuple[str, str, str]] = {
    "qwen3_coder": (
        "<|im_start|>assistant\n"
        "<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call><|im_end|>\n",
        "<|im_start|>user\n"
        '<tool_response>\n{"temp": 18}\n</tool_response>\n'
        "<tool_response>\n12:00\n</tool_response>\n<|im_end|>\n",
        "<|im_start|>user\nThanks. And tomorrow?<|im_end|>\n<|im_start|>assistant\n",
    ),
    "glm4": (
        "<|assistant|>\n<think></think>"
        "\n<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call>"
        "\n<tool_call>get_time\n</tool_call>",
        '<|observation|>\n<tool_response>\n{"temp": 18}\n</tool_response>'
        "\n<tool_response>\n12:00\n</tool_response>",
        "<|user|>\nThanks. And tomorrow?<|assistant|>",
    ),
    "glm47": (
        "<|assistant|></think>"
        "<tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value>"
        "</tool_call>"
        "<tool_call>get_time</tool_call>",
        '<|observation|><tool_response>{"temp": 18}</tool_response><tool_response>12:00</tool_response>',
        "<|user|>Thanks. And tomorrow?<|assistant|><think>",
    ),
    "deepseek_v31": (
        f"{DS_ASSISTANT}</think>{DS_CALLS_BEGIN}"
        f'{DS_CALL_BEGIN}get_weather{DS_SEP}{{"city": "Paris", "days": 3}}{DS_CALL_END}'
        f"{DS_CALL_BEGIN}get_time{DS_SEP}{{}}{DS_CALL_END}"
        f"{DS_CALLS_END}{DS_EOS}",
        f'{DS_OUT_BEGIN}{{"temp": 18}}{DS_OUT_END}{DS_OUT_BEGIN}12:00{DS_OUT_END}',
        f"{DS_USER}Thanks. And tomorrow?{DS_ASSISTANT}</think>",
    ),
    "kimi_k2": (
        "<|im_assistant|>assistant<|im_middle|>"
        "<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}'
        "<|tool_call_end|>"
        "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|><|im_end|>",
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp": 18}<|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n12:00<|im_end|>",
        "<|im_user|>user<|im_middle|>Thanks. And tomorrow?<|im_end|><|im_assistant|>assistant<|im_middle|>",
    ),
    "llama4_pythonic": (
        '<|header_start|>assistant<|header_end|>\n\n[get_weather(city="Paris", days="3"), get_time()]<|eot|>',
        '<|header_start|>ipython<|header_end|>\n\n"{\\"temp\\": 18}"<|eot|>'
        '<|header_start|>ipython<|header_end|>\n\n"12:00"<|eot|>',
        "<|header_start|>user<|header_end|>\n\nThanks. And tomorrow?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n",
    ),
    "gemma4": (
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
        "<|tool_call>call:get_time{}<tool_call|>",
        '<|tool_response>response:get_weather{value:<|"|>{"temp": 18}<|"|>}<tool_response|>'
        '<|tool_response>response:get_time{value:<|"|>12:00<|"|>}<tool_response|>',
        "<|turn>user\nThanks. And tomorrow?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
    ),
}


def test_every_template_file_is_covered() -> None:
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(EXPECTED)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_template_renders_the_family_format(family: str) -> None:
    calls, results, tail = EXPECTED[family]
    ids = KIMI_IDS if family == "kimi_k2" else ("call_1", "call_2")
    text = render(family, conversation(ids), bos_token="<BOS>")
    # The calls, then the results, then the second user turn and the generation prompt.
    assert calls in text
    assert results in text
    assert text.endswith(tail)
    assert text.index(calls) < text.index(results) < text.index(tail)
    # The tools are declared before the first user turn.
    assert text.index("get_time") < text.index("Weather and time in Paris?")


def test_gemma4_results_follow_the_calls_in_the_same_model_turn() -> None:
    calls, results, _ = EXPECTED["gemma4"]
    text = render("gemma4", conversation(), bos_token="<bos>")
    assert calls + results + "<|turn>user\n" in text
    assert text.startswith(
        '<bos><|turn>system\nYou are terse.<|tool>declaration:get_weather{description:<|"|>'
    )


NESTED = {"city": "Paris", "days": 3, "metric": True, "hours": [9, 18], "where": {"lat": 48.9}}


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        # Qwen: strings as they are, mappings and lists as JSON, the rest through `| string`
        # (a boolean becomes Python's `True`, as in the published template).
        (
            "qwen3_coder",
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[9, 18]\n</parameter>\n"
            '<parameter=where>\n{"lat": 48.9}\n</parameter>\n',
        ),
        # GLM: strings as they are, everything else as JSON.
        (
            "glm4",
            "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
            "<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
            "<arg_key>hours</arg_key>\n<arg_value>[9, 18]</arg_value>\n"
            '<arg_key>where</arg_key>\n<arg_value>{"lat": 48.9}</arg_value>\n',
        ),
        (
            "glm47",
            "<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value>"
            "<arg_key>metric</arg_key><arg_value>true</arg_value>"
            "<arg_key>hours</arg_key><arg_value>[9, 18]</arg_value>"
            '<arg_key>where</arg_key><arg_value>{"lat": 48.9}</arg_value>',
        ),
        # DeepSeek / Kimi: the whole arguments object as one JSON text.
        (
            "deepseek_v31",
            DS_SEP + '{"city": "Paris", "days": 3, "metric": true, "hours": [9, 18], "where": {"lat": 48.9}}',
        ),
        # Gemma 4: keys sorted and bare, strings between <|"|>, nested objects in the same syntax.
        (
            "gemma4",
            '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,hours:[9,18],metric:true,'
            "where:{lat:48.9}}<tool_call|>",
        ),
        # vLLM's Llama 4 pythonic template quotes every value's %s text.
        (
            "llama4_pythonic",
            'get_weather(city="Paris", days="3", metric="True", hours="[9, 18]", where="{\'lat\': 48.9}")',
        ),
    ],
)
def test_non_string_values(family: str, expected: str) -> None:
    assert expected in render(family, conversation(weather_args=NESTED))


@pytest.mark.parametrize("family", ["deepseek_v31", "kimi_k2"])
def test_string_arguments_are_written_as_they_are(family: str) -> None:
    """The published DeepSeek/Kimi templates take ``arguments`` as a JSON string too."""
    messages = conversation(KIMI_IDS)
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"city":"Paris","days":3}'
    assert '{"city":"Paris","days":3}<' in render(family, messages)
