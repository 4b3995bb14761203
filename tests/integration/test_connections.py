"""What one client's connections may cost the others (``proxy.server.connections``),
on the server ``run_proxy`` builds (``proxy.server.runner.make_runner``) on a real TCP
socket, driven with raw bytes: the connection cap with its 503 and its probes,
the header-read deadline against slow headers, the keep-alive deadline, and
accept errors logged once a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.server import connections, runner
from proxy.server.runner import make_runner
from tests.fakes.engine_client import FakeEngineClient, make_config

GUARD_S = 20.0  # safety limit for waits that must end; never a speed check
HEALTH = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def serve(**overrides: Any) -> AsyncIterator[tuple[int, runner._EnvelopeServer]]:
    app_runner = make_runner(create_app(make_config(**overrides), FakeEngineClient()))
    await app_runner.setup()
    try:
        site = web.TCPSite(app_runner, "127.0.0.1", 0)
        await site.start()
        server = app_runner.server
        assert isinstance(server, runner._EnvelopeServer)
        yield app_runner.addresses[0][1], server
    finally:
        await app_runner.cleanup()


async def connect(port: int) -> Conn:
    return await asyncio.open_connection("127.0.0.1", port)


async def close(conn: Conn) -> None:
    conn[1].close()
    with contextlib.suppress(ConnectionError):
        await conn[1].wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(GUARD_S):
        header = await reader.readuntil(b"\r\n\r\n")
        lines = header.decode().split("\r\n")[:-2]
        fields = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        payload = await reader.readexactly(int(fields["content-length"]))
    return int(lines[0].split()[1]), fields, payload


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (EOF or reset) before ``GUARD_S``."""
    try:
        async with asyncio.timeout(GUARD_S):
            return await reader.read() == b""
    except ConnectionResetError:
        return True


async def exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = await connect(port)
    try:
        conn[1].write(data)
        return await read_response(conn[0])
    finally:
        await close(conn)


async def until(predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD_S):
        while not predicate():  # noqa: ASYNC110 - polls the server's connection sets
            await asyncio.sleep(0.01)


def code_of(body: bytes) -> str:
    return str(orjson.loads(body)["error"]["code"])


# -- the connection cap ------------------------------------------------------------------


async def test_idle_sockets_over_the_cap_get_503_while_probes_answer() -> None:
    cap, extra = 4, 6
    async with serve(max_connections=cap) as (port, server):
        idle = [await connect(port) for _ in range(cap)]
        await until(lambda: len(server.admitted) == cap)

        t0 = time.monotonic()
        over = [await connect(port) for _ in range(extra)]
        answers = await asyncio.gather(*(read_response(r) for r, _ in over))
        for status, headers, body in answers:
            assert status == 503
            assert code_of(body) == "too_many_connections"
            assert headers["retry-after"] == "1"
            assert headers["connection"] == "close"
        # the 503 of a silent connection comes after its grace, not before
        assert time.monotonic() - t0 >= connections.OVER_CAP_GRACE_S * 0.9
        assert all([await closed(r) for r, _ in over])
        for conn in over:
            await close(conn)

        # A fresh connection for a probe is answered; for anything else, 503 at once.
        status, headers, body = await exchange(port, HEALTH)
        assert (status, orjson.loads(body)) == (200, {"status": "ok"})
        assert headers["connection"] == "close"
        status, _, body = await exchange(port, MODELS)
        assert (status, code_of(body)) == (503, "too_many_connections")
        assert len(server.admitted) == cap  # none of those took a place

        for conn in idle:
            await close(conn)
        await until(lambda: len(server.admitted) == 0)
        status, _, _ = await exchange(port, MODELS)
        assert status == 200


async def test_beyond_the_over_cap_allowance_the_503_comes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "over_cap_allowance", lambda cap: 2)
    monkeypatch.setattr(runner, "OVER_CAP_GRACE_S", GUARD_S * 2)  # the allowed ones never time out here
    async with serve(max_connections=1) as (port, server):
        held = [await connect(port)]
        await until(lambda: len(server.admitted) == 1)
        held += [await connect(port) for _ in range(2)]
        await until(lambda: len(server.over_cap) == 2)
        t0 = time.monotonic()
        reader, writer = await connect(port)
        status, _, body = await read_response(reader)
        assert (status, code_of(body)) == (503, "too_many_connections")
        assert time.monotonic() - t0 < GUARD_S
        assert await closed(reader)
        writer.close()
        for conn in held:
            await close(conn)


def test_default_cap_is_below_the_open_file_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = make_config().connection_cap()
    assert 1 <= cap <= 10_000
    assert cap < soft or soft == resource.RLIM_INFINITY
    assert make_config(max_connections=7).connection_cap() == 7


# -- header-read and keep-alive deadlines ------------------------------------------------


async def test_slow_headers_are_cut_with_408_at_the_deadline() -> None:
    deadline = 0.5
    async with serve(header_read_timeout=deadline) as (port, _):
        reader, writer = await connect(port)
        t0 = time.monotonic()
        writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        sent = 0

        async def trickle() -> None:
            nonlocal sent
            with contextlib.suppress(ConnectionError):
                while True:
                    writer.write(b"X-A: b\r\n")  # a header line every 50 ms, never the blank line
                    sent += 1
                    await writer.drain()
                    await asyncio.sleep(0.05)

        task = asyncio.create_task(trickle())
        try:
            status, _, body = await read_response(reader)
        finally:
            task.cancel()
        elapsed = time.monotonic() - t0
        assert (status, code_of(body)) == (408, "request_timeout")
        assert "header_read_timeout=0.5" in orjson.loads(body)["error"]["message"]
        assert deadline * 0.9 <= elapsed < GUARD_S
        assert sent >= 5  # it was trickling all along
        assert await closed(reader)
        writer.close()


async def test_a_silent_connection_is_closed_at_the_deadline_without_a_response() -> None:
    async with serve(header_read_timeout=0.3) as (port, _):
        reader, writer = await connect(port)
        t0 = time.monotonic()
        async with asyncio.timeout(GUARD_S):  # keepalive_timeout (75 s) is not what closes it
            assert await reader.read() == b""
        assert time.monotonic() - t0 >= 0.3 * 0.9
        writer.close()


async def test_the_deadline_spares_idle_keepalive_bodies_and_later_requests() -> None:
    async with serve(header_read_timeout=0.3, keepalive_timeout=5.0) as (port, _):
        reader, writer = await connect(port)
        writer.write(HEALTH)
        assert (await read_response(reader))[0] == 200
        await asyncio.sleep(0.6)  # idle between requests: keepalive_timeout's, not the header deadline's
        writer.write(HEALTH)
        assert (await read_response(reader))[0] == 200

        # A body slower than the header deadline (within body_read_timeout) is read in full.
        body = b'{"messages": [}' + b" " * 40
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        for i in range(0, len(body), 8):
            writer.write(body[i : i + 8])
            await asyncio.sleep(0.1)
        status, _, payload = await read_response(reader)
        assert status == 400
        assert code_of(payload) != "request_timeout"

        # A later request's headers get the deadline from their first byte.
        t0 = time.monotonic()
        writer.write(b"GET /health HTTP/1.1\r\n")
        status, _, payload = await read_response(reader)
        assert (status, code_of(payload)) == (408, "request_timeout")
        assert time.monotonic() - t0 >= 0.3 * 0.9
        writer.close()


async def test_an_idle_keepalive_connection_is_closed_after_keepalive_timeout() -> None:
    async with serve(keepalive_timeout=0.5) as (port, _):
        reader, writer = await connect(port)
        writer.write(HEALTH)
        assert (await read_response(reader))[0] == 200
        t0 = time.monotonic()
        assert await closed(reader)
        assert time.monotonic() - t0 >= 0.5 * 0.9
        writer.close()


# -- accept errors -------------------------------------------------------------------------


async def test_accept_errors_are_logged_once_a_second(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        async with serve():
            with caplog.at_level(logging.WARNING, logger="proxy.server.connections"):
                for _ in range(4096):  # what one readiness event can report (the listen backlog)
                    loop.call_exception_handler(
                        {
                            "message": connections.ACCEPT_ERROR_MESSAGE,
                            "exception": OSError(24, "Too many open files"),
                        }
                    )
                other = {"message": "something else", "exception": RuntimeError("x")}
                loop.call_exception_handler(other)
            lines = [r for r in caplog.records if r.name == "proxy.server.connections"]
            assert len(lines) == 1
            assert "Too many open files" in lines[0].getMessage()
            assert lines[0].exc_info is None
            assert seen == [other]  # other errors still reach the handler that was there
        # the runner's cleanup put that handler back
        loop.call_exception_handler(other)
        assert seen == [other, other]
    finally:
        loop.set_exception_handler(None)


def test_throttled_counts_what_it_leaves_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = logging.getLogger("tests.throttled")
    throttled = connections.Throttled(log, logging.WARNING, interval=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tests.throttled"):
        assert throttled("event %d", 1)
        for i in range(2, 1000):
            now[0] += 0.0005
            assert not throttled("event %d", i)
        now[0] = 101.0
        assert throttled("event %d", 1000)
    assert [r.getMessage() for r in caplog.records] == [
        "event 1",
        "event 1000 (and 998 more since the last such line)",
    ]
