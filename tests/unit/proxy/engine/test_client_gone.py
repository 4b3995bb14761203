"""A client gone at the worst moments is a 499, not a 500; a restarted worker's
load is not the dead one's."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from protocol import PROTOCOL_VERSION, Heartbeat, Ready
from proxy.engine.client import ZmqEngineClient
from tests.fakes.engine_client import FakeEngineClient, make_config
from tests.unit.proxy.conftest import MakeClient


async def test_a_client_gone_before_the_headers_is_a_499_not_a_500(
    make_client: MakeClient,
    fake: FakeEngineClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await make_client()
    real_prepare = web.StreamResponse.prepare

    async def gone(self: web.StreamResponse, request: Any) -> Any:
        if self.content_type == "text/event-stream":
            raise ConnectionResetError("Cannot write to closing transport")
        return await real_prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", gone)
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    with contextlib.suppress(aiohttp.ClientError):  # the server drops it: nobody is there
        await client.post("/v1/chat/completions", json=body)
    monkeypatch.undo()
    text = await (await client.get("/metrics")).text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    key = ("exl3_sidecar_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "499")))
    assert samples.get(key) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert fake.aborted  # its engine work was freed


def test_a_restarted_workers_load_is_not_the_dead_ones() -> None:
    client = ZmqEngineClient(make_config())
    old = Ready(PROTOCOL_VERSION, "old", "m", "b", 100)
    client._worker = old  # the state the reader keeps, set as it would be
    client._heartbeat = Heartbeat("old", 50, 3, 0.5)
    assert client.heartbeat is not None and client.worker_active_requests == 50
    client._worker = Ready(PROTOCOL_VERSION, "new", "m", "b", 100)
    assert client.heartbeat is None and client.worker_active_requests is None
