"""One chat turn: stream the updates, measure the times, tell a view what happens.

The view decides how things look (``plain.PlainView`` for pipes,
``terminal.TerminalView`` for a terminal); this module decides what happened
and when. Times come from one monotonic clock, in seconds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import httpx

from launcher.chat.apis import Api, ChatRequest
from launcher.chat.client import stream_updates
from launcher.chat.stats import Counts, Prefill, Summary, summarize
from launcher.chat.wire import QueueProgress


class View(Protocol):
    """What a chat turn shows, called in this order: ``started``; any ``queued``, then
    any ``prefill``; ``thinking`` for each piece of a reasoning model's thinking and
    ``content`` for each piece of answer text; ``finished`` or ``failed``; ``close``
    always, last (it stops anything still drawing)."""

    def started(self) -> None: ...
    def queued(self, queue: QueueProgress) -> None: ...
    def prefill(self, prefill: Prefill) -> None: ...
    def thinking(self, text: str) -> None: ...
    def content(self, text: str) -> None: ...
    def finished(self, summary: Summary) -> None: ...
    def failed(self, message: str) -> None: ...
    def close(self) -> None: ...


def run_turn(
    client: httpx.Client,
    api: Api,
    request: ChatRequest,
    view: View,
    clock: Callable[[], float] = time.monotonic,
) -> Summary:
    """Stream ``request`` in ``api``'s shape through ``view`` and return its summary.

    Raises ``ChatError`` (the view has not been told; the caller says how it
    ended). Progress that arrives out of its phase is dropped: queue progress
    after prefill started, prefill progress after the first token (an engine
    that re-runs prefill mid-answer is not prefilling the user's prompt).
    """
    view.started()
    sent_at = clock()
    first_at: float | None = None
    last_at: float | None = None
    counts: Counts | None = None
    finish_reason: str | None = None
    prefilling = False
    with contextlib.closing(stream_updates(client, api, request)) as updates:
        for update in updates:
            now = clock()
            if update.counts is not None:
                # The last one wins: with vLLM's continuous_usage_stats every chunk has one.
                counts = update.counts
            if first_at is None:
                if update.queue is not None and not prefilling:
                    view.queued(update.queue)
                if update.prompt is not None:
                    prefilling = True
                    view.prefill(Prefill.of(update.prompt))
            if update.thinking:
                if first_at is None:
                    first_at = now
                last_at = now
                view.thinking(update.thinking)
            if update.text:
                if first_at is None:
                    first_at = now
                last_at = now
                view.content(update.text)
            if update.finish_reason is not None:
                finish_reason = update.finish_reason
    summary = summarize(counts, sent_at, first_at, last_at, finish_reason)
    view.finished(summary)
    return summary
