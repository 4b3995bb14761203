"""``/metrics`` on a real synthetic worker process: the load gauges follow what
the worker runs and queues (``--max-batch-size 1``), then fall back to 0, and
the token counters equal the usage the streams were sent."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families


def gauges(text: str) -> dict[str, float]:
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels and f.type in ("gauge", "counter")
    }


async def _complete(c: httpx.AsyncClient, url: str, i: int) -> dict[str, Any]:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": f"request {i} " + "word " * i}],
        "max_tokens": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with c.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        data = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    usage: dict[str, Any] = orjson.loads(data[-2])["usage"]
    return usage


async def test_gauges_follow_the_worker_and_counters_the_usage(one_slot_url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as c:
        tasks = [asyncio.create_task(_complete(c, one_slot_url, i)) for i in range(3)]
        seen_running = seen_waiting = 0.0
        while not all(t.done() for t in tasks):
            g = gauges((await c.get(one_slot_url + "/metrics")).text)
            seen_running = max(seen_running, g["exl3_sidecar_requests_running"])
            seen_waiting = max(seen_waiting, g["exl3_sidecar_requests_waiting"])
            assert g["exl3_sidecar_worker_up"] == 1
            await asyncio.sleep(0.02)
        usages = [await t for t in tasks]
        # One batch slot: one runs while the other two wait.
        assert seen_running == 1
        assert seen_waiting == 2
        deadline = time.monotonic() + 5
        while True:
            g = gauges((await c.get(one_slot_url + "/metrics")).text)
            if g["exl3_sidecar_requests_running"] == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert g["exl3_sidecar_requests_running"] == 0
        assert g["exl3_sidecar_requests_waiting"] == 0
        assert g["exl3_sidecar_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
        assert g["exl3_sidecar_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages) == 120
