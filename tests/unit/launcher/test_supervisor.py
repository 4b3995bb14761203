"""``serve``'s supervision of its worker child: backoff, restart, stopping it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import pytest

from launcher.supervisor import Backoff, WorkerSupervisor


def test_backoff_doubles_while_the_child_fails_fast_and_resets_after_a_healthy_run() -> None:
    b = Backoff(first=2.0, most=30.0, healthy_after=60.0)
    delays: list[float] = []
    d: float | None = None
    for _ in range(6):
        d = b.next(d, ran=0.5)
        delays.append(d)
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert b.next(30.0, ran=61.0) == 2.0


def _child(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(
        "import os, signal, sys, time\n"
        f"log = open({str(tmp_path / 'log')!r}, 'a')\n"
        "log.write(f'start {os.getpid()}\\n'); log.flush()\n" + body
    )
    return [sys.executable, str(script)]


def _log(tmp_path: Path) -> list[str]:
    p = tmp_path / "log"
    return p.read_text().split("\n")[:-1] if p.exists() else []


async def _until(cond: object, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


async def test_a_child_that_exits_is_restarted_with_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sup = WorkerSupervisor(_child(tmp_path, "sys.exit(3)\n"), backoff=Backoff(first=0.05, most=0.2))
    task = asyncio.create_task(sup.run())
    try:
        await _until(lambda: len(_log(tmp_path)) >= 4)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    pids = {line.split()[1] for line in _log(tmp_path)}
    assert len(pids) >= 4  # a new process each time
    restarts = [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()]
    assert restarts[:3] == [f"worker exited with code 3; restarting in {d} s" for d in ("0.05", "0.1", "0.2")]


async def test_cancelling_sends_sigterm_and_waits_for_the_child(tmp_path: Path) -> None:
    body = (
        "signal.signal(signal.SIGTERM, lambda *a: (log.write('sigterm\\n'), log.flush(), sys.exit(0)))\n"
        "time.sleep(60)\n"
    )
    sup = WorkerSupervisor(_child(tmp_path, body))
    task = asyncio.create_task(sup.run())
    await _until(lambda: len(_log(tmp_path)) == 1)
    pid = sup.pid
    assert pid is not None and _alive(pid)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _log(tmp_path)[-1] == "sigterm" and not _alive(pid) and sup.starts == 1


async def test_a_child_ignoring_sigterm_is_killed_after_stop_timeout(tmp_path: Path) -> None:
    body = (
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nlog.write('ready\\n'); log.flush()\ntime.sleep(60)\n"
    )
    sup = WorkerSupervisor(_child(tmp_path, body), stop_timeout=0.3)
    task = asyncio.create_task(sup.run())
    await _until(lambda: "ready" in _log(tmp_path))
    pid = sup.pid
    assert pid is not None
    t0 = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0.3 <= time.monotonic() - t0 < 5 and not _alive(pid)


async def test_the_child_has_a_session_of_its_own(tmp_path: Path) -> None:
    # Ctrl-C in a terminal signals the foreground process group: only serve gets
    # it, and serve drains its requests before it stops the worker.
    body = "log.write(f'sid {os.getsid(0)}\\n'); log.flush()\ntime.sleep(60)\n"
    sup = WorkerSupervisor(_child(tmp_path, body))
    task = asyncio.create_task(sup.run())
    try:
        await _until(lambda: len(_log(tmp_path)) == 2)
        assert _log(tmp_path)[1] == f"sid {sup.pid}" and os.getsid(0) != sup.pid
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _beating_child(tmp_path: Path, beat: Path, then: str) -> list[str]:
    """A child that writes one heartbeat of its own pid to ``beat`` (what a worker does
    once its model is loaded and it serves), then runs ``then``."""
    body = (
        "import json\n"
        f"open({str(beat)!r}, 'w').write(json.dumps({{'pid': os.getpid(), 'worker_id': 'w', "
        "'at': time.time()}))\n" + then
    )
    return _child(tmp_path, body)


async def test_a_child_that_exits_before_it_served_is_not_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from launcher.supervisor import WorkerNeverServed

    sup = WorkerSupervisor(
        _child(tmp_path, "sys.exit(1)\n"),
        backoff=Backoff(first=0.05, most=0.2),
        heartbeat_file=tmp_path / "beat",
    )
    with pytest.raises(WorkerNeverServed) as e:
        await asyncio.wait_for(sup.run(), 20)
    assert e.value.returncode == 1 and sup.starts == 1 and len(_log(tmp_path)) == 1
    assert any("before it served" in r.getMessage() for r in caplog.records)


async def test_a_child_that_served_and_then_died_is_restarted(tmp_path: Path) -> None:
    beat = tmp_path / "beat"
    sup = WorkerSupervisor(
        _beating_child(tmp_path, beat, "sys.exit(3)\n"),
        backoff=Backoff(first=0.05, most=0.2),
        heartbeat_file=beat,
    )
    task = asyncio.create_task(sup.run())
    try:
        await _until(lambda: len(_log(tmp_path)) >= 3)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert sup.served and sup.starts >= 3
