"""The fast path against a real synthetic worker process: a client that stops
reading has its backlog merged without holding up anyone else.

Token latencies come from the synthetic engine's stamps (``STAMP_WORD``): each
token names the ``CLOCK_MONOTONIC`` microsecond its engine step began."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from httpx_sse import aconnect_sse

from engine_worker.synthetic import STAMP, STAMP_WORD, expected_text, prompt_words, strip_stamps
from protocol import ChatMessage, SamplingParams, Submit
from tests.integration.synthetic import served_proxy, synthetic_worker

STEP_MS = 50
TOKENS_PER_STEP = 100
SLOW_TOKENS = 4000  # 40 steps of 100 words of 4,000 characters: 16 MB the client does not read
FAST_STREAMS = 8
FAST_TOKENS = 1000  # 10 steps


@pytest.fixture
async def base_url(tmp_path: Path) -> AsyncIterator[str]:
    args = ("--synthetic-step-ms", str(STEP_MS), "--synthetic-tokens-per-step", str(TOKENS_PER_STEP))
    with synthetic_worker(tmp_path, *args) as addrs:
        async with served_proxy(addrs, request_queue_max=8, heartbeat_timeout=30) as url:
            yield url


def words_of(content: str) -> list[str]:
    return prompt_words(Submit("x", SamplingParams(1), messages=(ChatMessage("user", content),)))


def chat(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "synthetic",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def fast_stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, list[float], dict[str, Any]]:
    """Read one stream as it comes: its text and each token's latency (ms)."""
    content = f"{STAMP_WORD} fast{i} w{i}"
    text: list[str] = []
    latencies: list[float] = []
    usage: dict[str, Any] = {}
    async with aconnect_sse(client, "POST", url, json=chat(content, FAST_TOKENS)) as source:
        async for ev in source.aiter_sse():
            now_us = time.monotonic() * 1e6
            if ev.data == "[DONE]":
                break
            chunk = orjson.loads(ev.data)
            if chunk["choices"]:
                piece = chunk["choices"][0]["delta"].get("content") or ""
                text.append(piece)
                latencies += [(now_us - int(m.group(1))) / 1000 for m in STAMP.finditer(piece)]
            elif chunk.get("usage"):
                usage = chunk["usage"]
    return "".join(text), latencies, usage


async def test_a_client_that_stops_reading_delays_no_other_stream(base_url: str) -> None:
    loop = asyncio.get_running_loop()
    port = int(base_url.rsplit(":", 1)[1])
    slow_content = f"{STAMP_WORD} " + " ".join(f"{k}" + "x" * 4000 for k in range(3))
    payload = orjson.dumps(chat(slow_content, SLOW_TOKENS))
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.setblocking(False)
    await loop.sock_connect(slow, ("127.0.0.1", port))
    await loop.sock_sendall(slow, request)
    try:
        # Let the slow stream's bytes fill the kernel's buffers and the proxy's
        # transport (8 MB per 20 steps), then run the others beside it.
        await asyncio.sleep(20 * STEP_MS / 1000)
        url = base_url + "/v1/chat/completions"
        async with httpx.AsyncClient(timeout=60) as client:
            results = await asyncio.gather(*(fast_stream(client, url, i) for i in range(FAST_STREAMS)))
        for i, (text, latencies, usage) in enumerate(results):
            words = words_of(f"{STAMP_WORD} fast{i} w{i}")
            assert strip_stamps(text) == expected_text(words, FAST_TOKENS)
            assert usage["completion_tokens"] == FAST_TOKENS
            # Every token within one engine step of the step that made it.
            assert max(latencies) < STEP_MS, sorted(latencies)[-5:]

        # Only now does the slow client read: all of it, exact, in fewer events
        # than steps (its backlog was merged while it was not reading).
        received: list[bytes] = []
        while chunk := await loop.sock_recv(slow, 1 << 20):
            received.append(chunk)
        data = b"".join(received)
    finally:
        slow.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"200 OK" in head.split(b"\r\n", 1)[0]
    sse_body = dechunk(body)
    chunks = [orjson.loads(f[6:]) for f in sse_body.split(b"\n\n") if f.startswith(b"data: {")]
    pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert strip_stamps("".join(pieces)) == expected_text(words_of(slow_content), SLOW_TOKENS)
    assert len([p for p in pieces if p]) < SLOW_TOKENS // TOKENS_PER_STEP
    assert chunks[-1]["usage"]["completion_tokens"] == SLOW_TOKENS
    assert sse_body.endswith(b"data: [DONE]\n\n")


def dechunk(body: bytes) -> bytes:
    out: list[bytes] = []
    pos = 0
    while True:
        nl = body.index(b"\r\n", pos)
        size = int(body[pos:nl], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[nl + 2 : nl + 2 + size])
        pos = nl + 2 + size + 2
