"""``ZmqEngineClient`` against a tiny fake worker on real ZeroMQ sockets (ipc)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from protocol import (
    PROTOCOL_VERSION,
    Abort,
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    FinishReason,
    Heartbeat,
    Hello,
    Loading,
    Ready,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
    encode,
)
from proxy.engine.client import ZmqEngineClient
from proxy.errors import EngineDead, EngineNotReady, EngineUnavailable
from proxy.settings import ProxySettings
from tests.fakes.zmq_worker import GUARD_S, FakeWorker


def ready(worker_id: str = "w1", version: int = PROTOCOL_VERSION) -> Ready:
    return Ready(version, worker_id, "tiny", "fake", 2048, None)


def submit(rid: str, n: int = 1) -> Submit:
    return Submit(rid, SamplingParams(max_tokens=4), prompt="hi", n=n)


async def eventually(pred: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD_S):
        while not pred():  # noqa: ASYNC110 - polls a plain attribute of the client
            await asyncio.sleep(0.01)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def addrs(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"


def make_client(addrs: tuple[str, str], **kw: float) -> ZmqEngineClient:
    cfg = ProxySettings(input_addr=addrs[0], output_addr=addrs[1], handshake_interval=0.05, **kw)  # type: ignore[arg-type]
    return ZmqEngineClient(cfg)


@pytest.fixture
async def worker(zctx: zmq.asyncio.Context, addrs: tuple[str, str]) -> AsyncIterator[FakeWorker]:
    w = FakeWorker(zctx, *addrs)
    yield w
    w.close()


async def handshake(client: ZmqEngineClient, worker: FakeWorker, worker_id: str = "w1") -> Hello:
    hello = await worker.recv_until(Hello)
    await worker.send(ready(worker_id))
    await eventually(lambda: client.ready)
    assert isinstance(hello, Hello)
    return hello


async def test_handshake_submit_route_abort(worker: FakeWorker, addrs: tuple[str, str]) -> None:
    client = make_client(addrs)
    await client.start()
    try:
        assert not client.ready
        with pytest.raises(EngineNotReady):
            client.submit(submit("early"))
        hello = await handshake(client, worker)
        assert hello == Hello(PROTOCOL_VERSION, client.proxy_id)
        assert client.worker == ready()

        stream = client.submit(submit("r", n=2))
        assert stream.request_ids == ("r-0", "r-1")
        assert await worker.recv_until(Submit) == submit("r", n=2)  # one Submit for both choices
        events: list[Event] = [
            Started("r-0", 2, 0),
            TokenDelta("r-1", "x", 1),
            TokenDelta("unknown", "dropped", 1),
            Finished("r-0", FinishReason.STOP, 2, 0, 0),
        ]
        await worker.send(EventBatch(events))
        async with asyncio.timeout(GUARD_S):
            received = await stream.get()
        assert received == [events[0], events[1], events[3]]
        assert client.in_flight == 1  # r-0 finished, r-1 still routed

        # No client waits for "unknown": the engine is told to drop it.
        assert await worker.recv_until(Abort) == Abort(("unknown",))
        client.abort(["r-1"])
        assert await worker.recv_until(Abort) == Abort(("r-1",))
        assert client.in_flight == 0
    finally:
        await client.close()


async def test_orphaned_engine_requests_are_aborted_once(worker: FakeWorker, addrs: tuple[str, str]) -> None:
    """Events for ids no stream owns (a proxy restart, a lost Abort) make the
    proxy abort them, once per id; terminal events and late events of an
    already aborted request do not."""
    client = make_client(addrs)
    await client.start()
    try:
        await handshake(client, worker)
        stream = client.submit(submit("mine"))
        await worker.recv_until(Submit)
        client.abort(["mine"])
        assert await worker.recv_until(Abort) == Abort(("mine",))
        await worker.send(EventBatch([TokenDelta("mine", "late", 1), TokenDelta("orphan-a", "x", 1)]))
        await worker.send(EventBatch([TokenDelta("orphan-a", "y", 1), TokenDelta("orphan-b", "z", 1)]))
        await worker.send(EventBatch([Finished("orphan-c", FinishReason.STOP, 1, 0, 1)]))
        await worker.send(EventBatch([TokenDelta("orphan-b", "w", 1), TokenDelta("orphan-d", "v", 1)]))
        aborts = [await worker.recv_until(Abort) for _ in range(3)]
        assert aborts == [Abort(("orphan-a",)), Abort(("orphan-b",)), Abort(("orphan-d",))]
        await worker.send(Heartbeat("w1", 0))
        await asyncio.sleep(0.1)
        assert client.ready and not stream.failed
    finally:
        await client.close()


async def test_heartbeat_of_another_worker_means_ours_restarted(
    worker: FakeWorker, addrs: tuple[str, str]
) -> None:
    client = make_client(addrs, heartbeat_timeout=3600.0)
    await client.start()
    try:
        await handshake(client, worker)
        stream = client.submit(submit("lost"))
        await worker.recv_until(Submit)
        await worker.send(Heartbeat("w2-restarted", 0))
        with pytest.raises(EngineDead):
            async with asyncio.timeout(GUARD_S):
                await stream.get()
        assert not client.ready
        assert await worker.recv_until(Hello)  # handshakes again with the new process
    finally:
        await client.close()


async def test_worker_wide_error_reaches_every_stream(worker: FakeWorker, addrs: tuple[str, str]) -> None:
    client = make_client(addrs)
    await client.start()
    try:
        await handshake(client, worker)
        a, b = client.submit(submit("a")), client.submit(submit("b"))
        err = RequestError(None, ErrorCode.INTERNAL, "CUDA error")
        await worker.send(EventBatch([err]))
        async with asyncio.timeout(GUARD_S):
            assert await a.get() == [err]
            assert await b.get() == [err]
        assert client.in_flight == 0
    finally:
        await client.close()


async def test_version_mismatch_frame_is_refused_and_logged_once(
    worker: FakeWorker, addrs: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(addrs)
    await client.start()
    try:
        theirs = str(PROTOCOL_VERSION + 7)
        for _ in range(3):  # the worker answers every Hello
            await worker.recv_until(Hello)
            frames = encode(ready())
            await worker.push.send_multipart([theirs.encode(), frames[1]])
        await worker.recv_until(Hello)  # still asking: the answers were refused
        assert not client.ready
        errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "proxy.engine.client"]
        assert len(errors) == 1
        assert theirs in errors[0].getMessage() and str(PROTOCOL_VERSION) in errors[0].getMessage()
        with pytest.raises(EngineNotReady):
            client.submit(submit("x"))
    finally:
        await client.close()


async def test_ready_of_another_version_is_refused(
    worker: FakeWorker, addrs: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    client = make_client(addrs)
    await client.start()
    try:
        await worker.recv_until(Hello)
        await worker.send(ready(version=PROTOCOL_VERSION + 1))
        await worker.recv_until(Hello)
        await worker.recv_until(Hello)
        assert not client.ready
        assert any(
            r.levelno == logging.ERROR and str(PROTOCOL_VERSION + 1) in r.getMessage() for r in caplog.records
        )
    finally:
        await client.close()


async def test_heartbeat_timeout_fails_waiting_requests_then_recovers(
    worker: FakeWorker, addrs: tuple[str, str]
) -> None:
    client = make_client(addrs, heartbeat_timeout=0.3)
    await client.start()
    try:
        await handshake(client, worker)
        # heartbeats keep it alive past the timeout
        for _ in range(6):
            await worker.send(Heartbeat("w1", 0))
            await asyncio.sleep(0.1)
        assert client.ready
        stream = client.submit(submit("lost"))
        await worker.recv_until(Submit)
        with pytest.raises(EngineDead):
            async with asyncio.timeout(GUARD_S):
                await stream.get()
        assert not client.ready
        # the stalled worker is told to drop the lost request, and asked to handshake again
        assert await worker.recv_until(Abort) == Abort(("lost",))
        await handshake(client, worker)
        assert client.ready
    finally:
        await client.close()


async def _until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD_S):
        for _ in itertools.count():
            if cond():
                return
            await asyncio.sleep(0.01)


async def test_worker_active_requests_follows_heartbeats_of_the_current_worker(
    worker: FakeWorker, addrs: tuple[str, str]
) -> None:
    client = make_client(addrs)
    await client.start()
    try:
        assert client.worker_active_requests is None and client.heartbeat is None
        await handshake(client, worker)
        for sender, active in (("w1", 3), ("someone-else", 7), ("w1", 0)):
            await worker.send(Heartbeat(sender, active))
        await _until(lambda: client.worker_active_requests == 0)
        await worker.send(Heartbeat("w1", 2, 5, 0.75, 1.5))
        await _until(lambda: client.worker_active_requests == 2)
        assert client.heartbeat == Heartbeat("w1", 2, 5, 0.75, 1.5)
        await worker.send(Heartbeat("stale-worker", 9))
        await asyncio.sleep(0.1)
        assert client.worker_active_requests == 2
    finally:
        await client.close()


async def test_disconnect_is_detected_by_the_socket_monitor(
    zctx: zmq.asyncio.Context, addrs: tuple[str, str]
) -> None:
    worker = FakeWorker(zctx, *addrs)
    client = make_client(addrs, heartbeat_timeout=3600.0)  # only the monitor can notice
    await client.start()
    try:
        await handshake(client, worker)
        stream = client.submit(submit("r"))
        await worker.recv_until(Submit)
        worker.close()  # the worker process is gone
        with pytest.raises(EngineDead):
            async with asyncio.timeout(GUARD_S):
                await stream.get()
        assert not client.ready
        # a restarted worker on the same addresses is picked up
        worker = FakeWorker(zctx, *addrs)
        await handshake(client, worker, worker_id="w2")
        assert client.worker is not None and client.worker.worker_id == "w2"
    finally:
        worker.close()
        await client.close()


async def test_restart_with_new_worker_id_fails_in_flight(worker: FakeWorker, addrs: tuple[str, str]) -> None:
    client = make_client(addrs)
    await client.start()
    try:
        await handshake(client, worker)
        stream = client.submit(submit("r"))
        await worker.send(ready("w-new"))
        with pytest.raises(EngineDead, match="restarted"):
            async with asyncio.timeout(GUARD_S):
                await stream.get()
        assert client.ready and client.worker == ready("w-new")
        # the same worker answering again changes nothing
        other = client.submit(submit("s"))
        await worker.send(ready("w-new"))
        await worker.send(EventBatch([Started("s", 1, 0)]))
        async with asyncio.timeout(GUARD_S):
            assert await other.get() == [Started("s", 1, 0)]
    finally:
        await client.close()


async def test_submit_without_a_connected_input_is_unavailable(
    zctx: zmq.asyncio.Context, addrs: tuple[str, str]
) -> None:
    worker = FakeWorker(zctx, *addrs)
    client = make_client(addrs, heartbeat_timeout=3600.0)
    await client.start()
    try:
        await handshake(client, worker)
        worker.pull.close(linger=0)  # the worker's input side is gone, its output is not

        def refused() -> bool:
            try:
                client.abort(client.submit(submit("r")).request_ids)
            except EngineUnavailable:
                return True
            return False

        await eventually(refused)
        assert client.in_flight == 0
    finally:
        worker.push.close(linger=0)
        await client.close()


async def test_a_crashed_reader_fails_requests_and_never_claims_ready(
    worker: FakeWorker,
    addrs: tuple[str, str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = make_client(addrs)
    await client.start()
    try:
        await handshake(client, worker)
        stream = client.submit(submit("r"))

        def explode(events: object) -> None:
            raise RuntimeError("bug")

        monkeypatch.setattr(client, "_route", explode)
        await worker.send(EventBatch([Started("r", 1, 0)]))
        with pytest.raises(EngineDead):
            async with asyncio.timeout(GUARD_S):
                await stream.get()
        assert not client.ready
        assert any(
            r.levelno == logging.CRITICAL and "engine-reader" in r.getMessage() for r in caplog.records
        )
    finally:
        await client.close()


async def test_loading_messages_say_the_stage_until_ready(worker: FakeWorker, addrs: tuple[str, str]) -> None:
    client = make_client(addrs, heartbeat_timeout=0.5)
    await client.start()
    try:
        await worker.recv_until(Hello)  # connected; the loading worker does not answer yet
        assert client.loading is None
        loading = Loading("w1", "quantize", "quantize weights (int4)", 12, 30, 1500, 4200)
        await worker.send(loading)
        await eventually(lambda: client.loading == loading)
        assert not client.ready
        await asyncio.sleep(0.6)  # no word for heartbeat_timeout: not known to be loading any more
        assert client.loading is None
        await worker.send(loading)
        await eventually(lambda: client.loading is not None)
        await handshake(client, worker)
        assert client.loading is None
        await worker.send(loading)  # one the worker queued before its Ready, arriving after it
        await asyncio.sleep(0.05)
        assert client.loading is None and client.ready
    finally:
        await client.close()
