"""``python -m engine_worker.probe``: the worker container's exec probes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_worker.cli import main as worker_command
from engine_worker.probe import main
from protocol.liveness import HEARTBEAT_FILE_ENV, Beat, check, read_beat, write_beat
from tests.unit.deploy.support import envvars_of

ROOT = Path(__file__).resolve().parents[3]


def test_live_follows_the_age_of_the_last_beat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "hb"
    assert main(["live", "--file", str(f)]) == 1
    assert "no heartbeat" in capsys.readouterr().out
    write_beat(f, Beat(123, "w", time.monotonic()))
    assert main(["live", "--file", str(f), "--max-age", "5"]) == 0
    write_beat(f, Beat(123, "w", time.monotonic() - 6))
    assert main(["live", "--file", str(f), "--max-age", "5"]) == 1
    assert "last heartbeat 6." in capsys.readouterr().out


def test_live_fails_a_step_that_runs_too_long(tmp_path: Path) -> None:
    f = tmp_path / "hb"
    write_beat(f, Beat(1, "w", time.monotonic(), step_s=400.0))
    assert main(["live", "--file", str(f), "--max-age", "5"]) == 0  # steps not judged by default
    assert main(["live", "--file", str(f), "--max-age", "5", "--max-step", "300"]) == 1
    write_beat(f, Beat(1, "w", time.monotonic(), step_s=10.0))
    assert main(["live", "--file", str(f), "--max-age", "5", "--max-step", "300"]) == 0


def test_a_garbled_or_foreign_file_is_not_a_beat(tmp_path: Path) -> None:
    f = tmp_path / "hb"
    f.write_text("{not json")
    assert read_beat(f) is None and check(f, max_age=5) is not None
    write_beat(f, Beat(7, "w", time.monotonic()))
    assert check(f, max_age=5, pid=7) is None and check(f, max_age=5, pid=8) is not None


def test_the_probe_reads_the_workers_own_variable(tmp_path: Path) -> None:
    """The worker's --heartbeat-file and the probe read one variable, so the pod sets it once."""
    assert HEARTBEAT_FILE_ENV in envvars_of(worker_command)
    f = tmp_path / "hb"
    write_beat(f, Beat(1, "w", time.monotonic()))
    env = {**os.environ, HEARTBEAT_FILE_ENV: str(f), "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "engine_worker.probe", "live"], env=env, check=False)
    assert r.returncode == 0
    # A probe runs every few seconds: it must not import the engine (torch) to answer.
    assert time.monotonic() - started < 2.0


def test_wait_port_closed_returns_when_the_listener_goes(tmp_path: Path) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    started = time.monotonic()
    assert main(["wait-port-closed", "--port", str(port), "--timeout", "0.5", "--interval", "0.05"]) == 0
    assert time.monotonic() - started >= 0.5  # still listening: waited the whole timeout
    srv.close()
    started = time.monotonic()
    assert main(["wait-port-closed", "--port", str(port), "--timeout", "10"]) == 0
    assert time.monotonic() - started < 1.0
