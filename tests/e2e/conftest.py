"""Real servers for end-to-end tests: ``exl3-sidecar serve`` on the embedded
model, started once per session as a subprocess (worker + proxy, ipc sockets),
exactly as the README's serve command runs it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

# First start on a fresh machine converts the GGUF (about 20 s on 2 cores).
STARTUP_TIMEOUT_S = 300.0


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def worker_pid(self) -> int:
        """The worker child of ``serve`` (Linux /proc)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                return int(stat.parent.name)
        raise LookupError("worker process not found")

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                r = httpx.get(f"{self.base_url}/ready", timeout=2)
                if r.status_code == 200:
                    body: dict[str, object] = r.json()
                    return body
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready:\n{self.log_path.read_text()[-4000:]}")


def _free_port() -> int:
    """A free port: any, or the first free one of ``$E2E_PORTS`` (``5300-5309``)
    on a machine where each user keeps to a range of ports."""
    first, _, last = os.environ.get("E2E_PORTS", "").partition("-")
    candidates = range(int(first), int(last or first) + 1) if first else range(0, 1)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no free port in E2E_PORTS={os.environ['E2E_PORTS']}")


def start_server(tmp: Path, *args: str, port: int | None = None) -> Server:
    """``serve *args`` on ``port`` (a free one when ``None``), ready."""
    port = port or _free_port()
    log_path = tmp / f"serve-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3_SIDECAR_")}
    with log_path.open("wb") as log_file:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", "serve", "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        server.wait_ready()
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Plain server: no drafting."""
    s = start_server(tmp_path_factory.mktemp("serve"), "--sse-ping-interval", "1")
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def drafting_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Server with n-gram speculative decoding."""
    s = start_server(tmp_path_factory.mktemp("serve-ngram"), "--draft-mode", "ngram")
    yield s
    stop_server(s)
