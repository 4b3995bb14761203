"""An Abort the proxy did not send (issue 20: "a worker-side Abort leaves the stream
open"): the worker ends the request with a terminal event, so the proxy closes the
stream at once instead of sending pings until ``--request-idle-timeout``.

Through the real proxy and a synthetic worker process; the Abort comes from a second
ZeroMQ sender on the worker's input socket, as any other local process could send it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import zmq
from httpx_sse import aconnect_sse

from protocol import Abort, encode
from tests.integration.synthetic import served_proxy, synthetic_worker


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[str, str]]:
    with synthetic_worker(tmp_path, "--synthetic-step-ms", "20", "--heartbeat-interval", "0.05") as addrs:
        yield addrs


async def test_an_abort_from_elsewhere_ends_the_stream_at_once(worker: tuple[str, str]) -> None:
    sender = zmq.Context.instance().socket(zmq.PUSH)
    sender.connect(worker[0])
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "a long answer please"}],
        "max_tokens": 100_000,  # 20 ms a token: half an hour
        "stream": True,
    }
    try:
        # request_idle_timeout as the default: without a terminal event the stream
        # would stay open with pings for 600 s.
        proxy = served_proxy(worker, request_idle_timeout=600.0)
        async with proxy as url, httpx.AsyncClient(timeout=30) as c:
            chunks: list[dict[str, object]] = []
            async with aconnect_sse(c, "POST", url + "/v1/chat/completions", json=body) as source:
                events = source.aiter_sse()
                first = orjson.loads((await anext(events)).data)
                request_id = str(first["id"])  # the engine request id (n = 1)
                sender.send_multipart(encode(Abort((request_id,))))
                aborted_at = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(10):
                        async for sse in events:
                            if sse.data == "[DONE]":
                                break
                            chunks.append(orjson.loads(sse.data))
                closed_after = time.monotonic() - aborted_at
    finally:
        sender.close(0)
    assert closed_after < 5.0, "the stream stayed open after the worker dropped the request"
    errors = [c for c in chunks if "error" in c]
    assert errors and "aborted" in str(errors[-1]["error"])
