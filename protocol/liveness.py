"""The worker's heartbeat file: its liveness where no ZeroMQ peer is needed to see it.

The worker's heartbeat thread (``engine_worker/loop.py``) rewrites one small JSON
file every ``heartbeat_interval`` when ``--heartbeat-file`` is set. Three readers
judge it with ``check``: ``serve``'s supervisor (``launcher/supervisor.py``), which
kills and restarts a worker whose beats stop; the worker container's Kubernetes
probe (``python -m engine_worker.probe``); and tests. A frozen process (SIGSTOP, a
deadlocked interpreter, a node under swap) stops beating, so its file ages.

The file holds ``{"pid": int, "worker_id": str, "at": float, "step_s": float}``:
``at`` is ``time.monotonic()`` of the writer (``CLOCK_MONOTONIC``, one clock for
every process of a host or container, unmoved by NTP steps), ``step_s`` the
seconds the engine thread had then spent in its current step (0 between steps;
it grows while a step hangs even though the heartbeat thread still runs). Each
write replaces the file atomically (``os.replace``), so a reader never sees half
of one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HEARTBEAT_FILE_ENV = "EXL3_SIDECAR_HEARTBEAT_FILE"
"""The variable of the worker's ``--heartbeat-file`` option, which the probe also reads."""


@dataclass(frozen=True, slots=True)
class Beat:
    """One heartbeat as written to the file (fields in the module docstring)."""

    pid: int
    worker_id: str
    at: float
    step_s: float = 0.0


def write_beat(path: Path, beat: Beat) -> None:
    """Replace ``path`` with ``beat`` atomically. Raises ``OSError`` when the
    directory is not writable."""
    tmp = path.with_name(f".{path.name}.{beat.pid}.tmp")
    tmp.write_text(json.dumps(asdict(beat)))
    os.replace(tmp, path)


def read_beat(path: Path) -> Beat | None:
    """The last beat in ``path``; ``None`` when there is no file yet or it cannot
    be read or parsed (a reader treats that as no beat)."""
    try:
        raw = json.loads(path.read_text())
        return Beat(int(raw["pid"]), str(raw["worker_id"]), float(raw["at"]), float(raw.get("step_s", 0.0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(
    path: Path, *, max_age: float, max_step: float = 0.0, pid: int | None = None, now: float | None = None
) -> str | None:
    """Why the worker that writes ``path`` is not live, or ``None`` when it is.

    Not live: no readable beat (or one of another ``pid`` than the one asked
    about), a beat older than ``max_age`` seconds, or (with ``max_step`` > 0) an
    engine step running longer than ``max_step`` seconds at the last beat.
    """
    beat = read_beat(path)
    if beat is None:
        return f"no heartbeat in {path}"
    if pid is not None and beat.pid != pid:
        return f"{path} holds pid {beat.pid}'s heartbeat, not pid {pid}'s"
    age = (time.monotonic() if now is None else now) - beat.at
    if age > max_age:
        return f"worker pid {beat.pid}: last heartbeat {age:.1f} s ago (more than {max_age:g} s)"
    step = beat.step_s + max(0.0, age) if beat.step_s else 0.0
    if max_step > 0 and step > max_step:
        return f"worker pid {beat.pid}: one engine step has run for {step:.1f} s (more than {max_step:g} s)"
    return None
