"""What a worker says while it starts: its load stages, with progress.

A start used to print the model's "Loading weights 100%" bar and then nothing for
10-39 s (the CPU engine quantizing its weights on a busy machine) before the
worker served. ``LoadReporter`` names each stage as it begins, its progress at
most once per ``every`` seconds while it runs (a stage shorter than that prints
only its start and end), and the seconds it took:

    load: quantize weights (int4): started
    load: quantize weights (int4): 12/30 layers (40%), 1.0 s
    load: quantize weights (int4): done in 2.3 s

Stages, in the order a start goes through them (a backend skips what it does not
do): ``import`` (the engine's packages), ``convert`` (the embedded GGUF, first start only), ``load_weights``,
``quantize`` (CPU engine; skipped when the quantized weights are cached),
``warm_up``, then ``ready``. Each change also goes to ``listener`` (a
``LoadStatus``), so whatever reports the worker's state elsewhere can show it
(``LoadAnnouncer``: the proxy, as ``protocol.messages.Loading``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.messages import Loading

log = logging.getLogger("engine_worker.load")


class Stage(enum.StrEnum):
    """A load stage; the values are what ``LoadStatus.stage`` carries."""

    IMPORT = "import"
    CONVERT = "convert"
    LOAD_WEIGHTS = "load_weights"
    KERNELS = "kernels"
    QUANTIZE = "quantize"
    WARM_UP = "warm_up"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class LoadStatus:
    """Where a load is: ``stage`` (shown as ``label``), ``done`` of ``total`` units
    (``total`` 0: no count for this stage), ``elapsed_s`` since the stage began,
    at ``at`` (the reporter's clock)."""

    stage: Stage
    done: int
    total: int
    elapsed_s: float
    label: str = ""
    at: float = 0.0


class LoadReporter:
    """Logs the stages of one start (see the module docstring) and hands each change
    to ``listener``. ``clock`` is ``time.monotonic`` (tests pass their own). Use it
    from one thread."""

    def __init__(
        self,
        listener: Callable[[LoadStatus], None] | None = None,
        *,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._listener = listener
        self._every = every
        self._clock = clock
        self._stage: Stage | None = None
        self._label = ""
        self._unit = ""
        self._total = 0
        self._done = 0
        self._started = 0.0
        self._logged = 0.0

    @property
    def status(self) -> LoadStatus | None:
        """The current stage's status, ``None`` before the first."""
        if self._stage is None:
            return None
        now = self._clock()
        return LoadStatus(self._stage, self._done, self._total, now - self._started, self._name(), now)

    def stage(self, stage: Stage, label: str = "", *, total: int = 0, unit: str = "") -> None:
        """Begin ``stage`` (ending the one before), shown as ``label`` (default: its
        name), counting ``total`` ``unit`` when ``total`` > 0."""
        self._end()
        self._stage, self._label, self._total, self._unit, self._done = stage, label, total, unit, 0
        self._started = self._logged = self._clock()
        if stage is Stage.READY:
            log.info("load: ready")
        else:
            log.info("load: %s: started", self._name())
        self._notify()

    def set_total(self, total: int) -> None:
        """The current stage counts ``total`` units (known only once it runs)."""
        self._total = total

    def advance(self, done: int) -> None:
        """``done`` units of the current stage are done; logged when ``every``
        seconds have passed since the stage began or was last logged."""
        self._done = done
        now = self._clock()
        if now - self._logged >= self._every:
            self._logged = now
            share = f" ({100 * done // self._total}%)" if self._total else ""
            count = f"{done}/{self._total} {self._unit}".rstrip() if self._total else f"{done} {self._unit}"
            log.info("load: %s: %s%s, %.1f s", self._name(), count.strip(), share, now - self._started)
            self._notify()

    def ready(self) -> None:
        """The last stage: the worker serves."""
        self.stage(Stage.READY)

    def _end(self) -> None:
        if self._stage is not None and self._stage is not Stage.READY:
            log.info("load: %s: done in %.1f s", self._name(), self._clock() - self._started)

    def _name(self) -> str:
        if self._label:
            return self._label
        return self._stage.value.replace("_", " ") if self._stage is not None else ""

    def _notify(self) -> None:
        status = self.status
        if self._listener is not None and status is not None:
            self._listener(status)


class LoadAnnouncer:
    """Tells the proxy where the load is: a thread that sends ``Loading`` (through
    ``send``, a ``Sender``'s, made and used on that thread) when the stage changes
    and every ``every`` seconds in between, so a long stage without progress
    (a conversion, an import) still shows it is alive. ``update`` is the
    ``LoadReporter``'s listener; ``stop`` ends the thread before the worker's
    first ``Ready`` (after it, no ``Loading`` is sent)."""

    def __init__(
        self,
        worker_id: str,
        make_send: Callable[[], tuple[Callable[[Loading], object], Callable[[], None]]],
        *,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._worker_id = worker_id
        self._make_send = make_send
        self._every = every
        self._clock = clock
        self._began = clock()
        self._status: LoadStatus | None = None
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-loading", daemon=True)

    def start(self) -> LoadAnnouncer:
        self._thread.start()
        return self

    def update(self, status: LoadStatus) -> None:
        self._status = status  # one reference swap: read whole by the thread
        self._changed.set()

    def message(self) -> Loading | None:
        """The ``Loading`` for the latest status, its time brought up to now."""
        status = self._status
        if status is None or status.stage is Stage.READY:
            return None
        now = self._clock()
        return Loading(
            self._worker_id,
            status.stage.value,
            status.label,
            status.done,
            status.total,
            int((status.elapsed_s + now - status.at) * 1000),
            int((now - self._began) * 1000),
        )

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(5)

    def _run(self) -> None:
        send, close = self._make_send()
        try:
            while not self._stop.is_set():
                self._changed.wait(self._every)
                self._changed.clear()
                if self._stop.is_set():
                    break
                msg = self.message()
                if msg is not None:
                    send(msg)
        finally:
            close()
