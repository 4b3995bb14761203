"""Fixtures: the proxy app from ``create_app`` on a fake engine, served by
pytest-aiohttp's ``TestServer``, which builds its runner with
``handler_cancellation=True`` as ``run_proxy`` does. (What differs, the
envelope for requests aiohttp's parser refuses, is tested on
``proxy.server.runner.make_runner`` in ``tests/integration/test_http_server.py``.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from aiohttp.test_utils import TestClient
from blockbuster import blockbuster_ctx
from httpx_sse import aconnect_sse

from proxy.app import create_app
from tests.fakes.engine_client import FakeEngineClient, make_config

MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def fake() -> FakeEngineClient:
    return FakeEngineClient()


@pytest.fixture
def make_client(aiohttp_client: Any, fake: FakeEngineClient) -> MakeClient:
    """``await make_client(**config_overrides)`` -> aiohttp TestClient of the proxy on ``fake``."""

    async def go(**overrides: Any) -> TestClient[Any, Any]:
        client: TestClient[Any, Any] = await aiohttp_client(create_app(make_config(**overrides), fake))
        return client

    return go


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


async def sse_json(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[Any]:
    """POST ``body`` and parse the SSE reply with httpx-sse: each event's data as
    JSON, ``"[DONE]"`` kept as the string."""
    out: list[Any] = []
    async with aconnect_sse(http, "POST", url, json=body) as source:
        assert source.response.status_code == 200
        async for ev in source.aiter_sse():
            out.append(ev.data if ev.data == "[DONE]" else orjson.loads(ev.data))
    return out


async def sse_events(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], status: int = 200
) -> list[tuple[str, Any]]:
    """POST ``body`` and parse the SSE reply with httpx-sse: ``(event name,
    data as JSON)`` per event (the name is ``message`` for unnamed events)."""
    out: list[tuple[str, Any]] = []
    async with aconnect_sse(http, "POST", url, json=body) as source:
        assert source.response.status_code == status
        async for ev in source.aiter_sse():
            out.append((ev.event, orjson.loads(ev.data)))
    return out


@pytest.fixture(autouse=True)
def no_blocking_calls() -> Iterator[None]:
    """Fail a test when code of the ``proxy`` package makes a blocking call (file
    or socket I/O, sleep) on the event loop, as aiohttp's own suite does. Test
    code and client libraries are not checked."""
    with blockbuster_ctx("proxy"):
        yield
