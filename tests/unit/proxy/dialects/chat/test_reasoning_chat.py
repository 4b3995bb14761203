"""Chat completions with a reasoning model: ``reasoning_content`` apart from the
answer (message and deltas), ``completion_tokens_details.reasoning_tokens``, and
the thinking switches of the request reaching the worker."""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from protocol import FinishReason, Submit
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.dialects.reasoning_script import thinking_script

MESSAGES = [{"role": "user", "content": "Why?"}]


def sdk(client: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)


async def test_non_stream_message_carries_reasoning_content(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = thinking_script()
    client = await make_client()
    async with sdk(client) as api:
        r = await api.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
    message = r.choices[0].message
    assert message.content == "Yes."
    assert (message.model_extra or {})["reasoning_content"] == "Let me think."
    assert r.usage is not None and r.usage.completion_tokens == 6
    assert r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 4


async def test_stream_deltas_keep_thinking_and_answer_apart(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = thinking_script()
    client = await make_client()
    async with sdk(client) as api:
        stream = await api.chat.completions.create(
            model="m",
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking = [(d.model_extra or {}).get("reasoning_content") for d in deltas]
    content = [d.content for d in deltas]
    assert "".join(t for t in thinking if t) == "Let me think."
    assert "".join(c for c in content if c) == "Yes."
    for t, c in zip(thinking, content, strict=True):
        assert not (t and c)  # never both in one delta
    assert deltas[0].role == "assistant" and thinking[0] == "Let me"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 4


async def test_vllm_field_name(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = thinking_script()
    client = await make_client(reasoning_field="reasoning")
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    body = await r.json()
    assert body["choices"][0]["message"]["reasoning"] == "Let me think."
    assert "reasoning_content" not in body["choices"][0]["message"]
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    text = await r.text()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("reasoning", "") for e in events if e["choices"]) == (
        "Let me think."
    )


async def _names(client: Any, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The message of ``body`` sent without and with ``stream``: the message, and each
    reasoning field's streamed text."""
    message = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    text = await (await client.post("/v1/chat/completions", json={**body, "stream": True})).text()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    streamed = {name: "".join(d.get(name, "") for d in deltas) for name in ("reasoning", "reasoning_content")}
    return message, streamed


async def test_both_names_carry_the_same_thinking(make_client: MakeClient, fake: FakeEngineClient) -> None:
    """``--reasoning-field both``: vLLM's and llama.cpp's clients each find their field."""
    fake.script = thinking_script()
    client = await make_client(reasoning_field="both")
    message, streamed = await _names(client, {"messages": MESSAGES})
    assert message["reasoning"] == message["reasoning_content"] == "Let me think."
    assert message["content"] == "Yes."
    assert streamed == {"reasoning": "Let me think.", "reasoning_content": "Let me think."}


async def test_llama_cpp_reasoning_format_names_the_field_reasoning_content(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = thinking_script()
    client = await make_client(reasoning_field="reasoning")
    for fmt in ("auto", "deepseek"):
        message, streamed = await _names(client, {"messages": MESSAGES, "reasoning_format": fmt})
        assert message["reasoning_content"] == "Let me think." and "reasoning" not in message
        assert streamed == {"reasoning": "", "reasoning_content": "Let me think."}
    message, _ = await _names(client, {"messages": MESSAGES})
    assert message["reasoning"] == "Let me think."  # the server's choice without the field


async def test_reasoning_formats_that_mix_thinking_into_content_are_refused(make_client: MakeClient) -> None:
    client = await make_client()
    for fmt in ("none", "deepseek-legacy", "bogus"):
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "reasoning_format": fmt})
        assert r.status == 400 and (await r.json())["error"]["param"] == "reasoning_format", fmt


async def test_cut_inside_the_span(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = thinking_script(answer=[], marker_tokens=0, finish=FinishReason.LENGTH)
    client = await make_client()
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    choice = (await r.json())["choices"][0]
    assert choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == "Let me think."
    assert choice["finish_reason"] == "length"


async def test_no_thinking_no_field(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    body = await (await client.post("/v1/chat/completions", json={"messages": MESSAGES})).json()
    assert "reasoning_content" not in body["choices"][0]["message"]
    assert "reasoning_tokens" not in body["usage"].get("completion_tokens_details", {})


async def test_switches_reach_the_worker(make_client: MakeClient, fake: FakeEngineClient) -> None:
    seen: list[Submit] = []
    fake.script = thinking_script(seen=seen)
    client = await make_client()
    for extra in (
        {"thinking_budget_tokens": 6},
        {"thinking_token_budget": 6},
        {"reasoning_effort": "none"},
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": True}},
    ):
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
        assert r.status == 200, await r.text()
    assert [s.params.reasoning_budget for s in seen] == [6, 6, 0, None]
    assert json.loads(seen[3].template_kwargs_json or "") == {
        "enable_thinking": True,
        "reasoning_effort": "high",
    }
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "thinking_budget_tokens": 6, "thinking_token_budget": 7},
    )
    assert r.status == 400 and (await r.json())["error"]["param"] == "thinking_token_budget"


async def test_reasoning_sent_back_reaches_the_worker_apart(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    seen: list[Submit] = []
    fake.script = thinking_script(seen=seen)
    client = await make_client()
    history = [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "Let me think."},
        {"role": "user", "content": "Sure?"},
    ]
    r = await client.post("/v1/chat/completions", json={"messages": history})
    assert r.status == 200
    turn = seen[0].messages[1]
    assert (turn.content, turn.reasoning) == ("Yes.", "Let me think.")


async def test_metrics_log_and_status_count_the_thinking(
    make_client: MakeClient, fake: FakeEngineClient, caplog: Any
) -> None:
    import asyncio
    import logging

    from protocol import Channel, Finished, PrefillProgress, Started, TokenDelta
    from proxy.ops.request_log import FIELDS
    from tests.fakes.engine_client import Gate, Step

    release = asyncio.Event()

    def held(submit: Submit) -> list[Step]:
        rid = submit.request_id
        return [
            Started(rid, 5, 0),
            PrefillProgress(rid, 5, 0, 5, 1),
            TokenDelta(rid, "Hm", 2, channel=Channel.REASONING),
            Gate(release),
            TokenDelta(rid, "Yes", 1),
            Finished(rid, FinishReason.STOP, 5, 0, 4, reasoning_tokens=3),
        ]

    fake.script = held
    client = await make_client()
    caplog.set_level(logging.INFO, logger="proxy.requests")
    task = asyncio.create_task(client.post("/v1/chat/completions", json={"messages": MESSAGES}))
    for _ in range(200):  # bounded: the request reaches its gate within a few loop turns
        status = await (await client.get("/v1/status")).json()
        if status["requests"] and status["requests"][0]["stage"] == "decode":
            break
        await asyncio.sleep(0.01)
    (req,) = status["requests"]
    assert (req["phase"], req["reasoning_tokens"]) == ("thinking", 2)
    release.set()
    r = await task
    assert (await r.json())["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    metrics = await (await client.get("/metrics")).text()
    assert "exl3_sidecar_reasoning_tokens_total 3.0" in metrics
    (record,) = [r for r in caplog.records if r.name == "proxy.requests" and "chat" in r.getMessage()]
    assert getattr(record, FIELDS)["reasoning_tokens"] == 3


async def test_template_kwargs_may_not_set_the_templates_own_arguments(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    body = {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 400 and (await r.json())["error"]["param"] == "chat_template_kwargs"
