"""The chat view for a terminal, drawn with rich.

While the server works, a live line on stderr: a spinner while waiting or
queued (position, time waited since the request was sent, eta), then a prefill bar whose cached part has a
colour of its own, with tokens/s and eta. At the first answer token the live
line is replaced by one lasting line that sums up the wait and the prefill, and
the answer streams to stdout. At the end, the usage line on stderr.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, RenderableType
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from launcher.chat.stats import Prefill, Summary, prefill_text, queue_text, usage_text
from launcher.chat.wire import QueueProgress

CACHED_STYLE = "cyan"
COMPUTED_STYLE = "green"
PENDING_STYLE = "grey37"
STATUS_STYLE = "dim"
THINKING_STYLE = "dim italic"
"""A reasoning model's thinking, printed before its answer and set apart from it."""
BAR_MAX_WIDTH = 40


def prefill_bar(p: Prefill, width: int) -> Text:
    """``width`` cells: the cached prefix, the part computed so far, the rest, each in its colour."""
    if p.total <= 0:
        return Text("━" * width, style=PENDING_STYLE)
    cached = min(width, width * p.cache // p.total)
    done = max(min(width, width * p.processed // p.total) - cached, 0)
    return Text.assemble(
        ("━" * cached, CACHED_STYLE),
        ("━" * done, COMPUTED_STYLE),
        ("━" * (width - cached - done), PENDING_STYLE),
    )


class TerminalView:
    """``session.View`` for a terminal: ``out`` gets the answer, ``err`` the live status
    and the usage. ``clock`` (seconds, monotonic) ticks the waiting times between chunks."""

    def __init__(self, out: Console, err: Console, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._err = err
        self._clock = clock
        self._started_at = 0.0
        self._queue: QueueProgress | None = None
        # Waits are timed on this clock from the request's start, not from the server's time_ms:
        # the server counts from its receipt, and the live count must not jump back when the
        # first queue event replaces "waiting for the server".
        self._waited_s: float | None = None  # time spent until prefill started, known once it has
        self._prefill: Prefill | None = None
        self._answer_open = False
        self._thinking_open = False  # dimmed thinking printed, the answer not started yet
        self._live_done = False
        # One spinner for the whole wait: a spinner turns by the time since its first frame,
        # so a new one per refresh would show its first frame forever.
        self._spinner = Spinner("dots")
        # Drawn from rich's refresh thread: live_line reads each field once, this thread assigns whole
        # values. Built last: Live renders once on construction.
        self._live = Live(
            console=err,
            transient=True,
            refresh_per_second=10,
            redirect_stdout=False,
            redirect_stderr=False,
            get_renderable=self.live_line,
        )

    def started(self) -> None:
        self._started_at = self._clock()
        self._live.start()

    def queued(self, queue: QueueProgress) -> None:
        self._queue = queue

    def prefill(self, prefill: Prefill) -> None:
        if self._prefill is None and self._queue is not None:
            self._waited_s = self._clock() - self._started_at
        self._prefill = prefill

    def thinking(self, text: str) -> None:
        self._stop_live()
        self._out.print(
            Text(text, style=THINKING_STYLE),
            end="",
            markup=False,
            emoji=False,
            highlight=False,
            soft_wrap=True,
        )
        self._thinking_open = True

    def content(self, text: str) -> None:
        self._stop_live()
        if self._thinking_open:
            self._out.print()  # the answer starts on a line of its own, after the dimmed thinking
            self._out.print()
            self._thinking_open = False
        self._out.print(text, end="", markup=False, emoji=False, highlight=False, soft_wrap=True)
        self._answer_open = not text.endswith("\n")

    def finished(self, summary: Summary) -> None:
        self._stop_live()
        self._end_answer()
        self._err.print(Text(f"usage: {usage_text(summary)}", style=STATUS_STYLE))

    def failed(self, message: str) -> None:
        self._stop_live()
        self._end_answer()
        self._err.print(Text.assemble(("error: ", "bold red"), message))

    def close(self) -> None:
        self._stop_live()

    def _end_answer(self) -> None:
        if self._thinking_open:
            self._out.print()
            self._thinking_open = False
        if self._answer_open:
            self._out.print()
            self._answer_open = False

    def _stop_live(self) -> None:
        if self._live_done:
            return
        self._live_done = True
        self._live.stop()
        # The live line is transient; what it ended on stays as one line.
        parts = []
        if self._queue is not None:
            waited = self._waited_s
            if waited is None:  # left the queue without a prefill chunk
                waited = self._clock() - self._started_at
            parts.append(f"queued {waited:.1f} s")
        if self._prefill is not None:
            parts.append(f"prefill {prefill_text(self._prefill)}")
        if parts:
            self._err.print(Text(" · ".join(parts), style=STATUS_STYLE))

    def live_line(self) -> RenderableType:
        """What the live line shows now (rich's refresh thread calls this ten times a second)."""
        now = self._clock()
        prefill, queue = self._prefill, self._queue
        if prefill is not None:
            width = max(10, min(BAR_MAX_WIDTH, self._err.width - 60))
            line = Text.assemble(
                "prefill ",
                prefill_bar(prefill, width),
                f" {prefill.processed}/{prefill.total} tokens · ",
                (f"cached {prefill.cache}", CACHED_STYLE),
            )
            if prefill.rate_tok_s is not None:
                line.append(f" · {prefill.rate_tok_s:.0f} tok/s")
            if prefill.eta_s is not None and not prefill.done:
                line.append(f" · eta {prefill.eta_s:.1f} s")
            return line
        if queue is not None:
            waited = now - self._started_at
            self._spinner.update(text=Text(f"queued: {queue_text(queue, waited)}"))
        else:
            waiting = f"waiting for the server, {now - self._started_at:.1f} s"
            self._spinner.update(text=Text(waiting, style=STATUS_STYLE))
        return self._spinner
