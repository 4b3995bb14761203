"""The ``top`` view for a terminal, drawn with rich on the alternate screen.

A header (the worker's load; in flight, rates over the last interval, the cache
and draft ratios; the sort and the keys), then a table of the requests in flight
with a progress bar for the queue (full at the front) and for the prefill (the
cached part in a colour of its own), redrawn at each snapshot and each key.

Keys (read from the terminal in cbreak mode, restored on exit): ``s`` the next
sort order (``model.SORTS``), ``q`` quit; Ctrl-C quits too.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from launcher.chat.client import ChatError
from launcher.chat.terminal import CACHED_STYLE, COMPUTED_STYLE, PENDING_STYLE
from launcher.top.model import (
    SORTS,
    Rates,
    RateWindow,
    drafts_text,
    rate,
    rates_line,
    seconds,
    short_id,
    sort_requests,
    worker_lines,
)
from proxy.ops.status_types import RequestStatus, Status

QUEUE_STYLE = "yellow"
STAGE_STYLES = {"decode": "green", "prefill": "cyan", "queued": "yellow", "submitted": "dim", "done": "dim"}
BAR_WIDTH = 20
PENDING = "─"
"""The part of a bar still to go: thinner as well as greyer, so a capture without colours reads too."""
KEYS_HINT = "s: sort · q: quit"


def queue_bar(position: int, queued: int, width: int = BAR_WIDTH) -> Text:
    """``width`` cells, filled by the share of the queue ahead of the request
    that is gone: position 1 (next to start) is full, last of ``queued`` one cell in."""
    filled = width * (queued - position + 1) // queued if queued > 0 else 0
    filled = max(0, min(width, filled))
    return Text.assemble(("━" * filled, QUEUE_STYLE), (PENDING * (width - filled), PENDING_STYLE))


def prefill_bar(processed: int, total: int, cached: int, width: int = BAR_WIDTH) -> Text:
    """``width`` cells: the cached prefix, the part computed so far, the rest, each in its colour."""
    if total <= 0:
        return Text(PENDING * width, style=PENDING_STYLE)
    cached_cells = min(width, width * cached // total)
    done = max(min(width, width * processed // total) - cached_cells, 0)
    return Text.assemble(
        ("━" * cached_cells, CACHED_STYLE),
        ("━" * done, COMPUTED_STYLE),
        (PENDING * (width - cached_cells - done), PENDING_STYLE),
    )


def progress_cell(r: RequestStatus) -> Text:
    if r.queue is not None:
        q = r.queue
        return Text.assemble(queue_bar(q.position, q.queued), f" {q.position} of {q.queued}")
    if r.prefill is not None:
        p = r.prefill
        return Text.assemble(prefill_bar(p.processed, p.total, p.cached), f" {p.processed}/{p.total}")
    if r.stage == "submitted":
        return Text("sent to the worker", style="dim")
    return Text(f"{r.completion_tokens} tokens")


def render(st: Status, r: Rates | None, by: str, width: int) -> RenderableType:
    """The whole screen for snapshot ``st``."""
    stamp = time.strftime("%H:%M:%S", time.localtime(st.time))
    up = st.worker is not None and st.worker.up
    header = [Text(line, style="bold" if up else "bold red") for line in worker_lines(st.worker)]
    header += [
        Text(rates_line(st, r)),
        Text(f"{len(st.requests)} requests · sorted by {by} · {KEYS_HINT} · {stamp}", style="dim"),
    ]
    table = Table(expand=True, box=None, header_style="bold", pad_edge=False)
    table.add_column("ID", no_wrap=True)
    table.add_column("API", no_wrap=True)
    table.add_column("STAGE", no_wrap=True)
    table.add_column("PROGRESS", no_wrap=True, min_width=BAR_WIDTH + 12)
    table.add_column("PROMPT", justify="right", no_wrap=True)
    table.add_column("CACHED", justify="right", no_wrap=True)
    table.add_column("TOK/S", justify="right", no_wrap=True)
    table.add_column("TTFT", justify="right", no_wrap=True)
    table.add_column("DRAFTS", justify="right", no_wrap=True)
    table.add_column("AGE", justify="right", no_wrap=True)
    for req in sort_requests(st.requests, by):
        speed = req.prefill.rate_tok_s if req.prefill is not None else req.decode_tok_s
        table.add_row(
            short_id(req.id),
            req.dialect,
            Text(req.stage, style=STAGE_STYLES.get(req.stage, "")),
            progress_cell(req),
            str(req.prompt_tokens) if req.prompt_tokens else "—",
            str(req.cached_tokens) if req.prompt_tokens else "—",
            rate(speed),
            seconds(req.ttft_s),
            drafts_text(req),
            seconds(req.age_s),
        )
    return Group(*header, Text(""), table)


class Keys:
    """Single key presses from ``stream`` (a terminal, put in cbreak mode while
    entered); none when it is not a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self._fd = stream.fileno() if stream.isatty() else None
        self._saved: list[Any] | None = None

    def __enter__(self) -> Keys:
        if self._fd is not None:
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None and self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def read(self) -> str:
        """The keys pressed since the last call (never waits)."""
        if self._fd is None or not select.select([self._fd], [], [], 0)[0]:
            return ""
        return os.read(self._fd, 64).decode(errors="ignore")


_END = object()


def _reader(source: Iterator[Status], out: queue.Queue[object]) -> None:
    try:
        for st in source:
            out.put(st)
        out.put(_END)
    except ChatError as e:
        out.put(e)
    except Exception as e:  # a bug: shown, not a silent hang
        out.put(ChatError(f"{type(e).__name__}: {e}"))


def run(source: Iterator[Status], console: Console, by: str, on_end: Callable[[str], None]) -> None:
    """Draw ``source``'s snapshots until ``q``, Ctrl-C (``KeyboardInterrupt``) or
    the end of the stream (``on_end`` is told why, after the screen is restored).
    Raises the ``ChatError`` of a failed stream, also after the screen is restored."""
    inbox: queue.Queue[object] = queue.Queue(maxsize=8)
    threading.Thread(target=_reader, args=(source, inbox), name="top-reader", daemon=True).start()
    last: Status | None = None
    window = RateWindow()
    current: Rates | None = None
    ended: str | None = None
    failure: ChatError | None = None
    with Keys(sys.stdin) as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        live.update(Text("waiting for the first status…", style="dim"), refresh=True)
        while ended is None and failure is None:
            redraw = False
            with contextlib.suppress(queue.Empty):
                item = inbox.get(timeout=0.1)
                if isinstance(item, Status):
                    current = window.add(item)
                    last = item
                    redraw = True
                elif isinstance(item, ChatError):
                    failure = item
                else:
                    ended = "the server ended the status stream (it is shutting down)"
            for key in keys.read():
                if key in "qQ":
                    ended = ""
                elif key in "sS":
                    by = SORTS[(SORTS.index(by) + 1) % len(SORTS)]
                    redraw = True
            if redraw and last is not None:
                live.update(render(last, current, by, console.width), refresh=True)
    if failure is not None:
        raise failure
    if ended:
        on_end(ended)
