"""A named ``tool_choice``: the server writes the call's opening and name
(``Submit.forced_prefix``), the grammar covers only the arguments and the
close, and the output (arguments only) comes back as that call in every
dialect, also when ``max_tokens`` cut it (``finish_reason: length``, the
arguments as far as written). The fake worker plays what a model writes after
the prefix."""

from __future__ import annotations

from typing import Any

import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from protocol.messages import FinishReason, PromptPiece, Submit
from tests.fakes.engine_client import FakeEngineClient, Step, completion_events
from tests.unit.proxy.conftest import MakeClient

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS},
}
TIME = {"type": "function", "function": {"name": "get_time"}}
MESSAGES: Any = [{"role": "user", "content": "Weather in Paris?"}]
PREFIX = (
    PromptPiece("<tool_call>", True),
    PromptPiece("\n"),
    PromptPiece('{"name": "get_weather", "arguments": '),
)
WHOLE = ['{"city": ', '"Paris"}', "}\n</tool", "_call>"]
CUT = ['{"city": ', '"Par']


def playing(texts: list[str], reason: FinishReason) -> Any:
    def script(submit: Submit) -> list[Step]:
        return list(completion_events(submit.request_id, texts, finish_reason=reason))

    return script


def check_submit(fake: FakeEngineClient) -> None:
    submit = fake.submits[-1]
    assert submit.forced_prefix == PREFIX
    grammar = submit.params.grammar
    assert grammar is not None and submit.params.grammar_param == "tool_choice"
    assert grammar.startswith('start: args "}" "\\n" "</tool_call>"\n')
    assert "get_time" not in grammar and '"const"' not in grammar  # the name is not generated


def openai(client: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)


@pytest.mark.parametrize(("texts", "reason"), [(WHOLE, FinishReason.STOP), (CUT, FinishReason.LENGTH)])
async def test_chat(
    make_client: MakeClient, fake: FakeEngineClient, texts: list[str], reason: FinishReason
) -> None:
    fake.script = playing(texts, reason)
    client = await make_client()
    body: Any = {
        "model": "m",
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 6,
        "temperature": 0,
    }
    async with openai(client) as api:
        r = await api.chat.completions.create(**body)
        check_submit(fake)
        stream = await api.chat.completions.create(**body, stream=True)
        state = ChatCompletionStreamState()
        contents: list[str] = []
        async for chunk in stream:
            state.handle_chunk(chunk)
            contents += [c.delta.content for c in chunk.choices if c.delta.content]
        streamed = state.current_completion_snapshot
    check_submit(fake)
    expected = '{"city":"Paris"}' if reason is FinishReason.STOP else '{"city":"Par'
    for choice in (r.choices[0], streamed.choices[0]):
        assert choice.finish_reason == ("tool_calls" if reason is FinishReason.STOP else "length")
        assert not choice.message.content
        (call,) = choice.message.tool_calls or []
        assert (call.function.name, call.function.arguments) == ("get_weather", expected)
    assert contents == []


async def test_responses(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = playing(CUT, FinishReason.LENGTH)
    client = await make_client()
    tool = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMS}
    async with openai(client) as api:
        r = await api.responses.create(
            model="m",
            input="Weather in Paris?",
            tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=6,
        )
    check_submit(fake)
    assert r.status == "incomplete"
    (item,) = [o for o in r.output if o.type == "function_call"]
    assert (item.name, item.arguments) == ("get_weather", '{"city":"Par')


@pytest.mark.parametrize(("texts", "reason"), [(WHOLE, FinishReason.STOP), (CUT, FinishReason.LENGTH)])
async def test_messages(
    make_client: MakeClient, fake: FakeEngineClient, texts: list[str], reason: FinishReason
) -> None:
    fake.script = playing(texts, reason)
    client = await make_client()
    tool = {"name": "get_weather", "description": "Weather", "input_schema": PARAMS}
    async with AsyncAnthropic(base_url=str(client.make_url("")), api_key="x", max_retries=0) as api:
        m = await api.messages.create(
            model="m",
            max_tokens=6,
            messages=MESSAGES,
            tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "tool", "name": "get_weather"},
        )
    check_submit(fake)
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "get_weather"
    if reason is FinishReason.STOP:
        assert m.stop_reason == "tool_use" and block.input == {"city": "Paris"}
    else:
        assert m.stop_reason == "max_tokens"
        assert block.input == {}  # a cut call's input: not JSON yet (messages.frames.tool_input)


async def test_a_continued_turn_gets_no_prefix(make_client: MakeClient, fake: FakeEngineClient) -> None:
    """Without the generation prompt (the client continues a turn of its own)
    the whole call is generated, under the whole call's grammar."""
    fake.script = playing(
        ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'],
        FinishReason.STOP,
    )
    client = await make_client()
    body = {
        "model": "m",
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "add_generation_prompt": False,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    submit = fake.submits[-1]
    assert submit.forced_prefix == ()
    assert submit.params.grammar is not None and submit.params.grammar.startswith("start: call")
    (call,) = (await resp.json())["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}
