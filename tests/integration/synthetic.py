"""A real synthetic worker process and the real proxy in front of it, for the
integration tests that need the whole event path without a model."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from proxy.app import LISTEN_BACKLOG, create_app
from proxy.engine.client import ZmqEngineClient
from proxy.server.runner import make_runner
from proxy.settings import ProxySettings


@contextlib.contextmanager
def synthetic_worker(tmp_path: Path, *args: str) -> Iterator[tuple[str, str]]:
    """``python -m engine_worker --backend synthetic *args`` on ipc:// sockets in
    ``tmp_path``; yields ``(input_addr, output_addr)``, terminates it after."""
    addrs = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    command = [sys.executable, "-m", "engine_worker", "--backend", "synthetic", *args]
    proc = subprocess.Popen([*command, "--input-addr", addrs[0], "--output-addr", addrs[1]])
    try:
        yield addrs
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.asynccontextmanager
async def served_proxy(addrs: tuple[str, str], **settings: Any) -> AsyncIterator[str]:
    """The proxy served as ``run_proxy`` serves it (its runner and listen
    backlog) on a free loopback port, once ``/ready``; yields its base URL."""
    config = ProxySettings(input_addr=addrs[0], output_addr=addrs[1], **settings)
    runner = make_runner(create_app(config, ZmqEngineClient(config)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=LISTEN_BACKLOG)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with httpx.AsyncClient() as c:
            deadline = time.monotonic() + 30
            while (await c.get(url + "/ready")).status_code != 200:
                assert time.monotonic() < deadline, "worker not ready"
                await asyncio.sleep(0.1)
        yield url
    finally:
        await runner.cleanup()
