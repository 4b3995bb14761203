"""GPT-OSS's Harmony calls through the proxy in every dialect: the worker's Harmony
splitter sends a call message's frame and arguments as content (thinking apart), the
``harmony`` format (detected from the template) reads it, and each dialect encodes the
one parsed call in its own shape: chat ``tool_calls``, a Responses ``function_call``
item, an Anthropic ``tool_use`` block."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from protocol.messages import FinishReason
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.dialects.reasoning_script import thinking_script

# What openai/gpt-oss's template writes for a history call (the detection reads it).
GPT_OSS = (
    "{%- for m in messages %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endfor %}"
    "{%- if tools %}{{- '<|start|>assistant to=functions.x<|channel|>commentary json<|message|>{}<|call|>' }}"
    "{%- endif %}{{- '<|start|>assistant' }}"
)
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# Thinking, then the call frame as the splitter lets it through, cut where tokens would cut it.
FRAME = [
    "<|start|>assistant<|channel|>",
    "commentary to=functions.get",
    "_weather <|constrain|>json<|message|>",
    '{"city": ',
    '"Paris"}',
]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
        },
    ),
    "responses": (
        "/v1/responses",
        {
            "input": "Weather in Paris?",
            "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
        },
    ),
    "messages": (
        "/v1/messages",
        {
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather", "input_schema": PARAMS}],
        },
    ),
}


def calls_of(dialect: str, body: dict[str, Any]) -> tuple[list[tuple[str, Any]], str | None, str | None]:
    """(calls as (name, arguments), the thinking, the answer text) in ``dialect``'s shape."""
    if dialect == "chat":
        message = body["choices"][0]["message"]
        assert body["choices"][0]["finish_reason"] == "tool_calls"
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
        ]
        return calls, message.get("reasoning_content"), message["content"]
    if dialect == "responses":
        items = body["output"]
        calls = [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
        thinking = "".join(
            s["text"] for i in items if i["type"] == "reasoning" for s in i.get("content") or ()
        )
        text = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"]) or None
        return calls, thinking or None, text
    blocks = body["content"]
    assert body["stop_reason"] == "tool_use"
    calls = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    text = "".join(b["text"] for b in blocks if b["type"] == "text") or None
    return calls, thinking or None, text


@pytest.mark.parametrize("dialect", CASES)
async def test_a_harmony_call_is_a_tool_call_in_every_dialect(
    make_client: MakeClient, fake: FakeEngineClient, dialect: str
) -> None:
    assert fake.worker_ready is not None
    fake.worker_ready = msgspec.structs.replace(fake.worker_ready, chat_template=GPT_OSS)
    fake.script = thinking_script(["Need ", "weather."], FRAME, finish=FinishReason.STOP)
    client = await make_client()
    path, body = CASES[dialect]
    resp = await client.post(path, json={"model": "m", **body}, headers={"anthropic-version": "2023-06-01"})
    assert resp.status == 200, await resp.text()
    # The template renders the tools itself (native): they went as tools_json.
    assert fake.submits[0].tools_json is not None
    calls, thinking, text = calls_of(dialect, await resp.json())
    assert calls == [("get_weather", {"city": "Paris"})]
    assert thinking == "Need weather."
    assert text is None  # no frame text leaks into the answer


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
async def test_a_call_harmony_has_no_grammar_for_is_refused_by_name(
    make_client: MakeClient, fake: FakeEngineClient, extra: dict[str, Any], param: str
) -> None:
    """A forced call, or tools with a JSON output, would need a grammar of Harmony's
    frames (the name is in the header, not the JSON): a 400, not an unconstrained answer."""
    assert fake.worker_ready is not None
    fake.worker_ready = msgspec.structs.replace(fake.worker_ready, chat_template=GPT_OSS)
    client = await make_client()
    path, body = CASES["chat"]
    resp = await client.post(path, json={"model": "m", **body, **extra})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param and "harmony" in error["message"]
    assert fake.submits == []
