"""The events that open a sequence, and a small cache of per-request sampler tables."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from protocol.messages import Event, PrefillProgress, Started

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def opening(request_id: str, prompt_tokens: int, cached: int, time_ms: int) -> list[Event]:
    """``Started`` and the first ``PrefillProgress`` (``processed == cached``), which
    every backend emits together no later than the first step after ``start``
    (``engine_worker.backend.Backend``)."""
    return [
        Started(request_id, prompt_tokens, cached),
        PrefillProgress(request_id, prompt_tokens, cached, cached, time_ms),
    ]


class Recent(Generic[K, V]):
    """The last ``size`` values ``make`` computed, by key (oldest out first): tables a
    request's sampler needs that take a pass over the vocabulary to build (DRY's
    sequence breakers), kept for the next request with the same ones."""

    def __init__(self, make: Callable[[K], V], size: int = 8) -> None:
        self._make = make
        self._size = size
        self._values: dict[K, V] = {}

    def __call__(self, key: K) -> V:
        value = self._values.get(key)
        if value is None:
            value = self._make(key)
            if len(self._values) >= self._size:
                self._values.pop(next(iter(self._values)))
            self._values[key] = value
        return value
