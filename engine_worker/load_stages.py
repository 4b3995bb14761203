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
do): ``convert`` (the embedded GGUF, first start only), ``load_weights``,
``quantize`` (CPU engine; skipped when the quantized weights are cached),
``warm_up``, then ``ready``. Each change also goes to ``listener`` (a
``LoadStatus``), so whatever reports the worker's state elsewhere can show it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("engine_worker.load")


class Stage(enum.StrEnum):
    """A load stage; the values are what ``LoadStatus.stage`` carries."""

    CONVERT = "convert"
    LOAD_WEIGHTS = "load_weights"
    QUANTIZE = "quantize"
    WARM_UP = "warm_up"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class LoadStatus:
    """Where a load is: ``stage``, ``done`` of ``total`` units (``total`` 0: no count
    for this stage), ``elapsed_s`` since the stage began."""

    stage: Stage
    done: int
    total: int
    elapsed_s: float


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
        return LoadStatus(self._stage, self._done, self._total, self._clock() - self._started)

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
