"""A client that stops reading is cut: its engine work aborted, its slot freed,
what the proxy holds for it bounded (issue: stalled readers)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import orjson
import pytest

from protocol import TokenDelta, TokenLogprob, TopLogprob
from proxy.engine.stream import RequestStream
from proxy.errors import StalledClient
from tests.fakes.engine_client import FakeEngineClient, Gate, Step, static_script
from tests.unit.proxy.conftest import MakeClient

URL = "/v1/chat/completions"


async def _stalled_socket(port: int, payload: dict[str, Any]) -> socket.socket:
    """A connection with a 4 KiB receive buffer that sends ``payload`` and never reads."""
    data = orjson.dumps(payload)
    request = (
        f"POST {URL} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request)
    return sock


@pytest.mark.parametrize(
    ("stream", "stalled_s"),
    # 2.5 s: longer than one backlog check (1 s), so the drain is waited on more than once
    [(True, 1.0), (True, 2.5), (False, 1.0)],
)
async def test_a_client_that_reads_nothing_is_cut_and_its_slot_freed(
    make_client: MakeClient,
    fake: FakeEngineClient,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
    stalled_s: float,
) -> None:
    gate = Gate(asyncio.Event())
    texts = ["y" * 4000] * 3000  # 12 MB: far above the socket buffers

    def script(s: Any) -> list[Step]:
        events: list[Step] = list(static_script(texts)(s))
        # the engine keeps the request open (as a long generation would) until the gate
        return [*events[:-1], gate, events[-1]]

    fake.script = script
    client = await make_client(max_in_flight=1, stalled_client_timeout=stalled_s)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    if not stream:
        gate.event.set()
    started = time.monotonic()
    sock = await _stalled_socket(client.server.port, body)
    try:
        if stream:
            aborted = await fake.wait_abort(timeout_s=10)
            assert aborted  # the stalled stream's engine work was aborted
            gate.event.set()  # later requests of the fake run through
        deadline = time.monotonic() + 10
        while True:  # the one slot is free again: another client is served
            r = await client.post(URL, json={**body, "stream": False})
            if r.status == 200:
                break
            assert r.status == 429 and time.monotonic() < deadline
            await asyncio.sleep(0.2)
        assert time.monotonic() - started < 8
    finally:
        gate.event.set()
        sock.close()
    if stream:
        assert any("cut the stream" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def _delta(i: int) -> TokenDelta:
    top = tuple(TopLogprob(f"t{j}", -1.0, b"t") for j in range(20))
    return TokenDelta("r", "z" * 100, 1, (TokenLogprob("z", -0.5, b"z", top),))


def test_the_unread_backlog_is_bounded() -> None:
    stream = RequestStream(["r"], 4, max_merged_bytes=64 * 1024)
    for i in range(200):
        stream.put(_delta(i))
    assert stream.failed
    with pytest.raises(StalledClient):
        while True:
            stream.take()
    ok = RequestStream(["r"], 4, max_merged_bytes=64 * 1024)
    for i in range(20):
        ok.put(_delta(i))
    assert not ok.failed
