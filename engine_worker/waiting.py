"""The admission queue: prepared requests that wait until all their choices fit.

FIFO with backfilling: when the head does not fit, the first later request that
does may start, so short requests keep moving while long reservations fill the
budget; once the head has waited ``backfill_max_wait`` seconds nothing passes it
until it starts, so it cannot starve. While a request waits it gets
``QueueProgress`` events: when queued and whenever its position changes, at most
every ``QUEUE_PROGRESS_INTERVAL_S``, with an ETA from the queue's measured rate
(``QueueRate``). The loop (``engine_worker.loop``) owns one ``AdmissionQueue``
and asks it which request to start next (``next_to_start``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice

from engine_worker.backend import Prepared
from protocol import QueueProgress
from protocol.messages import QUEUE_PROGRESS_INTERVAL_S


@dataclass(slots=True)
class Queued:
    """One request waiting: its ``n`` choice ids and their KV reservation, tokens."""

    prepared: Prepared
    ids: list[str]
    reservation: int  # KV tokens of all n choices
    arrived: float  # time.monotonic() when the Submit was received
    waited: bool = False  # still queued after the admission pass that queued it
    position: int = 0  # last position sent in a QueueProgress; 0: none sent
    reported_at: float = 0.0


class QueueRate:
    """How fast the queue empties: the times of the last ``window`` departures
    of requests that had to wait (a request admitted at once says nothing about
    the wait). ``eta(position, now)`` is the seconds until ``position`` more
    departures at the measured mean interval, counted from the last departure;
    ``None`` (no guess) with fewer than 3 departures, or when the last one is
    older than 3 mean intervals (the rate no longer holds: a long prefill, a
    batch of long generations)."""

    def __init__(self, window: int = 8) -> None:
        self._times: deque[float] = deque(maxlen=window)

    def departed(self, now: float) -> None:
        self._times.append(now)

    def eta(self, position: int, now: float) -> float | None:
        t = self._times
        if len(t) < 3:
            return None
        interval = (t[-1] - t[0]) / (len(t) - 1)
        if now - t[-1] > 3 * interval:
            return None
        return max(0.0, t[-1] + position * interval - now)


class AdmissionQueue:
    """The bounded wait before ``Backend.start`` (module docstring).

    ``backfill_max_wait``: seconds the head may be passed by later requests that
    fit (0: strict FIFO). ``len()`` is the number of requests waiting; ``in`` takes
    a choice id."""

    def __init__(self, backfill_max_wait: float) -> None:
        self._backfill_max_wait = backfill_max_wait
        self._queue: deque[Queued] = deque()
        self._ids: dict[str, Queued] = {}
        self._rate = QueueRate()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, choice_id: object) -> bool:
        return choice_id in self._ids

    def __iter__(self) -> Iterator[Queued]:
        return iter(self._queue)

    def get(self, choice_id: str) -> Queued | None:
        return self._ids.get(choice_id)

    def append(self, queued: Queued) -> None:
        self._queue.append(queued)
        for rid in queued.ids:
            self._ids[rid] = queued

    def remove(self, queued: Queued) -> None:
        self._queue.remove(queued)
        for rid in queued.ids:
            del self._ids[rid]

    def next_to_start(self, fits: Callable[[int, int], bool]) -> Queued | None:
        """Take the request to start now, given ``fits(n, reservation)``: the head if
        it fits; else, while the head has waited less than ``backfill_max_wait``, the
        first later one that fits; else ``None`` (it stays queued)."""
        if not self._queue:
            return None
        chosen = self._queue[0]
        if not fits(len(chosen.ids), chosen.reservation):
            if time.monotonic() - chosen.arrived >= self._backfill_max_wait:
                return None
            later = islice(self._queue, 1, None)
            found = next((q for q in later if fits(len(q.ids), q.reservation)), None)
            if found is None:
                return None
            chosen = found
        self.remove(chosen)
        if chosen.waited:
            self._rate.departed(time.monotonic())
        return chosen

    def progress(self) -> list[QueueProgress]:
        """A ``QueueProgress`` for each waiting request whose position changed (or
        that was just queued), at most every ``QUEUE_PROGRESS_INTERVAL_S``; ``time_ms``
        counts from the Submit's receipt, preparation included."""
        now = time.monotonic()
        waiting = len(self._queue)
        out: list[QueueProgress] = []
        for position, q in enumerate(self._queue, 1):
            if q.position == position or (q.position and now - q.reported_at < QUEUE_PROGRESS_INTERVAL_S):
                continue
            q.position = position
            q.reported_at = now
            eta = self._rate.eta(position, now)
            out.append(
                QueueProgress(
                    q.ids[0],
                    position,
                    waiting,
                    round((now - q.arrived) * 1000),
                    None if eta is None else round(eta * 1000),
                )
            )
        return out
