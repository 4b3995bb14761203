"""Tool calls through the proxy: the tools reach the model as a system prompt
(the fake's template has none), a forced choice becomes a grammar, and the
model's ``<tool_call>`` output comes back in OpenAI's shapes, read with the
official ``openai`` SDK (its own stream accumulator reassembles the deltas)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import orjson
import pytest
from openai import AsyncOpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from protocol import Submit
from protocol.messages import FinishReason
from tests.fakes.engine_client import FakeEngineClient, Step, completion_events
from tests.unit.proxy.conftest import MakeClient

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES: Any = [{"role": "user", "content": "Weather in Paris and Rome?"}]
# The model's text, split where a marker would be split by tokens.
PIECES = [
    "Let me check.",
    "<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n</tool_call>',
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
]


def script(submit: Submit) -> list[Step]:
    return list(completion_events(submit.request_id, PIECES))


def sdk(client: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)


async def test_auto_calls_non_stream_and_stream(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = script
    client = await make_client()
    async with sdk(client) as api:
        r = await api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER])
        stream = await api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER], stream=True)
        state = ChatCompletionStreamState()
        async for chunk in stream:
            state.handle_chunk(chunk)
        streamed = state.get_final_completion()
    # The tools reached the model in its system prompt (the fallback rendering).
    system = fake.submits[0].messages[0]
    assert system.role == "system" and "get_weather" in system.content and "<tool_call>" in system.content
    assert fake.submits[0].params.grammar is None  # auto: free text, parsed
    for choice in (r.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me check."
        calls = choice.message.tool_calls
        assert calls is not None and [c.function.name for c in calls] == ["get_weather", "get_weather"]
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
        assert len({c.id for c in calls}) == 2


async def test_required_choice_is_a_grammar_and_history_is_rendered(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = script
    client = await make_client()
    history: Any = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = {"model": "m", "messages": history, "tools": [WEATHER], "tool_choice": "required"}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    params = fake.submits[0].params
    assert params.grammar is not None and params.grammar_param == "tool_choice"
    assert "get_weather" in params.grammar
    rendered = [(m.role, m.content) for m in fake.submits[0].messages]
    assert any("<tool_call>" in c for r, c in rendered if r == "assistant")
    assert any("sunny, 21 C" in c and "<tool_response>" in c for _, c in rendered)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "logprobs": True}, "logprobs"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
async def test_bad_tool_requests_are_400_naming_the_field(
    make_client: MakeClient, extra: dict[str, Any], param: str
) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES, **extra})
    assert resp.status == 400
    assert orjson.loads(await resp.read())["error"]["param"] == param


async def test_a_template_that_renders_tools_gets_them_structured(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    # A Qwen-style template: it renders `tools` and writes <tool_call> blocks.
    template = "{% if tools %}# Tools{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>{% endif %}"
    assert fake.worker_ready is not None
    fake.worker_ready = msgspec.structs.replace(fake.worker_ready, chat_template=template)
    fake.script = script
    client = await make_client()
    history: Any = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    resp = await client.post(
        "/v1/chat/completions", json={"model": "m", "messages": history, "tools": [WEATHER]}
    )
    assert resp.status == 200
    submit = fake.submits[0]
    assert submit.tools_json is not None
    assert orjson.loads(submit.tools_json) == [WEATHER]
    roles = [m.role for m in submit.messages]
    assert roles == ["user", "assistant", "tool"]  # no generic tools prompt
    calls = orjson.loads(submit.messages[1].tool_calls_json or "null")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert (submit.messages[2].tool_call_id, submit.messages[2].content) == ("c1", "rain")
    body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("extra", "repeats"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, False),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "parallel_tool_calls": True,
            },
            False,
        ),
        ({"tool_choice": "required"}, False),
        ({"tool_choice": "required", "parallel_tool_calls": True}, True),
    ],
)
async def test_a_forced_answer_is_one_call_unless_several_were_asked_for(
    make_client: MakeClient, fake: FakeEngineClient, extra: dict[str, Any], repeats: bool
) -> None:
    fake.script = script
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "tools": [WEATHER], **extra}
    )
    assert resp.status == 200
    grammar = fake.submits[0].params.grammar
    assert grammar is not None
    # The grammar's start rule repeats "call" only when several calls may come.
    start = next(line for line in grammar.splitlines() if line.startswith("start:"))
    assert ("call)*" in start) is repeats


async def test_stop_strings_are_refused_with_a_forced_call(make_client: MakeClient) -> None:
    client = await make_client()
    body = {"model": "m", "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required", "stop": ["\n"]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    assert orjson.loads(await resp.read())["error"]["param"] == "stop"


# A forced call cut by max_tokens, split where tokens would split it.
CUT = ["<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": "Par']


async def test_a_cut_call_is_still_a_call_streamed_and_not(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = lambda s: list(completion_events(s.request_id, CUT, finish_reason=FinishReason.LENGTH))
    client = await make_client()
    body: Any = {
        "model": "m",
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 3,
    }
    async with sdk(client) as api:
        r = await api.chat.completions.create(**body)
        stream = await api.chat.completions.create(**body, stream=True)
        state = ChatCompletionStreamState()
        contents: list[str] = []
        async for chunk in stream:
            state.handle_chunk(chunk)
            contents += [c.delta.content for c in chunk.choices if c.delta.content]
        streamed = state.current_completion_snapshot  # get_final_completion raises on length
    for choice in (r.choices[0], streamed.choices[0]):
        assert choice.finish_reason == "length"
        assert not choice.message.content  # no "<tool_call>" in content
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather"
        assert call.function.arguments == '{"city":"Par'
    assert contents == []


ANSWER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


async def test_tools_with_response_format_a_call_or_the_json(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    answer = ['{"city": ', '"Paris"}']
    fake.script = lambda s: list(completion_events(s.request_id, answer))
    client = await make_client()
    body: Any = {"model": "m", "messages": MESSAGES, "tools": [WEATHER], "response_format": RESPONSE_FORMAT}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    out = orjson.loads(await resp.read())
    assert out["choices"][0]["message"]["content"] == '{"city": "Paris"}'
    assert out["choices"][0]["finish_reason"] == "stop" and not out["choices"][0]["message"].get("tool_calls")
    params = fake.submits[0].params
    assert params.grammar is not None and params.grammar_param == "tools"
    lines = params.grammar.splitlines()
    assert lines[0].endswith(" | answer") and "// response_format.json_schema" in lines
    # With a forced call the answer is the call alone.
    await client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    forced = fake.submits[1].params.grammar
    assert forced is not None and "answer" not in forced and forced.startswith("start: call")
