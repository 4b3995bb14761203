"""This server's progress shapes, the same in every dialect that sends them.

``prompt_progress`` is llama.cpp's (its server's ``return_progress``: ``total``,
``cache``, ``processed`` tokens and ``time_ms`` since prompt processing started);
``queue_progress`` is this server's (``docs/http-contract.md``). Each dialect
places them in its own events (chat and text completions: chunks of their own;
Responses and Messages: events of their own); whether they are sent is decided
once, by the core (``proxy.serving.serve``: ``stream`` and ``return_progress``).
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from protocol.messages import PrefillProgress, QueueProgress


class PromptProgress(msgspec.Struct, frozen=True, gc=False):
    """llama.cpp's ``prompt_progress``: tokens, and integer ms since prompt
    processing started."""

    total: int
    cache: int
    processed: int
    time_ms: int

    @classmethod
    def of(cls, ev: PrefillProgress) -> PromptProgress:
        return cls(ev.total, ev.cached, ev.processed, ev.time_ms)


class QueuePosition(msgspec.Struct, frozen=True, gc=False):
    """``queue_progress``: 1-based ``position`` among the ``queued`` requests
    waiting in the worker, ms since queued, and ``eta_ms`` only when the worker
    can estimate it (``protocol.messages.QueueProgress``)."""

    position: int
    queued: int
    time_ms: int
    eta_ms: int | UnsetType = UNSET

    @classmethod
    def of(cls, ev: QueueProgress) -> QueuePosition:
        return cls(ev.position, ev.queued, ev.time_ms, UNSET if ev.eta_ms is None else ev.eta_ms)
