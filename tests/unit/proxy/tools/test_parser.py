"""The streaming tool-call parser and the whole-output parse, for every format,
under every way the engine may split the text."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from proxy.tools.formats import FORMATS, HARMONY, HERMES, LLAMA3_JSON, MISTRAL, ToolCallFormat
from proxy.tools.parser import (
    ContentDelta,
    FunctionDelta,
    StreamEvent,
    ToolCallDelta,
    ToolCallParser,
    finish_reason,
    parse_output,
)
from proxy.tools.spec import ToolConfig
from tests.unit.proxy.tools.conftest import config, counter_ids


def splits(text: str) -> Iterator[list[str]]:
    """The text whole, in 1-character pieces, in fixed sizes, and at random cuts."""
    yield [text]
    yield list(text)
    for size in (2, 3, 5, 7, 13):
        yield [text[i : i + size] for i in range(0, len(text), size)]
    for seed in range(8):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream(fmt: ToolCallFormat, cfg: ToolConfig, chunks: list[str]) -> tuple[list[StreamEvent], bool]:
    parser = ToolCallParser(fmt, cfg, new_id=counter_ids())
    events: list[StreamEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    end = parser.finish()
    return events + end.events, end.tool_calls_made


@dataclass
class Assembled:
    content: str
    calls: list[tuple[str, str, str]]  # (id, name, arguments)


def assemble(events: list[StreamEvent]) -> Assembled:
    """What a client rebuilds: content concatenated; per index, the id, type and
    name of the first delta and the arguments concatenated."""
    content = ""
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text, "no empty content deltas"
            content += e.text
            continue
        if e.index not in calls:
            assert e.id and e.type == "function" and e.function.name, "first delta carries id, type, name"
            assert e.function.arguments == ""
            calls[e.index] = [e.id, e.function.name, ""]
        else:
            assert e.id is msgspec.UNSET and e.type is msgspec.UNSET and e.function.name is msgspec.UNSET
            assert isinstance(e.function.arguments, str)
            calls[e.index][2] += e.function.arguments
    assert sorted(calls) == list(range(len(calls))), "indices 0, 1, ... in order"
    return Assembled(content, [(c[0], c[1], c[2]) for _, c in sorted(calls.items())])


def compact(args: dict[str, Any]) -> str:
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False)


@dataclass
class Case:
    fmt: ToolCallFormat
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]  # (name, arguments) expected


PARIS = {"city": "Paris"}
BERLIN_F = {"city": "Berlin", "unit": "f"}

CASES: dict[str, Case] = {
    # hermes (Qwen 2.5 / Hermes 2 Pro)
    "hermes-call": Case(
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", PARIS)],
    ),
    "hermes-text-before": Case(
        HERMES,
        "Let me check that.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check that.",
        [("get_weather", PARIS)],
    ),
    "hermes-two-parallel": Case(
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "f"}}\n</tool_call>\n',
        "",
        [("get_weather", PARIS), ("get_weather", BERLIN_F)],
    ),
    "hermes-arguments-first-no-params": Case(
        HERMES,
        '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'
        '<tool_call>{"name": "get_time"}</tool_call>',
        "",
        [("get_time", {}), ("get_time", {})],
    ),
    "hermes-text-after": Case(
        HERMES,
        'A<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.\n',
        "ADone.\n",
        [("get_time", {})],
    ),
    "hermes-tag-inside-json-string": Case(
        HERMES,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b \\" }"}}</tool_call>',
        "",
        [("get_weather", {"city": 'a</tool_call>b " }'})],
    ),
    "hermes-unicode": Case(
        HERMES,
        'Voilà <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}</tool_call>',
        "Voilà",
        [("get_weather", {"city": "Zürich 東京"})],
    ),
    # llama3_json (Llama 3.1 / 3.2)
    "llama3-bare": Case(
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", PARIS)],
    ),
    "llama3-python-tag": Case(
        LLAMA3_JSON,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", PARIS)],
    ),
    "llama3-text-then-tag": Case(
        LLAMA3_JSON,
        'Checking. <|python_tag|>{"name": "get_time", "arguments": {}}',
        "Checking.",
        [("get_time", {})],
    ),
    "llama3-semicolons": Case(
        LLAMA3_JSON,
        '\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Berlin", "unit": "f"}}',
        "",
        [("get_weather", PARIS), ("get_weather", BERLIN_F)],
    ),
    # mistral
    "mistral-array": Case(
        MISTRAL,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]',
        "",
        [("get_weather", PARIS)],
    ),
    "mistral-array-two": Case(
        MISTRAL,
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "f"}}]',
        "Sure.",
        [("get_weather", PARIS), ("get_weather", BERLIN_F)],
    ),
    "mistral-args-form": Case(
        MISTRAL,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]x1y2z3w4v[ARGS]{}',
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    # harmony: the frames the worker's Harmony splitter lets through as content
    "harmony-channel-recipient": Case(
        HARMONY,
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
        "",
        [("get_weather", PARIS)],
    ),
    "harmony-role-recipient-after-a-preamble": Case(
        HARMONY,
        "Let me check.<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Berlin", "unit": "f"}<|call|>',
        "Let me check.",
        [("get_weather", BERLIN_F)],
    ),
    "harmony-role-recipient-at-the-start": Case(
        HARMONY,
        " to=functions.get_time<|channel|>commentary json<|message|>{}",
        "",
        [("get_time", {})],
    ),
    "harmony-on-the-analysis-channel": Case(
        HARMONY,
        '<|channel|>analysis to=functions.get_weather code<|message|>{"city":"Paris"}',
        "",
        [("get_weather", PARIS)],
    ),
}

# Malformed output: the raw text comes back as content, never an error.
RAW: dict[str, tuple[ToolCallFormat, str]] = {
    "hermes-unknown-function": (HERMES, '<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>'),
    "hermes-arguments-not-object": (HERMES, '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'),
    "hermes-tag-in-prose": (HERMES, "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>."),
    "hermes-marker-at-end": (HERMES, "trailing <tool_call"),
    "hermes-only-marker": (HERMES, "<tool_call>"),
    "llama3-json-answer": (LLAMA3_JSON, '{"answer": 42, "name": "get_time"}'),
    "llama3-json-later-in-text": (LLAMA3_JSON, 'The call is {"name": "get_time", "parameters": {}}'),
    "llama3-unknown-function": (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "brave_search", "parameters": {"q": 1}}',
    ),
    "llama3-builtin-syntax": (LLAMA3_JSON, '<|python_tag|>brave_search.call(query="x")'),
    "mistral-garbage": (MISTRAL, "[TOOL_CALLS] not a call"),
    "mistral-empty-array": (MISTRAL, "[TOOL_CALLS][]"),
    "mistral-args-not-object": (MISTRAL, "[TOOL_CALLS]get_time[ARGS][1, 2]"),
    "harmony-unknown-function": (
        HARMONY,
        "<|channel|>commentary to=functions.get_stock json<|message|>{}",
    ),
    "harmony-no-recipient": (HARMONY, "<|channel|>commentary<|message|>{}"),
    "harmony-arguments-not-object": (HARMONY, "<|channel|>commentary to=functions.get_time<|message|>[1]"),
    "harmony-no-message": (HARMONY, "<|channel|>commentary to=functions.get_time json"),
    "harmony-prose": (HARMONY, "Call it with to=functions.get_time in the header."),
    "plain": (HERMES, "  Just an answer, < and [ and { included.\n"),
}


# A call that goes wrong after part of it streamed: it ends with what it sent (a
# JSON prefix), and the text from where it broke is content; nothing is lost
# but insignificant whitespace. (format, text, content, calls as (name, arguments))
NO_WS = str.maketrans("", "", " \n")
WENT_WRONG: dict[str, tuple[ToolCallFormat, str, str, list[tuple[str, str]]]] = {
    "hermes-bad-json": (
        HERMES,
        'Hm <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
        "Hm}}\n</tool_call>",
        [("get_weather", '{"city":')],
    ),
    # The model stopped by itself inside the call (not cut): what streamed stays.
    "hermes-unterminated": (
        HERMES,
        'x\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "x",
        [("get_weather", '{"city":"Par')],
    ),
    "hermes-no-close-tag": (
        HERMES,
        '<tool_call>{"name": "get_time", "arguments": {}} and then text',
        " and then text",
        [("get_time", "{}")],
    ),
    "hermes-both-argument-keys": (
        HERMES,
        '<tool_call>{"name": "get_time", "arguments": {}, "parameters": {}}</tool_call>',
        "</tool_call>",
        [("get_time", "{}")],
    ),
    "llama3-unterminated": (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Pa',
        "",
        [("get_weather", '{"city":"Pa')],
    ),
    "mistral-one-bad-in-array": (
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        ', {"name": "nope", "arguments": {}}]',
        [("get_time", "{}")],
    ),
    "mistral-unterminated": (
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_time", "arguments": {',
        "",
        [("get_time", "{")],
    ),
    "harmony-bad-json": (
        HARMONY,
        '<|channel|>commentary to=functions.get_weather json<|message|>{"city" "Paris"}<|call|>',
        '"Paris"}<|call|>',
        [("get_weather", '{"city"')],
    ),
}


@pytest.mark.parametrize("name", WENT_WRONG)
def test_a_call_that_goes_wrong_ends_with_what_streamed(name: str, auto: ToolConfig) -> None:
    fmt, text, content, calls = WENT_WRONG[name]
    whole = parse_output(fmt, auto, text)
    assert (whole.content or "", [(c.function.name, c.function.arguments) for c in whole.tool_calls]) == (
        content,
        calls,
    )
    for chunks in splits(text):
        events, made = stream(fmt, auto, chunks)
        got = assemble(events)
        assert (got.content, [(n, a) for _, n, a in got.calls]) == (content, calls), chunks
        assert made
        # Nothing is invented: every character sent is the model's (whitespace aside).
        kept = "".join(a for _, a in calls) + content
        assert not Counter(kept.translate(NO_WS)) - Counter(text.translate(NO_WS))


def test_every_format_is_covered() -> None:
    assert {c.fmt.name for c in CASES.values()} == set(FORMATS)
    assert {fmt.name for fmt, _ in RAW.values()} == set(FORMATS)
    assert {fmt.name for fmt, *_ in WENT_WRONG.values()} == set(FORMATS)


@pytest.mark.parametrize("name", CASES)
def test_calls_in_every_split(name: str, auto: ToolConfig) -> None:
    case = CASES[name]
    for chunks in splits(case.text):
        events, made = stream(case.fmt, auto, chunks)
        got = assemble(events)
        assert got.content == case.content, chunks
        assert made
        assert [c[0] for c in got.calls] == [f"call_{i}" for i in range(len(case.calls))]
        assert [(c[1], json.loads(c[2])) for c in got.calls] == case.calls
        # Arguments are compact JSON text.
        assert [c[2] for c in got.calls] == [compact(a) for _, a in case.calls]


@pytest.mark.parametrize("name", RAW)
def test_malformed_is_raw_content(name: str, auto: ToolConfig) -> None:
    fmt, text = RAW[name]
    for chunks in splits(text):
        events, made = stream(fmt, auto, chunks)
        assert not made
        assert all(isinstance(e, ContentDelta) for e in events)
        assert assemble(events).content == text, chunks
    parsed = parse_output(fmt, auto, text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


def test_valid_call_after_a_malformed_one(auto: ToolConfig) -> None:
    bad = '<tool_call>{"name": "nope"}</tool_call>'
    text = f'{bad}\n<tool_call>{{"name": "get_time"}}</tool_call>'
    for chunks in splits(text):
        got = assemble(stream(HERMES, auto, chunks)[0])
        assert got.content == bad
        assert [(c[1], c[2]) for c in got.calls] == [("get_time", "{}")]


MARKERS = (
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|channel|>",
    "<|message|>",
)


@pytest.mark.parametrize("name", CASES)
def test_content_deltas_carry_no_marker_piece(name: str, auto: ToolConfig) -> None:
    case = CASES[name]
    for chunk in ToolCallParser(case.fmt, auto).feed(case.text[:-1]):
        if isinstance(chunk, ContentDelta):
            for m in MARKERS:
                for k in range(2, len(m) + 1):
                    assert m[:k] not in chunk.text


def test_partial_marker_is_held_back_then_released(auto: ToolConfig) -> None:
    p = ToolCallParser(HERMES, auto)
    assert p.feed("Hi <tool") == [ContentDelta("Hi")]
    assert p.feed("_ca") == []
    assert p.feed("t is here") == [ContentDelta(" <tool_cat is here")]
    assert p.finish().events == []


def test_text_before_call_streams_before_the_call_completes(auto: ToolConfig) -> None:
    p = ToolCallParser(HERMES, auto, new_id=counter_ids())
    assert p.feed("Let me look") == [ContentDelta("Let me look")]
    assert p.feed(" it up.\n<tool_call>\n{") == [ContentDelta(" it up.")]
    assert p.feed('"name": "get_time", "arguments": {}}\n') == [
        ToolCallDelta(index=0, id="call_0", type="function", function=FunctionDelta("get_time", "")),
        ToolCallDelta(index=0, function=FunctionDelta(arguments="{}")),
    ]
    assert p.feed("</tool_call>") == []
    end = p.finish()
    assert end.events == [] and end.tool_calls_made


def test_arguments_stream_as_they_are_written(auto: ToolConfig) -> None:
    p = ToolCallParser(HERMES, auto, new_id=counter_ids())
    assert p.feed('<tool_call>\n{"name": "get_weather", "arg') == []  # not opened yet
    assert p.feed('uments": {"ci') == [
        ToolCallDelta(index=0, id="call_0", type="function", function=FunctionDelta("get_weather", "")),
        ToolCallDelta(index=0, function=FunctionDelta(arguments='{"ci')),
    ]
    assert p.feed('ty": "Pa') == [ToolCallDelta(index=0, function=FunctionDelta(arguments='ty":"Pa'))]
    # An escape, a number and a literal are held until complete.
    assert p.feed("ris\\") == [ToolCallDelta(index=0, function=FunctionDelta(arguments="ris"))]
    assert p.feed('n", "n": 1') == [ToolCallDelta(index=0, function=FunctionDelta(arguments='\\n","n":'))]
    assert p.feed('2, "ok": tr') == [ToolCallDelta(index=0, function=FunctionDelta(arguments='12,"ok":'))]
    assert p.feed("ue}") == [ToolCallDelta(index=0, function=FunctionDelta(arguments="true}"))]
    assert p.feed("}\n</tool_call>") == []
    assert [c.function.arguments for c in p.tool_calls] == ['{"city":"Paris\\n","n":12,"ok":true}']


def test_llama3_json_answer_streams_once_it_is_not_a_call(auto: ToolConfig) -> None:
    p = ToolCallParser(LLAMA3_JSON, auto)
    assert p.feed('{"ans') == []
    assert p.feed('wer": ') == [ContentDelta('{"answer":')]


def test_delta_wire_shape(auto: ToolConfig) -> None:
    events, _ = stream(HERMES, auto, [CASES["hermes-call"].text])
    assert [msgspec.json.encode(e) for e in events] == [
        b'{"index":0,"id":"call_0","type":"function","function":{"name":"get_weather","arguments":""}}',
        b'{"index":0,"function":{"arguments":"{\\"city\\":\\"Paris\\"}"}}',
    ]


def test_default_ids() -> None:
    cfg = config()
    two = CASES["hermes-two-parallel"].text
    ids = [c.id for c in parse_output(HERMES, cfg, two).tool_calls]
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids) and len(set(ids)) == 2
    # Mistral's templates accept only 9 alphanumerics when the history comes back.
    ids = [c.id for c in parse_output(MISTRAL, cfg, CASES["mistral-array-two"].text).tool_calls]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 2


def test_parallel_false_keeps_the_first_call() -> None:
    cfg = config(parallel=False)
    for chunks in splits(CASES["hermes-two-parallel"].text):
        got = assemble(stream(HERMES, cfg, chunks)[0])
        assert got == Assembled("", [("call_0", "get_weather", compact(PARIS))])


def test_named_choice_accepts_only_that_function() -> None:
    cfg = config({"type": "function", "function": {"name": "get_time"}})
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert parse_output(HERMES, cfg, text).content == text
    ok = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert [c.function.name for c in parse_output(HERMES, cfg, ok).tool_calls] == ["get_time"]


def test_whole_output_parse(auto: ToolConfig) -> None:
    parsed = parse_output(HERMES, auto, CASES["hermes-text-before"].text, new_id=counter_ids())
    assert parsed.content == "Let me check that."
    assert msgspec.json.encode(parsed.tool_calls) == (
        b'[{"id":"call_0","type":"function","function":'
        b'{"name":"get_weather","arguments":"{\\"city\\":\\"Paris\\"}"}}]'
    )
    assert parse_output(HERMES, auto, CASES["hermes-call"].text).content is None
    assert parse_output(HERMES, auto, "").content == ""


def test_arguments_keep_the_models_tokens(auto: ToolConfig) -> None:
    args = '{"city": "caf\\u00e9", "n": 1.50, "big": 123456789012345678901234567890}'
    text = f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>'
    (call,) = parse_output(HERMES, auto, text).tool_calls
    assert call.function.arguments == '{"city":"caf\\u00e9","n":1.50,"big":123456789012345678901234567890}'
    assert json.loads(call.function.arguments)["city"] == "café"


def test_finish_is_idempotent_and_final(auto: ToolConfig) -> None:
    p = ToolCallParser(HERMES, auto)
    p.feed("abc ")
    assert p.finish().events == [ContentDelta(" ")]
    assert p.finish().events == []
    with pytest.raises(RuntimeError):
        p.feed("more")


@pytest.mark.parametrize(
    ("engine", "made", "expected"),
    [
        ("stop", True, "tool_calls"),
        ("stop", False, "stop"),
        ("length", True, "length"),
        ("length", False, "length"),
    ],
)
def test_finish_reason(engine: str, made: bool, expected: str) -> None:
    assert finish_reason(engine, made) == expected


# ---------------------------------------------------------------- the openai SDK's view


def _chunk(delta: dict[str, Any], finish: str | None = None) -> Any:
    from openai.types.chat import ChatCompletionChunk

    return ChatCompletionChunk.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
    )


def sdk_message(events: list[StreamEvent], made: bool) -> Any:
    """The message the openai SDK's stream accumulator builds from chunks made of
    these events, as the stream would send them (one event per chunk)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    state.handle_chunk(_chunk({"role": "assistant", "content": None}))
    for e in events:
        if isinstance(e, ContentDelta):
            state.handle_chunk(_chunk({"content": e.text}))
        else:
            state.handle_chunk(_chunk({"tool_calls": [msgspec.to_builtins(e)]}))
    state.handle_chunk(_chunk({}, finish_reason("stop", made)))
    completion = state.get_final_completion()
    assert completion.choices[0].finish_reason == ("tool_calls" if made else "stop")
    return completion.choices[0].message


@pytest.mark.parametrize("name", [*CASES, *RAW])
def test_sdk_reassembly_equals_whole_output_parse(name: str, auto: ToolConfig) -> None:
    fmt, text = (CASES[name].fmt, CASES[name].text) if name in CASES else RAW[name]
    parsed = parse_output(fmt, auto, text, new_id=counter_ids())
    for chunks in splits(text):
        events, made = stream(fmt, auto, chunks)
        message = sdk_message(events, made)
        assert (message.content or None) == (parsed.content or None)
        got = [(t.id, t.type, t.function.name, t.function.arguments) for t in message.tool_calls or []]
        assert got == [(c.id, c.type, c.function.name, c.function.arguments) for c in parsed.tool_calls]


# ---------------------------------------------------------------- a cut call is still a call


def stream_cut(fmt: ToolCallFormat, cfg: ToolConfig, chunks: list[str]) -> tuple[list[StreamEvent], bool]:
    parser = ToolCallParser(fmt, cfg, new_id=counter_ids())
    events: list[StreamEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    end = parser.finish(cut=True)
    return events + end.events, end.tool_calls_made


HERMES_CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
CUT_CASES = [
    # (format, output cut by max_tokens, content, calls as (name, arguments text))
    (HERMES, HERMES_CUT, "", [("get_weather", '{"city":"Par')]),
    (HERMES, "Sure.\n" + HERMES_CUT, "Sure.", [("get_weather", '{"city":"Par')]),
    (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}',
        "",
        [("get_weather", '{"city":"Paris"}')],
    ),
    (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool',
        "",
        [("get_weather", '{"city":"Paris"}')],
    ),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arg', "", [("get_weather", "")]),
    (
        HARMONY,
        '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Par',
        "",
        [("get_weather", '{"city":"Par')],
    ),
    (HARMONY, "Ok.<|channel|>commentary to=functions.get_wea", "Ok.", []),
    (HERMES, '<tool_call>\n{"name": "get_wea', "", []),  # no name yet: dropped, no marker in content
    (HERMES, "It is <tool_c", "It is ", []),  # a marker's start is held back, then dropped
    (
        HERMES,
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n' + HERMES_CUT,
        "",
        [("get_time", "{}"), ("get_weather", '{"city":"Par')],
    ),
    (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "New Yo',
        "",
        [("get_weather", '{"city":"New Yo')],
    ),
    (LLAMA3_JSON, '{"answer": "New Yo', '{"answer": "New Yo', []),  # a JSON answer stays content
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci',
        "",
        [("get_time", "{}"), ("get_weather", '{"ci')],
    ),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "", [("get_weather", '{"city":"Pa')]),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CUT_CASES)
def test_a_cut_call_is_still_a_call(
    fmt: ToolCallFormat, text: str, content: str, calls: list[tuple[str, str]], auto: ToolConfig
) -> None:
    whole = parse_output(fmt, auto, text, cut=True)
    assert (whole.content or "", [(c.function.name, c.function.arguments) for c in whole.tool_calls]) == (
        content,
        calls,
    )
    for chunks in splits(text):
        events, made = stream_cut(fmt, auto, chunks)
        got = assemble(events)
        assert (got.content, [(n, a) for _, n, a in got.calls]) == (content, calls), chunks
        assert made == bool(calls)
        for marker in fmt.markers:
            assert marker not in got.content


def test_an_uncut_open_block_before_its_arguments_stays_content(auto: ToolConfig) -> None:
    # The model stopped by itself inside a block that never streamed: its text verbatim.
    text = '<tool_call>\n{"name": "get_weather", "argu'
    assert parse_output(HERMES, auto, text).content == text


def test_a_primer_must_open_a_call() -> None:
    cfg = config({"type": "function", "function": {"name": "get_weather"}})
    with pytest.raises(ValueError, match="does not open a call"):
        ToolCallParser(HERMES, cfg, primer="Sure: ")
    # Primed and fed in any split: the same call as the whole output.
    primer = '<tool_call>\n{"name": "get_weather", "arguments": '
    rest = '{"city": "Oslo"}}\n</tool_call>'
    for k in range(len(rest) + 1):
        parser = ToolCallParser(HERMES, cfg, primer=primer, new_id=lambda: "call_1")
        events = parser.feed(rest[:k]) + parser.feed(rest[k:]) + parser.finish().events
        assert not [e for e in events if isinstance(e, ContentDelta)]
        assert [(c.function.name, c.function.arguments) for c in parser.tool_calls] == [
            ("get_weather", '{"city":"Oslo"}')
        ]
