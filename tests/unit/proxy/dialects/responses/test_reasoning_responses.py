"""The Responses API with a reasoning model, read by the official ``openai`` SDK: a
``reasoning`` item with a ``reasoning_text`` part before the message, the
``response.reasoning_text.*`` events, ``output_tokens_details.reasoning_tokens``,
``reasoning.effort`` and reasoning items sent back."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from protocol import Submit
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.dialects.reasoning_script import thinking_script


def sdk(client: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)


async def test_stream_events_with_the_sdk(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = thinking_script()
    client = await make_client()
    async with sdk(client) as api, api.responses.stream(model="m", input="Why?") as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    types = [e.type for e in events]
    first = types.index("response.output_item.added")
    assert types[first : first + 3] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(d.delta for d in deltas) == "Let me think."
    assert {(d.output_index, d.content_index) for d in deltas} == {(0, 0)}
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == "Let me think." and done.item_id == deltas[0].item_id
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(seq)))
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(t.delta for t in text) == "Yes." and {t.output_index for t in text} == {1}
    assert [item.type for item in final.output] == ["reasoning", "message"]
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text == "Let me think."
    assert final.output_text == "Yes."
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 4


async def test_non_stream_body(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = thinking_script()
    client = await make_client()
    async with sdk(client) as api:
        r = await api.responses.create(model="m", input="Why?", reasoning={"effort": "low"})
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output_text == "Yes."
    assert r.reasoning is not None and r.reasoning.effort == "low"
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == 4


async def test_effort_and_reasoning_items_reach_the_worker(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    seen: list[Submit] = []
    fake.script = thinking_script(seen=seen)
    client = await make_client()
    history = [
        {"role": "user", "content": "Why?"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Hm."}],
        },
        {"role": "assistant", "content": [{"type": "output_text", "text": "Yes."}]},
        {"role": "user", "content": "Sure?"},
    ]
    r = await client.post("/v1/responses", json={"input": history, "reasoning": {"effort": "none"}})
    assert r.status == 200, await r.text()
    submit = seen[0]
    assert submit.params.reasoning_budget == 0
    assert [(m.role, m.content, m.reasoning) for m in submit.messages] == [
        ("user", "Why?", None),
        ("assistant", "Yes.", "Hm."),
        ("user", "Sure?", None),
    ]
