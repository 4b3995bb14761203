"""A recording pass-through in front of a server: each request's method, path
and body, and the response's status and bytes, kept in order while the
response streams on to the client unchanged. The coding-agent tests put it
between an agent and ``exl3-sidecar serve`` to assert what the agent sent and
read, not only what it printed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

# Hop-by-hop or recomputed: not forwarded (RFC 9110 section 7.6.1).
_SKIP = frozenset({"host", "content-length", "transfer-encoding", "connection", "accept-encoding"})


@dataclass
class Exchange:
    method: str
    path: str  # with the query string
    body: bytes
    status: int = 0
    response: bytearray = field(default_factory=bytearray)

    def json(self) -> Any:
        return orjson.loads(self.body)

    def sse_data(self) -> list[Any]:
        """The ``data:`` payloads of an SSE response, decoded (``[DONE]`` left out)."""
        out = []
        for line in bytes(self.response).splitlines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(orjson.loads(line[6:]))
        return out


@contextmanager
def recording(upstream: str) -> Iterator[tuple[str, list[Exchange]]]:
    """``(base_url, exchanges)``: a pass-through to ``upstream`` on a free
    local port, served from a thread of its own until the block ends."""
    exchanges: list[Exchange] = []
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def forward(request: web.Request) -> web.StreamResponse:
        ex = Exchange(request.method, request.path_qs, await request.read())
        exchanges.append(ex)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        session: aiohttp.ClientSession = holder["session"]
        async with session.request(
            request.method, upstream + request.path_qs, data=ex.body, headers=headers
        ) as up:
            ex.status = up.status
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                ex.response += chunk
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def start() -> web.AppRunner:
        holder["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["port"] = runner.addresses[0][1]
        return runner

    def run() -> None:
        asyncio.set_event_loop(loop)
        holder["runner"] = loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="recorder", daemon=True)
    thread.start()
    if not started.wait(30):
        raise RuntimeError("recorder did not start")
    try:
        yield f"http://127.0.0.1:{holder['port']}", exchanges
    finally:

        async def stop() -> None:
            await holder["runner"].cleanup()
            await holder["session"].close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
