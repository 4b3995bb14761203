"""``GET /v1/status``: each request in flight where the worker's events put it, the
worker's state, totals that never go backwards, the SSE stream and its bounds.

Requests are held at a chosen point by the fake worker's gates; every expected
number is computed here from the script's events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import orjson
import pytest
from aiohttp.test_utils import TestClient

from protocol.messages import (
    Finished,
    FinishReason,
    PrefillProgress,
    QueueProgress,
    Started,
    Submit,
    TokenDelta,
)
from proxy.core.generation import Generation, Options
from proxy.ops import status as status_module
from proxy.ops.status_types import Status, status_decoder
from proxy.server.state import STATE
from tests.fakes.engine_client import WORKER, FakeEngineClient, Gate, Step
from tests.unit.proxy.conftest import MakeClient

DECODE = dict(prompt=100, cached=40, texts=["a", "b", "c"], draft=(5, 2))
PREFILL = dict(prompt=200, cached=8, processed=32, time_ms=200)
QUEUE = {"q1": (1, 2, 900, 1500), "q2": (2, 2, 400, None)}  # position, queued, time_ms, eta_ms


class Held:
    """A script whose requests stop at a gate picked by their prompt: ``decode``
    (after three tokens), ``prefill`` (mid-prefill), ``q1``/``q2`` (queued)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    def __call__(self, submit: Submit) -> list[Step]:
        rid = submit.request_id
        kind = submit.messages[-1].content
        gate = Gate(self.release)
        if kind == "decode":
            p, c = int(DECODE["prompt"]), int(DECODE["cached"])  # type: ignore[call-overload]
            texts = list(DECODE["texts"])  # type: ignore[call-overload]
            steps: list[Step] = [Started(rid, p, c), PrefillProgress(rid, p, c, c, 0)]
            steps += [PrefillProgress(rid, p, c, p, 300)]
            steps += [TokenDelta(rid, t, 1) for t in texts]
            steps += [gate, TokenDelta(rid, "d", 1)]
            return [*steps, Finished(rid, FinishReason.STOP, p, c, len(texts) + 1, 5, 2, 0.1, 0.3, 0.4)]
        if kind == "prefill":
            p, c, done = PREFILL["prompt"], PREFILL["cached"], PREFILL["processed"]
            return [
                Started(rid, p, c),
                PrefillProgress(rid, p, c, c, 0),
                PrefillProgress(rid, p, c, done, PREFILL["time_ms"]),
                gate,
                PrefillProgress(rid, p, c, p, 400),
                TokenDelta(rid, "x", 1),
                Finished(rid, FinishReason.LENGTH, p, c, 1, None, None, 0.0, 0.4, 0.0),
            ]
        position, queued, time_ms, eta_ms = QUEUE[kind]
        return [
            QueueProgress(rid, position, queued, time_ms, eta_ms),
            gate,
            Started(rid, 10, 0),
            PrefillProgress(rid, 10, 0, 10, 5),
            TokenDelta(rid, "y", 2),
            Finished(rid, FinishReason.STOP, 10, 0, 2, None, None, 0.5, 0.01, 0.01),
        ]


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def get_status(client: TestClient[Any, Any], **headers: str) -> Status:
    resp = await client.get("/v1/status", headers=headers)
    assert resp.status == 200, await resp.text()
    return status_decoder.decode(await resp.read())


async def until(
    client: TestClient[Any, Any], ok: Callable[[Status], bool], timeout_s: float = 10.0
) -> Status:
    """Poll the endpoint until ``ok`` holds (a safety limit, not a speed check)."""
    async with asyncio.timeout(timeout_s):
        while True:
            st = await get_status(client)
            if ok(st):
                return st
            await asyncio.sleep(0.01)


def by_stage(st: Status) -> list[str]:
    return [r.stage for r in st.requests]


async def start(client: TestClient[Any, Any], *bodies: dict[str, Any]) -> list[asyncio.Task[Any]]:
    async def post(body: dict[str, Any]) -> Any:
        resp = await client.post("/v1/chat/completions", json=body)
        return resp.status, await resp.read()

    return [asyncio.create_task(post(b)) for b in bodies]


async def test_each_request_shows_its_stage_and_numbers(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    held = Held()
    fake.script = held
    fake.waiting_requests, fake.kv_cache_usage = 2, 0.25
    fake.heartbeat_at = time.monotonic() - 0.5
    fake.worker_since = time.monotonic() - 30
    client = await make_client(served_model_name="served", max_in_flight=16)
    # Progress asked by one request only: the status shows every request's anyway.
    tasks = await start(
        client,
        chat("q2"),
        chat("decode", stream=True, return_progress=True),
        chat("q1", stream=True),
        chat("prefill"),
    )
    st = await until(client, lambda s: by_stage(s) == ["decode", "prefill", "queued", "queued"])
    dec, pre, q1, q2 = st.requests
    assert [r.dialect for r in st.requests] == ["chat"] * 4
    assert {r.endpoint for r in st.requests} == {"/v1/chat/completions"}
    assert (dec.stream, pre.stream, q1.stream, q2.stream) == (True, False, True, False)
    assert all(r.id.startswith("chatcmpl-") for r in st.requests)

    assert (dec.prompt_tokens, dec.cached_tokens, dec.completion_tokens) == (100, 40, 3)
    assert dec.queue is None and dec.prefill is None
    assert dec.ttft_s is not None and 0 <= dec.ttft_s <= dec.age_s
    assert dec.decode_tok_s is not None and dec.decode_tok_s >= 0
    assert (dec.draft_accepted, dec.draft_rejected) == (None, None)  # known at its finish

    assert pre.prefill is not None and pre.queue is None
    p = pre.prefill
    assert (p.processed, p.total, p.cached, p.elapsed_s) == (32, 200, 8, 0.2)
    assert p.rate_tok_s == pytest.approx((32 - 8) / 0.2)
    assert (pre.prompt_tokens, pre.cached_tokens, pre.completion_tokens) == (200, 8, 0)
    assert pre.ttft_s is None and pre.decode_tok_s is None

    for r, name in ((q1, "q1"), (q2, "q2")):
        position, queued, _, eta_ms = QUEUE[name]
        assert r.queue is not None and r.prefill is None
        assert (r.queue.position, r.queue.queued) == (position, queued)
        assert r.queue.eta_s == (eta_ms / 1000 if eta_ms is not None else None)
        assert 0 <= r.queue.waited_s <= r.age_s + 0.01

    w = st.worker
    assert w is not None
    assert (w.up, w.worker_id, w.model, w.backend) == (True, WORKER.worker_id, "served", WORKER.backend)
    assert (w.running, w.queued, w.kv_cache_usage) == (len(fake._tasks), 2, 0.25)
    assert w.heartbeat_age_s is not None and 0.5 <= w.heartbeat_age_s < 5
    assert w.uptime_s is not None and 30 <= w.uptime_s < 40
    assert w.kernels is None  # the fake worker's handshake names none
    assert (st.proxy.in_flight, st.proxy.max_in_flight, st.proxy.draining) == (4, 16, False)

    # So far: the prefill's computed tokens, the decode's prompt and tokens.
    t = st.totals
    assert (t.requests, t.failed) == (0, 0)
    assert t.prompt_tokens == 100 + 200 and t.cached_tokens == 40 + 8
    assert t.prefilled_tokens == (100 - 40) + (32 - 8)
    assert t.completion_tokens == 3

    held.release.set()
    results = await asyncio.gather(*tasks)
    assert [status for status, _ in results] == [200] * 4
    end = await until(client, lambda s: not s.requests)
    t = end.totals
    assert (t.requests, t.failed) == (4, 0)
    assert t.prompt_tokens == 100 + 200 + 10 + 10
    assert t.cached_tokens == 40 + 8
    assert t.prefilled_tokens == 60 + 192 + 10 + 10
    assert t.completion_tokens == 4 + 1 + 2 + 2
    assert (t.draft_accepted, t.draft_rejected) == (5, 2)
    assert end.proxy.in_flight == 0


async def test_totals_never_go_backwards_and_a_client_gone_counts_as_failed(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    held = Held()
    fake.script = held
    client = await make_client()
    (task,) = await start(client, chat("prefill", stream=True))
    before = await until(client, lambda s: by_stage(s) == ["prefill"])
    task.cancel()  # the client leaves mid-prefill
    with pytest.raises(asyncio.CancelledError):
        await task
    after = await until(client, lambda s: not s.requests)
    assert (after.totals.requests, after.totals.failed) == (1, 1)
    for field in ("prompt_tokens", "cached_tokens", "prefilled_tokens", "completion_tokens"):
        assert getattr(after.totals, field) == getattr(before.totals, field), field
    await fake.wait_abort()


async def test_generation_keeps_queue_and_prefill_without_emitting_them() -> None:
    gen = Generation(["r"], Options(progress=False))
    out: list[bytes] = []
    q = QueueProgress("r", 3, 4, 10)
    gen.feed(q, out)
    gen.feed(QueueProgress("r", 4, 5, 20), out)  # a later, larger position is still the latest
    assert gen.queue == QueueProgress("r", 4, 5, 20)
    gen.feed(Started("r", 10, 2), out)
    progress = PrefillProgress("r", 10, 2, 6, 50)
    gen.feed(progress, out)
    assert gen.prefill == progress and gen.last_progress is None
    assert out == []


async def test_behind_the_api_key_when_keys_are_set(make_client: MakeClient) -> None:
    client = await make_client(api_key="sk-status-1")
    resp = await client.get("/v1/status")
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "invalid_api_key"
    st = await get_status(client, Authorization="Bearer sk-status-1")
    assert st.requests == [] and st.worker is not None


async def test_the_cpu_engines_kernels_come_from_its_handshake(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    kernels = {"head": "int_mm", "layers": "vnni", "attention": "llvm"}
    fake.worker_ready = msgspec.structs.replace(WORKER, kernels=kernels)
    client = await make_client()
    st = msgspec.json.decode(await (await client.get("/v1/status")).read())
    assert st["worker"]["kernels"] == kernels
    props = await (await client.get("/props")).json()
    assert props["kernels"] == kernels


async def test_before_the_handshake_the_worker_is_null(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.worker_ready = None
    fake.is_ready = False
    client = await make_client()
    st = await get_status(client)
    assert st.worker is None and st.requests == []


async def read_events(client: TestClient[Any, Any], url: str, count: int) -> list[Status]:
    out: list[Status] = []
    async with client.get(url) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        buf = b""
        while len(out) < count:
            chunk = await resp.content.readany()
            assert chunk, "the stream ended early"
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                assert event.startswith(b"data: ")
                out.append(status_decoder.decode(event[len(b"data: ") :]))
    return out


async def test_the_stream_sends_a_snapshot_per_interval(make_client: MakeClient) -> None:
    client = await make_client()
    began = time.monotonic()
    events = await read_events(client, "/v1/status?stream=true&interval=0.25", 3)
    took = time.monotonic() - began
    assert took >= 2 * 0.25  # three snapshots: two intervals between them
    assert events[0].time <= events[1].time <= events[2].time
    assert events[2].time - events[0].time >= 2 * 0.25 - 0.05
    assert events[0].proxy.status_streams == 1


@pytest.mark.parametrize(
    "query", ["stream=true&interval=0.1", "stream=true&interval=61", "interval=abc", "stream=maybe"]
)
async def test_a_bad_query_is_a_400_naming_it(make_client: MakeClient, query: str) -> None:
    client = await make_client()
    resp = await client.get(f"/v1/status?{query}")
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["param"] == query.split("&")[-1].split("=")[0]


async def test_status_streams_are_bounded(make_client: MakeClient) -> None:
    client = await make_client()
    limit = status_module.MAX_STATUS_STREAMS
    opened = [await client.get("/v1/status?stream=true&interval=60") for _ in range(limit)]
    try:
        assert [r.status for r in opened] == [200] * limit
        more = await client.get("/v1/status?stream=true")
        assert more.status == 429
        assert (await more.json())["error"]["code"] == "too_many_requests"
        assert (await get_status(client)).proxy.status_streams == limit  # a plain scrape is not limited
    finally:
        for r in opened:
            r.close()
    # Closed streams give their places back.
    await until(client, lambda s: s.proxy.status_streams == 0)
    again = await client.get("/v1/status?stream=true&interval=60")
    assert again.status == 200
    again.close()


async def test_a_follower_that_reads_nothing_is_cut_and_frees_its_slot(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stalled-client rule of every stream: a status follower that takes
    nothing for ``stalled_client_timeout`` is cut, and its slot is free again."""
    import socket

    monkeypatch.setattr(status_module, "MIN_INTERVAL_S", 0.001)
    # Small snapshots, often: the kernel's buffers (megabytes on loopback) would take
    # them for minutes; the backlog it holds counts too.
    client = await make_client(stalled_client_timeout=1.0)
    loop = asyncio.get_running_loop()
    socks = []
    try:
        for _ in range(status_module.MAX_STATUS_STREAMS):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", client.server.port))
            request = b"GET /v1/status?stream=true&interval=0.001 HTTP/1.1\r\nHost: localhost\r\n\r\n"
            await loop.sock_sendall(sock, request)
            socks.append(sock)
        await until(client, lambda s: s.proxy.status_streams == status_module.MAX_STATUS_STREAMS)
        started = time.monotonic()
        await until(client, lambda s: s.proxy.status_streams == 0)
        assert time.monotonic() - started < 15
        again = await client.get("/v1/status?stream=true&interval=60")
        assert again.status == 200
        again.close()
    finally:
        for sock in socks:
            sock.close()


async def test_head_gets_the_headers_alone_and_holds_no_slot(make_client: MakeClient) -> None:
    """RFC 9110 section 9.3.2; a request pipelined after a HEAD is answered."""
    client = await make_client()
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        head = b"HEAD /v1/status?stream=true HTTP/1.1\r\nHost: localhost\r\n\r\n"
        writer.write(
            head * status_module.MAX_STATUS_STREAMS + b"GET /v1/status HTTP/1.1\r\nHost: localhost\r\n\r\n"
        )
        async with asyncio.timeout(10):
            for _ in range(status_module.MAX_STATUS_STREAMS):
                status_line = await reader.readline()
                assert status_line.startswith(b"HTTP/1.1 200")
                headers = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                assert "text/event-stream" in headers
            status_line = await reader.readline()
            assert status_line.startswith(b"HTTP/1.1 200")  # the GET after them: answered
            headers = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
            length = int(headers.split("content-length:")[1].split("\r\n")[0])
            body = await reader.readexactly(length)
        assert msgspec.json.decode(body)["proxy"]["status_streams"] == 0
    finally:
        writer.close()


async def test_draining_ends_a_stream(make_client: MakeClient) -> None:
    client = await make_client()
    state = client.app[STATE]  # type: ignore[index]
    async with client.get("/v1/status?stream=true&interval=0.25") as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert orjson.loads(first[len(b"data: ") :])["proxy"]["draining"] is False
        state.draining = True
        rest = await asyncio.wait_for(resp.content.read(), 10)  # ends: EOF
    last = rest.strip().split(b"\n\n")[-1]
    assert msgspec.json.decode(last[len(b"data: ") :])["proxy"]["draining"] is True


def test_a_request_that_succeeds_is_not_failed_whatever_is_handled_up_the_stack() -> None:
    """Under ``serve`` the event loop ran while an exception was still being
    handled further up the stack, and ``sys.exception()`` in a request's
    ``finally`` named it: every request counted as failed. The request's own
    outcome decides, nothing else."""
    from aiohttp.test_utils import TestClient, TestServer

    from proxy.app import create_app
    from tests.fakes.engine_client import make_config

    async def scenario() -> dict[str, Any]:
        app = create_app(make_config(), FakeEngineClient())
        async with TestClient(TestServer(app)) as client:
            body = {"messages": [{"role": "user", "content": "x"}]}
            assert (await client.post("/v1/chat/completions", json=body)).status == 200
            status: dict[str, Any] = await (await client.get("/v1/status")).json()
            return status

    try:
        raise KeyError("handled up the stack")
    except KeyError:
        status = asyncio.run(scenario())
    assert (status["totals"]["requests"], status["totals"]["failed"]) == (1, 0)


async def test_with_api_keys_each_key_sees_its_own_requests_and_counts_of_the_rest(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    """Per tenant: another key's ids, token counts, progress and timings would
    reopen the side channel cache isolation closes; they are counted only."""
    held = Held()
    fake.script = held
    client = await make_client(api_key="k1,k2", max_in_flight=16)

    async def post(key: str, content: str) -> Any:
        resp = await client.post(
            "/v1/chat/completions", json=chat(content), headers={"Authorization": f"Bearer {key}"}
        )
        return resp.status

    tasks = [
        asyncio.create_task(post("k1", "decode")),
        asyncio.create_task(post("k2", "prefill")),
        asyncio.create_task(post("k2", "q1")),
    ]
    try:
        k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
        mine = await get_status(client, **k1)
        async with asyncio.timeout(10):
            while len(mine.requests) + (mine.others.requests if mine.others else 0) < 3 or by_stage(mine) != [
                "decode"
            ]:
                await asyncio.sleep(0.01)
                mine = await get_status(client, **k1)
        assert mine.others is not None
        assert (mine.others.requests, mine.others.prefill, mine.others.queued) == (2, 1, 1)
        theirs = await get_status(client, **k2)
        assert by_stage(theirs) == ["prefill", "queued"]
        assert theirs.others is not None and (theirs.others.requests, theirs.others.decode) == (1, 1)
        assert {r.id for r in mine.requests}.isdisjoint({r.id for r in theirs.requests})
        raw = await (await client.get("/v1/status", headers=k1)).text()
        for r in theirs.requests:
            assert r.id not in raw
    finally:
        held.release.set()
        await asyncio.gather(*tasks)


async def test_without_api_keys_every_request_is_listed(make_client: MakeClient) -> None:
    client = await make_client()
    st = await get_status(client)
    assert st.others is None
