"""Anthropic Messages with a reasoning model, read by the official ``anthropic``
SDK: a ``thinking`` block first (``thinking_delta``, then a non-empty
``signature_delta`` before its ``content_block_stop``),
``usage.output_tokens_details.thinking_tokens``, ``thinking`` honoured and
thinking blocks sent back."""

from __future__ import annotations

from typing import Any

from anthropic import AsyncAnthropic

from protocol import Submit
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.dialects.reasoning_script import thinking_script

MESSAGES: Any = [{"role": "user", "content": "Why?"}]


def sdk(client: Any) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=str(client.make_url("")), api_key="x", max_retries=0)


async def test_stream_with_the_sdk(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = thinking_script()
    client = await make_client()
    async with (
        sdk(client) as api,
        api.messages.stream(
            model="m",
            max_tokens=64,
            messages=MESSAGES,
            thinking={"type": "enabled", "budget_tokens": 1024},
        ) as stream,
    ):
        events = [e async for e in stream]
        final = await stream.get_final_message()
    raw = [
        e for e in events if e.type in ("content_block_start", "content_block_delta", "content_block_stop")
    ]
    kinds = [
        e.content_block.type
        if e.type == "content_block_start"
        else (e.delta.type if e.type == "content_block_delta" else "stop")
        for e in raw
    ]
    assert kinds[:5] == ["thinking", "thinking_delta", "thinking_delta", "signature_delta", "stop"]
    assert kinds[5:] == ["text", "text_delta", "text_delta", "stop"]
    assert [b.type for b in final.content] == ["thinking", "text"]
    thinking, text = final.content
    assert thinking.type == "thinking" and thinking.thinking == "Let me think." and thinking.signature
    assert text.type == "text" and text.text == "Yes."
    details = final.usage.output_tokens_details
    assert details is not None and details.thinking_tokens == 4


async def test_non_stream_and_omitted_display(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = thinking_script()
    client = await make_client()
    async with sdk(client) as api:
        m = await api.messages.create(model="m", max_tokens=64, messages=MESSAGES)
        hidden = await api.messages.create(
            model="m",
            max_tokens=64,
            messages=MESSAGES,
            thinking={"type": "adaptive", "display": "omitted"},
        )
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].type == "thinking" and m.content[0].thinking == "Let me think."
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""
    assert hidden.content[0].signature


async def test_thinking_switches_and_blocks_reach_the_worker(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    seen: list[Submit] = []
    fake.script = thinking_script(seen=seen)
    client = await make_client()
    history = [
        {"role": "user", "content": "Why?"},
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "Hm.", "signature": "sig"},
                {"type": "text", "text": "Yes."},
            ],
        },
        {"role": "user", "content": "Sure?"},
    ]
    for thinking in (
        {"type": "enabled", "budget_tokens": 2048},
        {"type": "disabled"},
        {"type": "adaptive"},
    ):
        r = await client.post(
            "/v1/messages", json={"max_tokens": 64, "messages": history, "thinking": thinking}
        )
        assert r.status == 200, await r.text()
    assert [s.params.reasoning_budget for s in seen] == [2048, 0, None]
    turn = seen[0].messages[1]
    assert (turn.role, turn.content, turn.reasoning) == ("assistant", "Yes.", "Hm.")
    r = await client.post(
        "/v1/messages", json={"max_tokens": 64, "messages": MESSAGES, "thinking": {"type": "enabled"}}
    )
    assert r.status == 400
    body = await r.json()
    assert body["type"] == "error" and "budget_tokens" in body["error"]["message"]
