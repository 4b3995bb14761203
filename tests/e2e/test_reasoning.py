"""A reasoning parser on the embedded model: ``serve -- --reasoning-parser deepseek_r1``.

SmolLM2 never writes ``</think>`` (it is not one of its tokens: the parser by
name matches the ids ``</think>`` encodes to), and the deepseek_r1 family starts
inside the span, so everything it writes is thinking; a budget makes the worker
write the end marker, after which the model answers as content; no thinking
closes the span in the prompt."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow

PORT = int(os.environ.get("EXL3_E2E_REASONING_PORT", "0")) or None


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("serve-r1"), "--", "--reasoning-parser", "deepseek_r1", port=PORT
    )
    yield s
    stop_server(s)


POEM = "Write a long poem about the sea."


def chat(server: Server, prompt: str = "What is the capital of France?", **extra: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 16,
        **extra,
    }
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def marker_tokens(server: Server) -> int:
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": "</think>"}, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def test_everything_it_writes_is_reasoning(reasoning_server: Server) -> None:
    body = chat(reasoning_server)
    message, usage = body["choices"][0]["message"], body["usage"]
    assert message["content"] == ""
    assert message["reasoning_content"]
    # Every completion token but the end-of-turn token that stopped it (no text, no channel).
    stopped = body["choices"][0]["finish_reason"] == "stop"
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] - stopped


def test_a_budget_of_six_thinks_six_tokens_then_answers(reasoning_server: Server) -> None:
    body = chat(reasoning_server, POEM, thinking_budget_tokens=6, max_tokens=24)
    message, usage = body["choices"][0]["message"], body["usage"]
    assert message["reasoning_content"] and message["content"]
    reasoning = usage["completion_tokens_details"]["reasoning_tokens"]
    assert reasoning == 6 + marker_tokens(reasoning_server)  # six thinking tokens and the forced marker
    assert "think>" not in message["content"] + message["reasoning_content"]
    # The same with streaming: thinking deltas first, then content, never both in one.
    with httpx.stream(
        "POST",
        reasoning_server.base_url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": POEM}],
            "temperature": 0,
            "max_tokens": 24,
            "thinking_budget_tokens": 6,
            "stream": True,
        },
        timeout=120,
    ) as r:
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in r.iter_lines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]
        ]
    thinking = "".join(d.get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    assert (thinking, answer) == (message["reasoning_content"], message["content"])
    assert not any(d.get("reasoning_content") and d.get("content") for d in deltas)


def test_reasoning_effort_none_answers_without_thinking(reasoning_server: Server) -> None:
    body = chat(reasoning_server, reasoning_effort="none")
    message, usage = body["choices"][0]["message"], body["usage"]
    assert message["content"] and "reasoning_content" not in message
    assert "reasoning_tokens" not in usage.get("completion_tokens_details", {})
