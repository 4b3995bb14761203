"""The chat view for pipes and logs: plain lines, no escape codes.

The answer goes to ``out`` (stdout) as it arrives and nothing else does, so
``exl3-sidecar chat ... > answer.txt`` keeps only the answer. Status goes to
``err`` (stderr), one line per event worth a line::

    queued: position 2 of 3, waited 0.4 s
    prefill: 512/1024 tokens (cached 256), 830 tok/s, eta 0.3 s
    usage: prompt 1024 (cached 256, 25%), completion 64, drafts accepted 40/50 (80%), ttft 1.23 s, ...
    error: ...
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from launcher.chat.stats import Prefill, Summary, prefill_text, queue_text, usage_text
from launcher.chat.wire import QueueProgress

PREFILL_LINE_INTERVAL_S = 0.5
"""Least time between two prefill lines: a 64k-token prefill sends hundreds of progress
chunks, a log wants a line or two a second. The first line and the 100% line always print."""


class PlainView:
    """``session.View`` writing lines; ``clock`` (seconds, monotonic) paces the prefill lines."""

    def __init__(self, out: TextIO, err: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._err = err
        self._clock = clock
        self._queue_shown: tuple[int, int] | None = None
        self._prefill_shown_at: float | None = None
        self._prefill_done_shown = False
        self._answer_open = False  # answer text written and not yet ended by a newline
        self._thinking_open = False  # thinking written to err and not yet ended by a newline

    def started(self) -> None:
        pass

    def queued(self, queue: QueueProgress) -> None:
        # A line when the place changes; the server already sends one at most every 250 ms.
        if (queue.position, queue.queued) != self._queue_shown:
            self._queue_shown = (queue.position, queue.queued)
            self._status(f"queued: {queue_text(queue)}")

    def prefill(self, prefill: Prefill) -> None:
        now = self._clock()
        if prefill.done:
            if self._prefill_done_shown:
                return
            self._prefill_done_shown = True
        elif self._prefill_shown_at is not None and now - self._prefill_shown_at < PREFILL_LINE_INTERVAL_S:
            return
        self._prefill_shown_at = now
        self._status(f"prefill: {prefill_text(prefill)}")

    def thinking(self, text: str) -> None:
        # Thinking goes to stderr with the status lines: stdout stays the answer alone.
        self._err.write(text)
        self._err.flush()
        self._thinking_open = not text.endswith("\n")

    def content(self, text: str) -> None:
        if self._thinking_open:
            self._err.write("\n")
            self._thinking_open = False
        self._out.write(text)
        self._out.flush()  # a reader at the other end of the pipe sees each token as it comes
        self._answer_open = not text.endswith("\n")

    def finished(self, summary: Summary) -> None:
        self._end_answer()
        self._status(f"usage: {usage_text(summary)}")

    def failed(self, message: str) -> None:
        self._end_answer()
        self._status(f"error: {message}")

    def close(self) -> None:
        self._out.flush()
        self._err.flush()

    def _end_answer(self) -> None:
        if self._thinking_open:
            self._err.write("\n")
            self._thinking_open = False
        if self._answer_open:
            self._out.write("\n")
            self._out.flush()
            self._answer_open = False

    def _status(self, line: str) -> None:
        self._err.write(line + "\n")
        self._err.flush()
