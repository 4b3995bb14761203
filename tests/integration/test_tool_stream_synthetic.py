"""A tool call's arguments streamed end to end, through the real proxy and a real
synthetic worker, in every chat-shaped dialect.

The synthetic engine writes the prompt's words back (``engine_worker.synthetic``):
the prompt starts with ``system:`` and the system message, so a system message
holding a Hermes call makes the engine write that call, one word a step, then the
generic tools prompt the proxy appended (the synthetic worker has no chat
template). The call's ``content`` argument is seven words: it must reach the
client in pieces, one per step, before the call's end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from httpx_sse import aconnect_sse

from tests.integration.synthetic import served_proxy, synthetic_worker

ARGUMENTS = {"path": "a.py", "content": "one two three four five six seven"}
CALL = '<tool_call> {"name": "write_file", "arguments": ' + json.dumps(ARGUMENTS) + "} </tool_call>"
WORDS = len(CALL.split())
PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"],
}


@pytest.fixture
async def base_url(tmp_path: Path) -> AsyncIterator[str]:
    with synthetic_worker(tmp_path, "--synthetic-step-ms", "2") as addrs:
        async with served_proxy(addrs) as url:
            yield url


async def _events(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    async with aconnect_sse(client, "POST", url, json={**body, "stream": True}) as source:
        assert source.response.status_code == 200, await source.response.aread()
        async for ev in source.aiter_sse():
            if ev.data != "[DONE]":
                out.append((ev.event, orjson.loads(ev.data)))
    return out


def _chat() -> tuple[str, dict[str, Any]]:
    tool = {"type": "function", "function": {"name": "write_file", "parameters": PARAMETERS}}
    messages = [{"role": "system", "content": CALL}, {"role": "user", "content": "go"}]
    body = {"model": "m", "max_tokens": WORDS + 3, "messages": messages, "tools": [tool]}
    return "/v1/chat/completions", body


def _chat_fragments(events: list[tuple[str, Any]]) -> tuple[list[str], str]:
    fragments: list[str] = []
    content = ""
    for _, chunk in events:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if "name" not in call["function"]:
                    fragments.append(call["function"]["arguments"])
    return fragments, content


def _responses() -> tuple[str, dict[str, Any]]:
    tool = {"type": "function", "name": "write_file", "parameters": PARAMETERS}
    body = {"model": "m", "max_output_tokens": WORDS + 3, "instructions": CALL, "input": "go"}
    body["tools"] = [tool]
    return "/v1/responses", body


def _responses_fragments(events: list[tuple[str, Any]]) -> tuple[list[str], str]:
    fragments = [e["delta"] for name, e in events if name == "response.function_call_arguments.delta"]
    content = "".join(e["delta"] for name, e in events if name == "response.output_text.delta")
    return fragments, content


def _messages() -> tuple[str, dict[str, Any]]:
    tool = {"name": "write_file", "input_schema": PARAMETERS}
    body = {
        "model": "m",
        "max_tokens": WORDS + 3,
        "system": CALL,
        "messages": [{"role": "user", "content": "go"}],
        "tools": [tool],
    }
    return "/v1/messages", body


def _messages_fragments(events: list[tuple[str, Any]]) -> tuple[list[str], str]:
    fragments: list[str] = []
    content = ""
    for name, e in events:
        if name == "content_block_delta":
            if e["delta"]["type"] == "input_json_delta":
                fragments.append(e["delta"]["partial_json"])
            elif e["delta"]["type"] == "text_delta":
                content += e["delta"]["text"]
    return fragments, content


DIALECTS = {
    "chat": (_chat, _chat_fragments),
    "responses": (_responses, _responses_fragments),
    "messages": (_messages, _messages_fragments),
}


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_arguments_arrive_a_word_at_a_time(base_url: str, dialect: str) -> None:
    request, fragments_of = DIALECTS[dialect]
    path, body = request()
    async with httpx.AsyncClient(timeout=30) as client:
        events = await _events(client, base_url + path, body)
    fragments, content = fragments_of(events)
    assert json.loads("".join(fragments)) == ARGUMENTS
    # One fragment per word of the call's arguments as the engine wrote it, at
    # least one per word of the streamed string.
    assert len(fragments) >= len(ARGUMENTS["content"].split())
    assert any(f.endswith("one ") or f == "one " for f in fragments), fragments
    # The text around the call is content: the role word before it, the tools prompt after.
    assert content.startswith("system:") and "Tools" in content
