"""The proxy's HTTP server as ``run_proxy`` builds it (``proxy.server.runner.make_runner``
on a real TCP socket), driven with raw bytes: what aiohttp's HTTP parser refuses
gets the JSON envelope and one log line, and slow request bodies cannot starve
the requests that do arrive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.app import create_app
from proxy.server.runner import make_runner
from tests.fakes.engine_client import FakeEngineClient, make_config

GUARD_S = 20.0  # safety limit for waits that must end; never a speed check
CHAT = b'{"messages": [{"role": "user", "content": "hi"}]}'


@contextlib.asynccontextmanager
async def serve(**overrides: Any) -> AsyncIterator[tuple[int, FakeEngineClient]]:
    fake = FakeEngineClient()
    runner = make_runner(create_app(make_config(**overrides), fake))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield port, fake
    finally:
        await runner.cleanup()


async def exchange(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection and read one response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await read_response(reader)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response, read by its ``Content-Length`` (after refusing a body the
    server reads and drops the rest for a while before it closes)."""
    async with asyncio.timeout(GUARD_S):
        header = await reader.readuntil(b"\r\n\r\n")
        lines = header.decode().split("\r\n")[:-2]
        fields = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        payload = await reader.readexactly(int(fields["content-length"]))
    return int(lines[0].split()[1]), fields, payload


def post(body: bytes, path: str = "/v1/chat/completions", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
    ).encode() + body


BAD_REQUESTS = {
    "too_many_headers": b"GET /ready HTTP/1.1\r\nHost: localhost\r\n"
    + b"".join(b"X-H-%d: 1\r\n" % i for i in range(200))
    + b"\r\n",
    "request_line_8k": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "header_line_8k": b"GET /ready HTTP/1.1\r\nHost: localhost\r\nX-Long: " + b"b" * 9000 + b"\r\n\r\n",
    "bad_content_length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    b"Content-Length: 12abc\r\n\r\n",
    "invalid_method": b"G<T /ready HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "tls_on_plain_port": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\0" * 32,
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_parser_errors_are_envelopes_logged_in_one_line(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with serve() as (port, fake):
        status, headers, payload = await exchange(port, BAD_REQUESTS[case])
        ok = await exchange(port, b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert status == 400
    assert headers["content-type"] == "application/json"
    err = orjson.loads(payload)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "bad_http_request", None)
    assert err["message"].startswith("Bad HTTP request: ")
    assert "aaaa" not in err["message"] and "bbbb" not in err["message"]  # no echo of the bytes
    assert ok[0] == 200  # the server goes on
    records = [
        r
        for r in caplog.records
        if r.name.startswith(("aiohttp", "proxy")) and "/health" not in r.getMessage()
    ]
    assert len(records) == 1, [r.getMessage() for r in records]
    (record,) = records
    assert record.name == "proxy.server.runner" and record.levelno == logging.INFO
    assert record.exc_info is None and "\n" not in record.getMessage()
    assert "bad HTTP request from 127.0.0.1" in record.getMessage()
    assert fake.submits == []


async def test_client_errors_log_one_line_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with serve(max_body_mb=0.001) as (port, _):
        refused = [
            await exchange(port, post(b"{not json")),
            await exchange(port, post(b"{}", length=10_000)),
            await exchange(port, post(CHAT).replace(b"application/json", b"text/plain")),
        ]
    assert [r[0] for r in refused] == [400, 413, 415]
    records = [r for r in caplog.records if r.name.startswith(("aiohttp", "proxy"))]
    assert len(records) == 3  # one access line each
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in records)


async def test_slow_bodies_do_not_starve_other_requests() -> None:
    """64 clients send their headers and a few bytes of body, then nothing.
    Meanwhile requests that arrive whole are served and ``/ready`` stays 200
    (the body read holds no ``max_in_flight`` slot), and every slow client gets
    a 408 envelope once ``body_read_timeout`` runs out."""
    timeout_s = 1.5
    async with serve(max_in_flight=4, body_read_timeout=timeout_s) as (port, fake):
        slow = []
        for _ in range(64):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post(b'{"messages": [', length=len(CHAT)))
            slow.append((reader, writer))
        await asyncio.gather(*(w.drain() for _, w in slow))
        t0 = time.monotonic()
        served = [await exchange(port, post(CHAT)) for _ in range(8)]
        ready = await exchange(port, b"GET /ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        served_s = time.monotonic() - t0
        try:
            async with asyncio.timeout(GUARD_S):
                answers = [await read_response(r) for r, _ in slow]
        finally:
            for _, w in slow:
                w.close()
        waited_s = time.monotonic() - t0
    assert [s[0] for s in served] == [200] * 8
    assert ready[0] == 200 and orjson.loads(ready[2])["status"] == "ready"
    assert served_s < timeout_s  # served while all 64 were still pending
    assert [a[0] for a in answers] == [408] * 64
    assert {orjson.loads(a[2])["error"]["code"] for a in answers} == {"request_timeout"}
    assert len(fake.submits) == 8
    print(f"8 requests + /ready in {served_s:.3f} s beside 64 slow bodies; 64 x 408 at {waited_s:.2f} s")


async def test_a_compressed_body_is_refused_and_never_inflated() -> None:
    """A 260 KB gzip body that inflates to 256 MiB: 415 at once, and while the
    server reads and drops the rest of the body it inflates none of it (it
    runs with ``auto_decompress=False``; inflating would cost ~1 s of CPU)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * (1 << 20)
    bomb = b"".join(deflate.compress(zeros) for _ in range(256)) + deflate.flush()
    async with serve() as (port, fake):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        cpu0 = time.process_time()
        head = post(b"", length=len(bomb)).replace(b"\r\n\r\n", b"\r\nContent-Encoding: gzip\r\n\r\n")
        writer.write(head + bomb)
        status, headers, payload = await read_response(reader)
        async with asyncio.timeout(GUARD_S):
            assert await reader.read() == b""  # the server closes once it has dropped the body
        cpu_s = time.process_time() - cpu0
        writer.close()
    assert status == 415 and headers["connection"] == "close"
    assert orjson.loads(payload)["error"]["code"] == "unsupported_media_type"
    assert cpu_s < 0.2, cpu_s
    assert fake.submits == []
