"""Many streams at once through the real proxy and a real synthetic worker process:
no token lost, duplicated or sent to the wrong stream, every usage exact, and the
streams whose clients went away freed their engine work. Every stream goes
through the fast path (the reader writes each step to the clients itself); once
more with ``stream_interval`` grouping tokens."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from httpx_sse import aconnect_sse

from engine_worker.synthetic import expected_text, prompt_words
from protocol import ChatMessage, SamplingParams, Submit
from tests.integration.synthetic import served_proxy, synthetic_worker

MAX_TOKENS = 20


@pytest.fixture(params=[(1000, 1), (500, 3)], ids=["1000-streams", "500-streams-interval-3"])
async def load(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, int]]:
    """``(base URL, streams)``; the proxy's ``stream_interval`` is the second parameter."""
    streams, interval = request.param
    with synthetic_worker(
        tmp_path, "--synthetic-step-ms", "20", "--max-batch-size", str(2 * streams)
    ) as addrs:
        async with served_proxy(
            addrs, max_in_flight=2 * streams, heartbeat_timeout=30, stream_interval=interval
        ) as url:
            yield url, streams


async def _stream(
    client: httpx.AsyncClient, url: str, i: int, streams: int, leave_after: int | None
) -> dict[str, Any]:
    # Connect over ~2 s rather than all in one instant, which would overflow the
    # test server's listen backlog (a load generator's concern, not the proxy's).
    await asyncio.sleep(2 * i / streams)
    content = f"stream {i} word{i % 7} tail{i}"
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": content}],
        # A leaver asks for far more than it reads: only an abort ends it soon.
        "max_tokens": MAX_TOKENS if leave_after is None else 100_000,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    usage = None
    for attempt in range(3):
        try:
            async with aconnect_sse(client, "POST", url + "/v1/chat/completions", json=body) as source:
                assert source.response.status_code == 200
                async for ev in source.aiter_sse():
                    if ev.data == "[DONE]":
                        break
                    chunk = orjson.loads(ev.data)
                    if chunk["choices"]:
                        piece = chunk["choices"][0]["delta"].get("content")
                        if piece:
                            text.append(piece)
                            if leave_after is not None and len(text) >= leave_after:
                                return {"left": True}
                    elif chunk.get("usage"):
                        usage = chunk["usage"]
            break
        except (httpx.ConnectError, httpx.ReadError):
            # Only before any response byte, so the request never reached the
            # proxy: a connection the kernel dropped while 1,000 clients
            # connected at once to a loop they share with the server. Real
            # clients retry these too.
            if text or attempt == 2:
                raise
            await asyncio.sleep(0.5)
    return {"content": content, "text": "".join(text), "usage": usage}


# The load generator's own sockets: once in a CI run of the whole suite (2 cores),
# a client connection of httpx's pool (laddr an even connect() port, raddr the
# proxy's odd bind(0) port) was collected unclosed in a reference cycle while
# 1,000 clients connected through a full listen backlog. That is the client
# library's cleanup under a backlog overflow, not what this test checks; the
# proxy's side of connections is checked with warnings as errors in
# test_connections.py and test_http_server.py.
@pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <(socket\.socket|function _SelectorTransport\.__del__):"
    "pytest.PytestUnraisableExceptionWarning"
)
async def test_many_streams_with_a_tenth_leaving(load: tuple[str, int]) -> None:
    base_url, streams = load
    rng = random.Random(7)
    leavers = set(rng.sample(range(streams), streams // 10))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        results = await asyncio.gather(
            *(_stream(client, base_url, i, streams, 3 if i in leavers else None) for i in range(streams))
        )
        finished = [r for r in results if "left" not in r]
        assert len(finished) == streams - len(leavers)
        for r in finished:
            words = prompt_words(
                Submit("x", SamplingParams(1), messages=(ChatMessage("user", r["content"]),))
            )
            assert r["text"] == expected_text(words, MAX_TOKENS)
            assert r["usage"]["completion_tokens"] == MAX_TOKENS
            assert r["usage"]["prompt_tokens"] == len(words)
        # The streams whose clients left were aborted in the worker, not run to the end.
        deadline = time.monotonic() + 10
        while True:
            ready = (await client.get(base_url + "/ready")).json()
            if ready["worker_active_requests"] == 0:
                break
            assert time.monotonic() < deadline, ready
            await asyncio.sleep(0.2)
