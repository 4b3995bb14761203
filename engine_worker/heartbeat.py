"""The worker's heartbeats, from a thread of their own, so a long engine step never
looks like a dead worker: a ``Heartbeat`` on the event socket every interval, the
same beat written to a file for probes without a ZeroMQ peer
(``protocol.liveness``), and a stop when the parent process is gone."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine_worker.kv_events import BatchSink
from engine_worker.sockets import WorkerSockets
from protocol import Heartbeat
from protocol.liveness import Beat, write_beat

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoopStats:
    """What a heartbeat reports; written by the loop thread only, read by the
    heartbeat thread (each field a plain value: a torn read is one beat stale)."""

    waiting: int = 0  # requests in the admission queue
    running: int = 0  # sequences started
    running_requests: int = 0  # requests those sequences belong to
    kv_usage: float = 0.0  # reserved KV / capacity, 0..1
    step_started: float = 0.0  # time.monotonic() of the step in progress; 0: none


class Heartbeats:
    """Sends ``Heartbeat``s for ``worker_id`` every ``interval`` seconds from
    ``start`` until ``close``; sets ``stop`` when ``parent_pid`` is no longer this
    process's parent. ``kv_events_sink``: whose drops the beats report."""

    def __init__(
        self,
        sockets: WorkerSockets,
        worker_id: str,
        stats: LoopStats,
        *,
        interval: float,
        parent_pid: int | None,
        heartbeat_file: Path | None,
        kv_events_sink: BatchSink | None,
    ) -> None:
        self._sockets = sockets
        self._worker_id = worker_id
        self._stats = stats
        self._interval = interval
        self._parent_pid = parent_pid
        self._file = heartbeat_file
        self._sink = kv_events_sink
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, stop: threading.Event) -> None:
        self._thread = threading.Thread(target=self._run, args=(stop,), name="worker-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self, stop: threading.Event) -> None:
        sender = self._sockets.sender()
        stats = self._stats
        try:
            self._write(0.0)
            while not self._done.wait(self._interval):
                if self._parent_pid is not None and os.getppid() != self._parent_pid:
                    log.error("worker: parent process %d is gone, stopping", self._parent_pid)
                    stop.set()
                started = stats.step_started
                step_s = time.monotonic() - started if started else 0.0
                sink = self._sink
                sender.send(
                    Heartbeat(
                        self._worker_id,
                        stats.running,
                        stats.waiting,
                        round(stats.kv_usage, 4),
                        step_s,
                        stats.running_requests,
                        sink.dropped if sink is not None else 0,
                    )
                )
                self._write(step_s)
        finally:
            sender.close()

    def _write(self, step_s: float) -> None:
        path = self._file
        if path is None:
            return
        try:
            write_beat(path, Beat(os.getpid(), self._worker_id, time.monotonic(), step_s))
        except OSError as e:
            # Stop trying: a probe reading the file then restarts the worker, and
            # this line says why.
            log.error("worker: cannot write the heartbeat file %s: %s", path, e)
            self._file = None
