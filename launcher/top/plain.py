"""The ``top`` view for pipes and logs: a block of plain lines per snapshot, no escape codes::

    --- 2026-12-01 12:30:01 ---
    worker: SmolLM2-135M-Instruct (cpu) · up · running 1/1 · kv 9% (… tokens) · queued 2/256 · ...
    in flight 3/256 · 0.00 req/s · prefill 512 tok/s · decode 0.0 tok/s · done 0 (0 failed) · cached 0%
    chatcmpl-84a7c2d1  chat  prefill  704/1537 tokens (cached 0), 512 tok/s  prompt 1537 (cached 0)  age 1.5 s
    chatcmpl-1f0e9a33  chat  queued  position 1 of 2, waited 1.40 s  age 1.40 s

Requests in the order of ``--sort`` (the server's by default: by stage).
"""

from __future__ import annotations

import time
from typing import TextIO

from launcher.top.model import RateWindow, rates_line, request_line, sort_requests, worker_lines
from proxy.ops.status_types import Status


class PlainView:
    """Writes each snapshot to ``out`` as a block of lines, requests sorted ``by``."""

    def __init__(self, out: TextIO, by: str = "stage") -> None:
        self._out = out
        self._by = by
        self._window = RateWindow()

    def show(self, st: Status) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.time))
        lines = [f"--- {stamp} ---", *worker_lines(st.worker), rates_line(st, self._window.add(st))]
        lines += [request_line(r) for r in sort_requests(st.requests, self._by)]
        self._out.write("\n".join(lines) + "\n")
        self._out.flush()  # a reader at the other end of the pipe sees each snapshot as it comes
