"""The aiohttp internals ``proxy.server.runner`` relies on, checked against the
installed release so that an upgrade that changes them fails here, loudly,
rather than in a connection under load.

``EnvelopeRequestHandler`` reads ``_request_count`` (a request's headers were
parsed), ``_messages`` (the parsed requests waiting, ``(message, payload)``
tuples), ``_request_in_progress``, and swaps ``_request_handler``;
``ProxyRunner`` overrides ``AppRunner._make_server`` and retypes the
``web.Server`` it returns, which needs a ``Server`` without ``__slots__``.
"""

from __future__ import annotations

import asyncio
import re
from importlib.metadata import version
from pathlib import Path

import aiohttp
from aiohttp import web, web_protocol
from packaging.requirements import Requirement

from proxy.server import runner

ROOT = Path(__file__).resolve().parents[4]


def _declared() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r'"(aiohttp[^"]*)"', text)
    assert line is not None
    return Requirement(line.group(1))


def test_the_installed_aiohttp_is_in_the_declared_range() -> None:
    req = _declared()
    assert req.specifier, "aiohttp must be pinned to the tested range"
    assert any(s.operator == "<" for s in req.specifier), "aiohttp needs an upper bound"
    assert req.specifier.contains(version("aiohttp")), (version("aiohttp"), str(req.specifier))


def test_request_handler_still_has_the_fields_the_runner_reads() -> None:
    slots = set(web_protocol.RequestHandler.__slots__)
    assert {"_request_count", "_messages", "_request_in_progress", "_request_handler"} <= slots
    for name in ("data_received", "connection_made", "connection_lost", "force_close", "close"):
        assert callable(getattr(web_protocol.RequestHandler, name))
    assert issubclass(runner.EnvelopeRequestHandler, web_protocol.RequestHandler)


def test_server_can_be_retyped_and_runner_builds_it() -> None:
    assert "__slots__" not in web.Server.__dict__
    assert callable(getattr(web.AppRunner, "_make_server", None))
    assert aiohttp.__version__ == version("aiohttp")


async def test_the_handler_counts_and_queues_requests_as_the_runner_expects() -> None:
    """Drive a real handler with two pipelined requests: ``_request_count``
    grows as headers are parsed and ``_messages`` holds ``(message, payload)``."""

    async def ok(request: web.BaseRequest) -> web.StreamResponse:
        await asyncio.sleep(0.05)
        return web.Response(text="ok")

    server = web.Server(ok)
    loop = asyncio.get_running_loop()
    handler = web_protocol.RequestHandler(server, loop=loop)

    class Transport(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.out = bytearray()

        def write(self, data: bytes | bytearray | memoryview) -> None:
            self.out += data

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass

        def get_extra_info(self, name: str, default: object = None) -> object:
            return ("127.0.0.1", 1) if name == "peername" else default

    t = Transport()
    handler.connection_made(t)
    before = handler._request_count
    handler.data_received(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
    assert handler._request_count == before + 2
    pending = list(handler._messages)
    assert pending and all(len(m) == 2 for m in pending)
    for _ in range(100):
        if t.out.count(b"HTTP/1.1 200") == 2:
            break
        await asyncio.sleep(0.01)
    assert t.out.count(b"HTTP/1.1 200") == 2
    handler.connection_lost(None)
