"""The fast path: a ``RequestStream`` handing events to a sink, ``stream_interval``,
and the bytes ``TransportWriter`` puts on the wire."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from protocol import (
    ErrorCode,
    Event,
    Finished,
    FinishReason,
    RequestError,
    Started,
    TokenDelta,
    TokenLogprob,
)
from proxy.engine.stream import RequestStream
from proxy.errors import EngineDead, EngineInternalError
from proxy.server import sse
from proxy.serving.delivery import TokenGrouper
from tests.fakes.engine_client import FakeEngineClient, static_script
from tests.unit.proxy.conftest import MakeClient, sse_json

URL = "/v1/chat/completions"


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **fields}


def delta(rid: str, text: str, n: int = 1) -> TokenDelta:
    return TokenDelta(rid, text, n)


# ------------------------------------------------------------------ RequestStream and its sink


async def test_a_batch_reaches_the_sink_once_per_stream_when_the_reader_delivers() -> None:
    ready: list[RequestStream] = []
    s = RequestStream(["a", "b"], 8, ready=ready)
    got: list[list[Event]] = []
    assert s.attach(lambda evs: got.append(list(evs)) is None)
    s.put(delta("a", "x"))
    s.put(delta("b", "y"))
    s.put(delta("a", "z"))
    assert ready == [s]  # listed once, nothing delivered before the batch is routed
    assert got == []
    for r in ready:
        r.deliver()
    assert got == [[delta("a", "x"), delta("b", "y"), delta("a", "z")]]


async def test_without_a_reader_list_the_sink_runs_from_the_loop() -> None:
    s = RequestStream(["a"], 8)
    got: list[Event] = []
    s.attach(lambda evs: got.extend(evs) is None)
    s.put(delta("a", "x"))
    s.put(delta("a", "y"))
    assert got == []
    await asyncio.sleep(0)
    assert got == [delta("a", "x"), delta("a", "y")]


async def test_a_sink_that_returns_false_is_detached_and_wakes_the_consumer() -> None:
    ready: list[RequestStream] = []
    s = RequestStream(["a"], 8, ready=ready)
    calls: list[list[Event]] = []

    def sink(evs: list[Event]) -> bool:
        calls.append(list(evs))
        return False

    assert s.attach(sink)
    waiter = asyncio.create_task(s.wait())
    await asyncio.sleep(0)
    s.put(delta("a", "x"))
    ready.pop().deliver()
    async with asyncio.timeout(5):
        await waiter
    s.put(delta("a", "later"))  # no sink now: waits for take
    assert not ready
    assert s.take() == [delta("a", "later")]
    assert calls == [[delta("a", "x")]]


async def test_attach_refuses_while_events_wait_or_after_failure() -> None:
    s = RequestStream(["a"], 8)
    s.put(delta("a", "x"))
    assert not s.attach(lambda evs: True)
    assert s.take() == [delta("a", "x")]
    assert s.attach(lambda evs: True)
    s.detach()
    s.fail(EngineDead("gone"))
    assert not s.attach(lambda evs: True)
    with pytest.raises(EngineDead):
        s.take()


async def test_fail_detaches_the_sink_and_leaves_pending_events_before_the_error() -> None:
    ready: list[RequestStream] = []
    s = RequestStream(["a"], 8, ready=ready)
    got: list[Event] = []
    s.attach(lambda evs: got.extend(evs) is None)
    waiter = asyncio.create_task(s.wait())
    await asyncio.sleep(0)
    s.put(delta("a", "x"))
    s.fail(EngineDead("gone"))
    ready.pop().deliver()  # the sink is gone: nothing delivered
    async with asyncio.timeout(5):
        await waiter
    assert got == []
    assert s.take() == [delta("a", "x")]
    with pytest.raises(EngineDead):
        s.take()


async def test_a_sink_that_raises_fails_its_stream_not_the_reader(caplog: pytest.LogCaptureFixture) -> None:
    ready: list[RequestStream] = []
    s = RequestStream(["a"], 8, ready=ready)

    def sink(evs: list[Event]) -> bool:
        raise RuntimeError("bug")

    s.attach(sink)
    s.put(delta("a", "x"))
    ready.pop().deliver()  # does not raise
    with pytest.raises(EngineInternalError):
        s.take()
    assert "delivering events" in caplog.text


async def test_wait_ends_at_its_deadline_without_events() -> None:
    s = RequestStream(["a"], 8)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await s.wait(t0 + 0.05)
    assert loop.time() >= t0 + 0.05
    assert s.take() == []
    assert await s.get(0.01) == []


async def test_merged_deltas_keep_their_logprobs() -> None:
    s = RequestStream(["a"], 1)
    lp = [TokenLogprob(f"t{i}", -float(i), f"t{i}".encode()) for i in range(3)]
    s.put(Started("a", 3, 0))
    s.put(TokenDelta("a", "t0", 1, (lp[0],)))
    s.put(TokenDelta("a", "t1", 1, (lp[1],)))
    s.put(TokenDelta("a", "t2", 1, (lp[2],)))
    events = await s.get()
    assert events == [Started("a", 3, 0), TokenDelta("a", "t0t1t2", 3, tuple(lp))]


# ------------------------------------------------------------------ stream_interval


def test_grouper_sends_the_first_token_at_once_then_groups() -> None:
    g = TokenGrouper(3)
    out: list[Event] = []
    for i in range(8):
        out += g.apply([delta("a", f"{i},")])
    out += g.apply([Finished("a", FinishReason.LENGTH, 1, 0, 8)])
    texts = [e.text for e in out if isinstance(e, TokenDelta)]
    assert texts == ["0,", "1,2,3,", "4,5,6,", "7,"]
    assert isinstance(out[-1], Finished)
    assert sum(e.num_tokens for e in out if isinstance(e, TokenDelta)) == 8


def test_grouper_keeps_choices_apart_and_flushes_before_a_worker_error() -> None:
    g = TokenGrouper(10)
    out = g.apply([delta("a", "a0"), delta("b", "b0"), delta("a", "a1"), delta("b", "b1"), delta("a", "a2")])
    assert [(e.request_id, e.text) for e in out if isinstance(e, TokenDelta)] == [("a", "a0"), ("b", "b0")]
    err = RequestError(None, ErrorCode.INTERNAL, "boom")
    out = g.apply([err])
    assert [(e.request_id, getattr(e, "text", None)) for e in out] == [
        ("a", "a1a2"),
        ("b", "b1"),
        (None, None),
    ]


async def test_stream_interval_over_http(make_client: MakeClient, fake: FakeEngineClient) -> None:
    texts = [f"w{i} " for i in range(10)]
    fake.script = static_script(texts)
    client = await make_client(stream_interval=4)
    r = await client.post(URL, json=body(stream=True, stream_options={"include_usage": True}))
    raw = await r.read()
    chunks = [orjson.loads(f[6:]) for f in raw.split(b"\n\n") if f.startswith(b"data: {")]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert [c for c in contents if c] == ["w0 ", "w1 w2 w3 w4 ", "w5 w6 w7 w8 ", "w9 "]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_stream_interval_leaves_non_stream_responses_alone(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = static_script(["a", "b", "c"])
    client = await make_client(stream_interval=2)
    r = await client.post(URL, json=body())
    assert (await r.json())["choices"][0]["message"]["content"] == "abc"


# ------------------------------------------------------------------ bytes on the wire


async def _raw_http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def _dechunk(body: bytes) -> tuple[bytes, int]:
    out, pos, chunks = b"", 0, 0
    while True:
        nl = body.index(b"\r\n", pos)
        size = int(body[pos:nl], 16)
        pos = nl + 2
        if size == 0:
            assert body[pos:] == b"\r\n"
            return out, chunks
        out += body[pos : pos + size]
        assert body[pos + size : pos + size + 2] == b"\r\n"
        pos += size + 2
        chunks += 1


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_transport_writes_frame_the_body_as_aiohttp_does(version: str) -> None:
    events = [sse.event({"n": i, "t": "\u2028"}) for i in range(5)]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers=sse.HEADERS)
        writer = await resp.prepare(request)
        assert writer is not None
        out = sse.TransportWriter(request, resp, writer)
        assert out.write(events[:2])
        await resp.write(events[2])  # aiohttp's own framing, on the same stream
        assert out.write(events[3:])
        assert not out.congested
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        request = f"GET / HTTP/{version}\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        raw = await _raw_http(port, request.encode())
    finally:
        await runner.cleanup()
    head, _, body_bytes = raw.partition(b"\r\n\r\n")
    if version == "1.1":
        assert b"Transfer-Encoding: chunked" in head
        body_bytes, chunks = _dechunk(body_bytes)
        assert chunks == 3  # one per write
    else:
        assert b"Transfer-Encoding" not in head
    assert body_bytes == b"".join(events)


async def test_a_client_that_stops_reading_is_merged_and_complete(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    """Big events to a client that reads nothing for a while: the transport goes
    above its high-water mark, the stream is handed back and its backlog merged;
    once the client reads, every byte of text is there, in order."""
    texts = [f"{i:04d}" + "x" * 4000 for i in range(3000)]
    fake.script = static_script(texts)
    fake.max_merged_bytes = 64 * 1024 * 1024  # this client reads, slowly: not a stalled one
    client = await make_client(request_queue_max=8)
    port = client.server.port
    payload = orjson.dumps(body(stream=True, stream_options={"include_usage": True}))
    request = (
        f"POST {URL} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request)
    await asyncio.sleep(0.5)  # the proxy writes into a full window meanwhile
    data = b""
    while chunk := await loop.sock_recv(sock, 65536):
        data += chunk
    sock.close()
    _, _, body_bytes = data.partition(b"\r\n\r\n")
    sse_body, _ = _dechunk(body_bytes)
    chunks = [orjson.loads(f[6:]) for f in sse_body.split(b"\n\n") if f.startswith(b"data: {")]
    pieces = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert "".join(p for p in pieces if p) == "".join(texts)
    assert len(pieces) < len(texts)  # the backlog was merged: this test saw backpressure
    assert chunks[-1]["usage"]["completion_tokens"] == len(texts)
    assert sse_body.endswith(b"data: [DONE]\n\n")


async def test_many_streams_at_once_on_the_fake(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script([f"t{i} " for i in range(20)])
    client = await make_client(max_in_flight=100)
    url = str(client.make_url(URL))
    async with httpx.AsyncClient(timeout=30) as http:
        results = await asyncio.gather(*(sse_json(http, url, body(stream=True)) for _ in range(50)))
    for chunks in results:
        assert chunks[-1] == "[DONE]"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"])
        assert text == "".join(f"t{i} " for i in range(20))


# ------------------------------------------------------------------ the process's loop and collector


def test_run_settles_the_collector_and_runs_the_coroutine() -> None:
    # In a child process: the collector's settings are the whole process's.
    code = (
        "import asyncio, gc\n"
        "from proxy.server.runner import GC_THRESHOLDS, run\n"
        "assert run(asyncio.sleep(0, 'done')) == 'done'\n"
        "assert gc.get_threshold() == GC_THRESHOLDS, gc.get_threshold()\n"
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
