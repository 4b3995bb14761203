"""``proxy.grammar.check.validate``: grammars checked by llguidance in child
processes, never on the event loop, bounded in time, memory and concurrency,
refusals naming the request field (issue 20's grammar bombs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from proxy.errors import InvalidRequest, ServiceUnavailable
from proxy.grammar import check as constraints
from proxy.grammar.check import GrammarChecker, grammar_pieces, json_schema_grammar, validate
from proxy.tools.formats import HERMES
from proxy.tools.grammar import tool_call_grammar
from proxy.tools.spec import FunctionTool, ToolConfig
from tests.fakes.engine_client import FakeEngineClient, completion_events
from tests.unit.proxy.conftest import MakeClient


def bomb(n: int) -> dict[str, Any]:
    """Issue 20's schema: llguidance's check of it costs time and memory exponential in ``n``."""
    return {"type": "string", "allOf": [{"pattern": f"^(.*a.*){{{i}}}$"} for i in range(1, n + 1)]}


@pytest.fixture
def checker() -> Iterator[GrammarChecker]:
    c = GrammarChecker(processes=1, timeout_s=0.5, memory_mb=512, max_waiting=0, max_wait_s=1.0)
    yield c
    c.close()


async def test_valid_and_invalid_grammars(checker: GrammarChecker) -> None:
    await validate(json_schema_grammar({"type": "object"}), "response_format", using=checker)
    with pytest.raises(InvalidRequest) as exc:
        await validate(json_schema_grammar({"type": "x"}), "response_format.json_schema", using=checker)
    assert exc.value.param == "response_format.json_schema"
    assert exc.value.message.startswith("'response_format.json_schema' cannot be enforced: ")


async def test_a_tool_whose_schema_fails_is_named(checker: GrammarChecker) -> None:
    tools = (
        FunctionTool(name="ok", parameters={"type": "object"}),
        FunctionTool(name="bad", parameters={"type": "object", "properties": {"a": {"type": "strin"}}}),
    )
    grammar = tool_call_grammar(HERMES, ToolConfig(tools=tools, mode="required"), lenient=False)
    pieces = grammar_pieces(grammar, "tool_choice")
    assert [p for _, p in pieces] == [
        "tools[0].function.parameters",
        "tools[1].function.parameters",
        "tool_choice",
    ]
    with pytest.raises(InvalidRequest) as exc:
        await validate(grammar, "tool_choice", using=checker)
    assert exc.value.param == "tools[1].function.parameters"
    assert "strin" in exc.value.message


async def test_a_bomb_is_refused_at_the_deadline_and_the_loop_keeps_running(checker: GrammarChecker) -> None:
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest) as exc:
        await validate(json_schema_grammar(bomb(40)), "response_format.json_schema", using=checker)
    took = time.monotonic() - t0
    ticker.cancel()
    assert exc.value.param == "response_format.json_schema"
    assert "too complex" in exc.value.message and "0.5 s" in exc.value.message
    assert took >= 0.5
    # The event loop never waited for the check (had it, one gap would span the 0.5 s deadline).
    assert max(gaps) < 0.5
    # The killed child is replaced: the next check works.
    await validate(json_schema_grammar({"type": "integer"}), "response_format", using=checker)


async def test_a_bomb_over_the_memory_cap_is_refused() -> None:
    # A deadline far beyond what the memory cap takes to trip, even on a loaded machine.
    small = GrammarChecker(processes=1, timeout_s=300, memory_mb=150)
    try:
        with pytest.raises(InvalidRequest) as exc:
            # 22 patterns take about 1 GB to check (issue 20)
            await validate(json_schema_grammar(bomb(22)), "response_format.json_schema", using=small)
        assert "needs over 150 MB" in exc.value.message
        await validate(json_schema_grammar({"type": "integer"}), "response_format", using=small)
    finally:
        await asyncio.to_thread(small.close)


async def test_checks_are_bounded_in_number(checker: GrammarChecker) -> None:
    running = asyncio.create_task(validate(json_schema_grammar(bomb(40)), "response_format", using=checker))
    await asyncio.sleep(0.1)
    with pytest.raises(ServiceUnavailable) as exc:
        await validate(json_schema_grammar({"type": "object"}), "response_format", using=checker)
    assert exc.value.status == 503 and exc.value.code == "grammar_checks_busy"
    assert exc.value.headers() == {"Retry-After": "1"}
    with pytest.raises(InvalidRequest):
        await running
    # A check that waited longer than max_wait_s for a checker is refused too.
    waiting = GrammarChecker(processes=1, timeout_s=1.5, max_waiting=1, max_wait_s=0.2)
    try:
        first = asyncio.create_task(validate(json_schema_grammar(bomb(40)), "r", using=waiting))
        await asyncio.sleep(0.1)
        with pytest.raises(ServiceUnavailable):
            await validate(json_schema_grammar({"type": "object"}), "r", using=waiting)
        with pytest.raises(InvalidRequest):
            await first
    finally:
        await asyncio.to_thread(waiting.close)


async def test_http_refuses_a_bomb_naming_the_field(
    make_client: MakeClient, fake: FakeEngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick = GrammarChecker(processes=1, timeout_s=0.5)
    monkeypatch.setattr(constraints, "_checker", quick)
    fake.script = lambda s: list(completion_events(s.request_id, ["{}"]))
    client = await make_client()
    try:
        messages = [{"role": "user", "content": "hi"}]
        for schema, words in ((bomb(40), "too complex"), ({"type": "x"}, "cannot be enforced")):
            rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            resp = await client.post(
                "/v1/chat/completions", json={"messages": messages, "response_format": rf}
            )
            assert resp.status == 400
            error = orjson.loads(await resp.read())["error"]
            assert error["param"] == "response_format.json_schema" and words in error["message"]
        tool = {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"s": bomb(40)}}},
        }
        body = {
            "messages": messages,
            "tools": [{"type": "function", "function": {"name": "g"}}, tool],
            "tool_choice": "required",
        }
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 400
        assert orjson.loads(await resp.read())["error"]["param"] == "tools[1].function.parameters"
        assert fake.submits == []  # nothing reached the engine
        resp = await client.post(
            "/v1/chat/completions", json={"messages": messages, "response_format": {"type": "json_object"}}
        )
        assert resp.status == 200
    finally:
        await asyncio.to_thread(quick.close)


async def test_a_checker_killed_or_stopped_is_a_503_not_the_clients_fault(checker: GrammarChecker) -> None:
    """A valid schema is never a 400 because the checker failed: a child killed
    by someone else mid-check, or one stopped while it holds a check, is
    ``grammar_checker_fault`` with ``Retry-After``; the pool recovers."""
    import os
    import signal

    running = asyncio.create_task(validate(json_schema_grammar(bomb(40)), "response_format", using=checker))
    async with asyncio.timeout(30):
        while not checker._children:  # noqa: ASYNC110 (a child starts on its own thread: polled)
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    (child,) = checker._children
    os.kill(child.proc.pid, signal.SIGKILL)
    with pytest.raises(ServiceUnavailable) as exc:
        await running
    assert exc.value.code == "grammar_checker_fault" and exc.value.headers() == {"Retry-After": "1"}
    await validate(json_schema_grammar({"type": "integer"}), "response_format", using=checker)
    (child,) = checker._children
    os.kill(child.proc.pid, signal.SIGSTOP)
    with pytest.raises(ServiceUnavailable) as exc:
        await validate(json_schema_grammar({"type": "integer"}), "response_format", using=checker)
    assert exc.value.code == "grammar_checker_fault"
    await validate(json_schema_grammar({"type": "integer"}), "response_format", using=checker)
