"""Kubernetes probes stay out of the INFO access log; API requests do not."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from proxy.app import create_app
from proxy.runner import ProbeQuietAccessLogger
from tests.fakes.engine_client import FakeEngineClient, make_config


@pytest.mark.parametrize("level", [logging.INFO, logging.DEBUG])
async def test_probes_are_logged_only_at_debug(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture, level: int
) -> None:
    access = logging.getLogger("aiohttp.access")
    caplog.set_level(level, logger="aiohttp.access")
    server = TestServer(create_app(make_config(), FakeEngineClient()))
    await server.start_server(access_log_class=ProbeQuietAccessLogger, access_log=access)
    client = await aiohttp_client(server)
    for path in ("/health", "/ready", "/v1/models"):
        await client.get(path)
    logged = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert any("/v1/models" in m for m in logged)
    probes = [m for m in logged if "/health" in m or "/ready" in m]
    assert len(probes) == (2 if level == logging.DEBUG else 0)
