"""Choices of one request (``n > 1``: one ``Prepared`` started ``n`` times) share
one prefill, on every backend.

Started together, each choice would prefill the same prompt (the CPU engine) or
find only the pages the others fill during prefill (ExLlamaV3, ``job.py:1424-1436``),
so its ``Started`` would under-report the reused prefix. So a later choice waits,
emitting nothing, while another choice of its request is before the end of its
prefill; then the waiting ones start from that prompt, all of it cached. If the
choice in prefill ends first, the next waiting one prefills in its place.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

S = TypeVar("S")


def startable(
    sequences: Iterable[S],
    group: Callable[[S], Hashable],
    waiting: Callable[[S], bool],
    prefilled: Callable[[S], bool],
) -> list[S]:
    """Of ``sequences`` (in start order), the waiting ones that may start now: every
    waiting one of a ``group`` (one request's choices) that has a started sequence
    past its prefill (they start from its prompt), else the first waiting one of a
    group with no started sequence in prefill."""
    items = list(sequences)
    busy: set[Hashable] = set()
    ready: set[Hashable] = set()
    for s in items:
        if not waiting(s):
            (ready if prefilled(s) else busy).add(group(s))
    out: list[S] = []
    for s in items:
        key = group(s)
        if not waiting(s) or key in busy:
            continue
        out.append(s)
        if key not in ready:
            busy.add(key)  # it prefills now: the rest of its group waits for it
    return out
