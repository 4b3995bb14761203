"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.synthetic import served_proxy, synthetic_worker


@pytest.fixture
async def one_slot_url(tmp_path: Path) -> AsyncIterator[str]:
    """Base URL of the proxy in front of a synthetic worker with one batch slot
    (20 ms steps, heartbeats every 50 ms): a second request has to wait."""
    args = ("--synthetic-step-ms", "20", "--max-batch-size", "1", "--heartbeat-interval", "0.05")
    with synthetic_worker(tmp_path, *args) as addrs:
        async with served_proxy(addrs) as url:
            yield url
