"""The interface every engine backend implements (CPU engine, ExLlamaV3).

The worker loop (``engine_worker.loop``) owns the sockets and calls a backend
from one thread only: ``add``/``abort`` between ``step`` calls, never
concurrently. A backend converts its engine's native results into
``protocol.messages`` events at one place and never forwards native dicts.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from protocol.messages import ErrorCode, Event, Submit


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the worker announces in ``Ready``. ``max_context_tokens`` is the
    longest prompt + completion the backend accepts, in tokens."""

    model_id: str
    max_context_tokens: int
    drafting: str | None


class RequestRejected(Exception):
    """Raised by ``Backend.add`` when a request cannot be admitted (prompt too
    long for the context, invalid parameters). The loop turns it into a
    ``RequestError`` event; nothing else is affected."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class Backend(Protocol):
    """An engine that advances many sequences in steps.

    Event order per request is documented in ``protocol.messages``. A backend
    must emit ``Started`` and the first ``PrefillProgress`` (``processed ==
    cached``) no later than the first ``step`` after ``add``, a last
    ``PrefillProgress`` with ``processed == total`` before the first
    ``TokenDelta``, and exactly one terminal event (``Finished`` or
    ``RequestError``) for every request it admitted and did not abort.
    """

    @property
    def info(self) -> ModelInfo: ...

    def add(self, submit: Submit) -> None:
        """Admit a request whose id is not active (the loop checks that). Raises
        ``RequestRejected``; work starts in ``step``."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop a request and free its engine memory now; unknown ids are ignored.
        The id leaves ``active_ids`` even when freeing fails. No further events are
        emitted for it."""
        ...

    def active_ids(self) -> Collection[str]:
        """Ids admitted and not yet finished, failed or aborted: the one record of
        them in the worker (the loop reads it for duplicate ids, heartbeats and
        failing a broken step's requests)."""
        ...

    def step(self) -> list[Event]:
        """Advance every active request by at most one engine step (one prefill
        chunk, or one decode/verify pass) and return the events produced, in
        order. Returns ``[]`` quickly when idle."""
        ...

    def close(self) -> None:
        """Release the model and its memory."""
        ...
