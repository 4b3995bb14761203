"""Format registry, ``--tool-call-format`` names and chat-template detection."""

from __future__ import annotations

import pytest

from proxy.tools.formats import (
    FORMATS,
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    TOOL_CALL_FORMAT_CHOICES,
    FormatChoice,
    choose_format,
    detect_format,
    get_format,
)

# The embedded SmolLM2-135M-Instruct's template (ChatML, from its GGUF): no tools.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# Excerpts of published templates, enough for what detection looks at.
QWEN25 = (
    '{%- if tools %}{{- "# Tools\\n\\n<tools>" }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}'
    '{{- "</tools>\\n\\nFor each function call ... within <tool_call></tool_call> XML tags" }}{%- endif %}'
)
LLAMA31 = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
    'its value}.\' }}{%- elif message.role == "tool" or message.role == "ipython" %}'
    '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}'
)
LLAMA31_BUILTIN = LLAMA31 + '{{- "<|python_tag|>" + tool_call.name + ".call(" }}'
# openai/gpt-oss-20b's template: history calls in the role header, ended by <|call|>.
GPT_OSS = (
    '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary " }}'
    '{{- "json<|message|>" }}{{- tool_call.arguments|tojson }}{{- "<|call|>" }}'
)
MISTRAL_V3 = '{%- if message.tool_calls %}{{- "[TOOL_CALLS][" }}{%- for tool_call in message.tool_calls %}'


def test_names_and_choices() -> None:
    assert list(FORMATS) == ["hermes", "llama3_json", "mistral", "harmony"]
    assert TOOL_CALL_FORMAT_CHOICES == ("auto", "hermes", "llama3_json", "mistral", "harmony")
    assert [get_format(n) for n in FORMATS] == [HERMES, LLAMA3_JSON, MISTRAL, HARMONY]
    assert [f.name for f in FORMATS.values()] == list(FORMATS)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"'qwen'.*hermes, llama3_json, mistral, harmony"):
        get_format("qwen")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN25, HERMES),
        (LLAMA31, LLAMA3_JSON),
        (LLAMA31_BUILTIN, LLAMA3_JSON),
        (MISTRAL_V3, MISTRAL),
        (GPT_OSS, HARMONY),
        (SMOLLM2, None),
        ("", None),
        (None, None),
    ],
)
def test_detect(template: str | None, expected: object) -> None:
    assert detect_format(template) is expected


def test_markers() -> None:
    assert HERMES.markers == ("<tool_call>",)
    assert LLAMA3_JSON.markers == ("<|python_tag|>",) and LLAMA3_JSON.bare_json
    assert MISTRAL.markers == ("[TOOL_CALLS]",)
    assert HARMONY.markers == ("<|start|>", "<|channel|>", " to=functions.")


@pytest.mark.parametrize(
    ("setting", "template", "expected"),
    [
        ("auto", SMOLLM2, FormatChoice(HERMES, native=False)),
        ("auto", None, FormatChoice(HERMES, native=False)),
        ("auto", QWEN25, FormatChoice(HERMES, native=True)),
        ("auto", LLAMA31, FormatChoice(LLAMA3_JSON, native=True)),
        ("auto", MISTRAL_V3, FormatChoice(MISTRAL, native=True)),
        ("auto", GPT_OSS, FormatChoice(HARMONY, native=True)),
        ("mistral", SMOLLM2, FormatChoice(MISTRAL, native=False)),
        ("llama3_json", QWEN25, FormatChoice(LLAMA3_JSON, native=True)),
    ],
)
def test_choose(setting: str, template: str | None, expected: FormatChoice) -> None:
    assert choose_format(setting, template) == expected


def test_choose_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown tool call format"):
        choose_format("xml", QWEN25)
