"""What ``top`` shows, computed from snapshots: rates, sort orders, the words.

Both views (``plain``, ``terminal``) use these, so a pipe and a terminal say the
same thing. Rates are differences of ``Status.totals`` between two snapshots over
the difference of their ``time`` (over ``RATE_WINDOW_S``): the totals count
requests in flight too, so a long decode moves them every snapshot, not only
when it ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from proxy.ops.status_types import STAGES, RequestStatus, Status, WorkerStatus

SORTS = ("stage", "age", "tokens", "rate")
"""Sort orders, cycled by the ``s`` key: ``stage`` (the server's order: decode,
prefill, queued by position, submitted), ``age`` (oldest first), ``tokens``
(most completion tokens first), ``rate`` (fastest decode first)."""

ID_CHARS = 8
"""Characters of an id shown after its prefix (``chatcmpl-84a7c2d1``)."""


@dataclass(frozen=True, slots=True)
class Rates:
    """Per second over the last interval: ``requests`` ended, ``prefill``
    (prompt tokens computed), ``decode`` (completion tokens)."""

    requests: float
    prefill: float
    decode: float


def rates(before: Status | None, now: Status) -> Rates | None:
    """Rates between two snapshots; ``None`` without an earlier one, or when no
    time passed between them (or the proxy restarted: its counters went back)."""
    if before is None:
        return None
    dt = now.time - before.time
    a, b = before.totals, now.totals
    if dt <= 0 or b.requests < a.requests or b.completion_tokens < a.completion_tokens:
        return None
    return Rates(
        (b.requests - a.requests) / dt,
        (b.prefilled_tokens - a.prefilled_tokens) / dt,
        (b.completion_tokens - a.completion_tokens) / dt,
    )


RATE_WINDOW_S = 5.0
"""Seconds of snapshots the header's rates average over: prefill progress comes a
chunk at a time and tokens a step at a time, so one interval alone flickers."""


class RateWindow:
    """Rates over the snapshots of the last ``window_s`` seconds (``add`` each one)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._seen: deque[Status] = deque()

    def add(self, st: Status) -> Rates | None:
        """Rates from the oldest snapshot in the window to ``st`` (``None`` for the first)."""
        seen = self._seen
        if seen and st.time < seen[-1].time:  # the clock went back: start over
            seen.clear()
        seen.append(st)
        while len(seen) > 2 and st.time - seen[1].time >= self._window_s:
            seen.popleft()
        return rates(seen[0], st) if len(seen) > 1 else None


def sort_requests(requests: list[RequestStatus], by: str) -> list[RequestStatus]:
    """``requests`` in the order ``by`` (one of ``SORTS``) names."""
    if by == "age":
        return sorted(requests, key=lambda r: -r.age_s)
    if by == "tokens":
        return sorted(requests, key=lambda r: (-r.completion_tokens, -r.age_s))
    if by == "rate":
        return sorted(requests, key=lambda r: (-(r.decode_tok_s or 0.0), -r.age_s))
    order = {s: i for i, s in enumerate(STAGES)}
    return sorted(
        requests,
        key=lambda r: (order.get(r.stage, len(order)), r.queue.position if r.queue else 0, -r.age_s),
    )


def short_id(request_id: str) -> str:
    """The id's prefix (up to its last ``-`` or ``_``) and ``ID_CHARS`` characters after it."""
    cut = max(request_id.rfind("-"), request_id.rfind("_")) + 1
    return request_id[: cut + ID_CHARS]


def seconds(s: float | None) -> str:
    """``0.42 s``, ``12.3 s``, ``4m05s``, ``2h03m``; ``—`` for ``None``."""
    if s is None:
        return "—"
    if s < 10:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def rate(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "—"


def worker_lines(w: WorkerStatus | None) -> list[str]:
    """The worker (model, backend, uptime, heartbeat), then its load (batch slots,
    KV cache, queue): two lines."""
    if w is None:
        return ["worker: no handshake yet", "load: —"]
    drafting = f", drafting {w.drafting}" if w.drafting else ""
    state = f"up {seconds(w.uptime_s)}" if w.up else "DOWN"
    worker = f"worker: {w.model} ({w.backend}{drafting}) {state} · heartbeat {seconds(w.heartbeat_age_s)} ago"
    slots = f"/{w.batch_slots}" if w.batch_slots else ""
    load = [f"running {w.running if w.running is not None else '—'}{slots}"]
    if w.kv_cache_usage is not None:
        kv = f"kv {100 * w.kv_cache_usage:.0f}%"
        if w.kv_cache_tokens and w.kv_cache_used_tokens is not None:
            kv += f" ({w.kv_cache_used_tokens}/{w.kv_cache_tokens} tokens)"
        load.append(kv)
    limit = f"/{w.max_queue}" if w.max_queue else ""
    load.append(f"queued {w.queued if w.queued is not None else '—'}{limit}")
    return [worker, "load: " + " · ".join(load)]


def rates_line(st: Status, r: Rates | None) -> str:
    """In flight, rates over the last interval and the ratios of the totals, in one line."""
    t = st.totals
    parts = [f"in flight {st.proxy.in_flight}/{st.proxy.max_in_flight}"]
    if r is None:
        parts.append("rates —")
    else:
        parts.append(f"{r.requests:.2f} req/s")
        parts.append(f"prefill {rate(r.prefill)} tok/s")
        parts.append(f"decode {rate(r.decode)} tok/s")
    parts.append(f"done {t.requests} ({t.failed} failed)")
    parts.append(f"cached {percent(t.cached_tokens, t.prompt_tokens)}")
    verified = t.draft_accepted + t.draft_rejected
    if verified:
        parts.append(f"drafts {percent(t.draft_accepted, verified)} accepted")
    if st.proxy.draining:
        parts.append("DRAINING")
    return " · ".join(parts)


def progress_text(r: RequestStatus) -> str:
    """Where the request is, in words: its queue place, its prefill, or its tokens."""
    if r.queue is not None:
        q = r.queue
        eta = f", eta {seconds(q.eta_s)}" if q.eta_s is not None else ""
        return f"position {q.position} of {q.queued}, waited {seconds(q.waited_s)}{eta}"
    if r.prefill is not None:
        p = r.prefill
        speed = f", {rate(p.rate_tok_s)} tok/s" if p.rate_tok_s is not None else ""
        return f"{p.processed}/{p.total} tokens (cached {p.cached}){speed}"
    if r.stage in ("decode", "done"):
        text = f"{r.completion_tokens} tokens"
        if r.decode_tok_s is not None:
            text += f", {rate(r.decode_tok_s)} tok/s"
        return text
    return "sent to the worker"


def drafts_text(r: RequestStatus) -> str:
    if r.draft_accepted is None:
        return "—"
    return f"{r.draft_accepted}/{r.draft_accepted + (r.draft_rejected or 0)}"


def request_line(r: RequestStatus) -> str:
    """One request in one plain line."""
    parts = [short_id(r.id), r.dialect, r.stage, progress_text(r)]
    if r.prompt_tokens:
        parts.append(f"prompt {r.prompt_tokens} (cached {r.cached_tokens})")
    if r.ttft_s is not None:
        parts.append(f"ttft {seconds(r.ttft_s)}")
    if r.draft_accepted is not None:
        parts.append(f"drafts {drafts_text(r)}")
    parts.append(f"age {seconds(r.age_s)}")
    return "  ".join(parts)
