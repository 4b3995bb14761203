"""``queue_progress`` through the real proxy and a synthetic worker with one
batch slot: three streams at once with ``return_progress``; the second and
third see their place in the queue go down until their prefill starts; one
cancelled while queued frees its place and never reaches the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
from httpx_sse import aconnect_sse

MAX_TOKENS = 25  # at 20 ms per step: about 0.5 s per request


def _body(i: int, *, progress: bool = True, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "model": "synthetic",
        "messages": [{"role": "user", "content": f"request {i} has a few words"}],
        "max_tokens": max_tokens,
        "stream": True,
        "return_progress": progress,
        "stream_options": {"include_usage": True},
    }


async def _chunks(c: httpx.AsyncClient, url: str, body: dict[str, Any], delay: float) -> list[dict[str, Any]]:
    await asyncio.sleep(delay)  # arrival order = queue order
    out: list[dict[str, Any]] = []
    async with aconnect_sse(c, "POST", url + "/v1/chat/completions", json=body) as source:
        assert source.response.status_code == 200
        async for ev in source.aiter_sse():
            if ev.data == "[DONE]":
                break
            out.append(orjson.loads(ev.data))
    return out


def _check_queue_then_prefill(chunks: list[dict[str, Any]]) -> list[int]:
    """The queue chunks' positions; asserts the shape and order rules."""
    kinds = [
        "queue" if "queue_progress" in c else "prompt" if "prompt_progress" in c else "other" for c in chunks
    ]
    first_prompt = kinds.index("prompt")
    assert "queue" not in kinds[first_prompt:], "a queue_progress chunk after prefill started"
    queue = [c for c in chunks if "queue_progress" in c]
    for c in queue:
        assert c["object"] == "chat.completion.chunk"
        assert c["choices"] == [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": None},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        qp = c["queue_progress"]
        assert 1 <= qp["position"] <= qp["queued"]
    positions = [c["queue_progress"]["position"] for c in queue]
    assert positions == sorted(positions, reverse=True) and len(set(positions)) == len(positions)
    times = [c["queue_progress"]["time_ms"] for c in queue]
    assert times == sorted(times)
    pp = chunks[first_prompt]["prompt_progress"]
    assert pp["processed"] == pp["cache"]  # the first prompt_progress follows as before
    return positions


async def test_three_streams_one_slot(one_slot_url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        results = await asyncio.gather(*(_chunks(c, one_slot_url, _body(i), 0.15 * i) for i in range(3)))
    first, second, third = results
    assert not any("queue_progress" in ch for ch in first)  # started at once
    assert _check_queue_then_prefill(second) == [1]
    assert _check_queue_then_prefill(third) == [2, 1]
    for chunks in results:
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS


async def test_without_the_flag_nothing_changes(one_slot_url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        bodies = [_body(i, progress=False) for i in range(2)]
        results = await asyncio.gather(*(_chunks(c, one_slot_url, b, 0.15 * i) for i, b in enumerate(bodies)))
    for chunks in results:
        assert not any("queue_progress" in ch or "prompt_progress" in ch for ch in chunks)


async def test_a_request_cancelled_while_queued_frees_its_place(one_slot_url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        # Runs ~1.5 s: the leaver and the one behind it queue meanwhile.
        running = asyncio.create_task(_chunks(c, one_slot_url, _body(0, max_tokens=75), 0))
        await asyncio.sleep(0.15)
        leaver_saw: list[dict[str, Any]] = []

        async def leave_after_first_queue_chunk() -> None:
            body = _body(1)
            async with aconnect_sse(c, "POST", one_slot_url + "/v1/chat/completions", json=body) as source:
                async for ev in source.aiter_sse():
                    leaver_saw.append(orjson.loads(ev.data))
                    await asyncio.sleep(0.5)  # the one behind queues at position 2
                    return  # closes the connection while still queued

        leaver = asyncio.create_task(leave_after_first_queue_chunk())
        await asyncio.sleep(0.15)
        behind = asyncio.create_task(_chunks(c, one_slot_url, _body(2), 0))
        await leaver
        results = [await running, await behind]
        metrics = (await c.get(one_slot_url + "/metrics")).text
    assert leaver_saw[0]["queue_progress"]["position"] == 1
    positions = _check_queue_then_prefill(results[1])
    assert positions[0] == 2 and positions[-1] == 1  # moved up when the leaver went
    # The leaver never reached the engine: two requests' tokens were generated.
    generated = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("exl3_sidecar_generation_tokens_total ")
    )
    assert generated == 75 + MAX_TOKENS
