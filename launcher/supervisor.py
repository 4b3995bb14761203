"""Keep a worker child running, the way a Kubernetes pod would.

``WorkerSupervisor.run`` starts the child command, waits for it, and restarts it
when it exits, backing off while it keeps failing fast; requests in flight on
the proxy fail cleanly when their worker goes away. Only a worker that has
served is restarted: with a ``heartbeat_file``, a first child that exits before
its first beat (the model would not load: a broken folder, no GPU, a missing
package) ends ``run`` with ``WorkerNeverServed``, since the next start would fail
the same way (a restart loop at 503 tells the operator nothing). Option errors
never get this far: ``serve`` runs the worker's ``--check`` first (exit status 2).
A child that stops beating is hung (SIGSTOP, a deadlock, a stuck driver call):
with a ``heartbeat_file`` (the worker's ``--heartbeat-file``, ``protocol.liveness``)
a beat older than ``hung_after`` seconds gets the child SIGKILLed (the only signal
a stopped process acts on) and restarted like one that exited, which also clears
whatever it held. Before its first beat (the model loading) a child is never
judged. Cancelling ``run`` stops the child: SIGTERM, then SIGKILL after ``stop_timeout``
seconds. The child runs in a session of its own, so a Ctrl-C in the terminal
reaches only the parent, which drains its requests before it stops the child.

A parent killed outright (SIGKILL, OOM killer) runs none of that, so on Linux the
child is also asked to get SIGTERM when its parent dies (``PR_SET_PDEATHSIG``);
elsewhere, and for the instant between fork and that call, the worker's own
parent check (``--parent-pid``) is the backstop.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.liveness import check, read_beat

log = logging.getLogger("exl3_sidecar.supervisor")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Restart delays in seconds: ``first`` after a child that ran at least
    ``healthy_after`` seconds, doubling up to ``most`` while it keeps exiting sooner."""

    first: float = 2.0
    most: float = 30.0
    healthy_after: float = 60.0

    def next(self, previous: float | None, ran: float) -> float:
        """The delay before the next start, after a child that ran ``ran`` seconds
        and was itself started ``previous`` seconds after its predecessor
        (``None`` for the first child)."""
        if previous is None or ran >= self.healthy_after:
            return self.first
        return min(previous * 2, self.most)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class WorkerNeverServed(Exception):
    """The worker exited before its first heartbeat, and no worker before it had
    served: ``returncode`` is its exit status."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"the worker exited with code {returncode} before it served")
        self.returncode = returncode


def _die_with_parent() -> None:
    """Run in the child between fork and exec (Linux): SIGTERM when the parent dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class WorkerSupervisor:
    """Runs ``argv`` (program first) until cancelled, restarting it per ``backoff``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        backoff: Backoff = Backoff(),
        stop_timeout: float = 10.0,
        heartbeat_file: Path | None = None,
        hung_after: float = 30.0,
    ) -> None:
        self.argv = list(argv)
        self.backoff = backoff
        self.stop_timeout = stop_timeout
        self.heartbeat_file = heartbeat_file
        self.hung_after = hung_after
        self.hung_kills = 0
        """Children killed for missing heartbeats."""
        self.starts = 0
        """Children started so far."""
        self.pid: int | None = None
        """The running child's pid, else ``None``."""
        self.served = False
        """Whether a child has beaten (loaded its model and served) since ``run`` began."""

    async def run(self) -> None:
        """Start the child and keep it running; returns only by cancellation,
        which stops the child first (SIGTERM, SIGKILL after ``stop_timeout``).
        Raises ``WorkerNeverServed`` when, with a ``heartbeat_file``, the child exits
        before any child has served."""
        delay: float | None = None
        while True:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            self.starts += 1
            self.pid = proc.pid
            try:
                rc = await self._wait(proc)
            except asyncio.CancelledError:
                await self._stop(proc)
                raise
            finally:
                self.pid = None
            if self.heartbeat_file is not None and not self.served:
                log.error(
                    "worker exited with code %s before it served (its log above says why); "
                    "not restarting: the next start would fail the same way",
                    rc,
                )
                raise WorkerNeverServed(rc)
            delay = self.backoff.next(delay, time.monotonic() - started)
            log.error("worker exited with code %s; restarting in %.3g s", rc, delay)
            await asyncio.sleep(delay)

    async def _wait(self, proc: asyncio.subprocess.Process) -> int:
        """``proc``'s exit status; with a heartbeat file, SIGKILL it first when
        it has beaten and then stopped for ``hung_after`` seconds."""
        path = self.heartbeat_file
        if path is None:
            return await proc.wait()
        exited = asyncio.ensure_future(proc.wait())
        try:
            while not exited.done():
                await asyncio.wait({exited}, timeout=min(1.0, self.hung_after / 4))
                if exited.done():
                    break
                beat = await asyncio.to_thread(read_beat, path)
                if beat is None or beat.pid != proc.pid:
                    continue  # still loading: nothing to judge yet
                self.served = True
                why = check(path, max_age=self.hung_after, pid=proc.pid)
                if why is not None:
                    log.error("worker hung (%s); killing it", why)
                    self.hung_kills += 1
                    proc.kill()
                    break
            rc = await exited
            # A child that beat once and died within one poll was serving all the same.
            beat = await asyncio.to_thread(read_beat, path)
            if beat is not None and beat.pid == proc.pid:
                self.served = True
            return rc
        finally:
            exited.cancel()

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.stop_timeout)
        except TimeoutError:
            log.warning("worker ignored SIGTERM for %g s; killing it", self.stop_timeout)
            proc.kill()
            await proc.wait()
