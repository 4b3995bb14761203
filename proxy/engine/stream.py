"""The bounded per-request event stream the engine client hands out.

``RequestStream`` holds the events of one HTTP request (one engine request per
choice) between the engine client's reader (the producer) and the request's
handler (the consumer), and carries the fast path: a consumer with nothing to
await attaches a *sink*, and the reader hands each engine step's events of the
request straight to it (``attach``/``deliver``); what a slow consumer leaves
unread is merged (``DeltaRun``, newest progress), never grown without bound.
``proxy.engine.client`` creates them; ``proxy.serving.delivery`` consumes them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from protocol.messages import Event, PrefillProgress, QueueProgress, TokenDelta, TokenLogprob
from proxy.errors import EngineInternalError, ProxyError, StalledClient

log = logging.getLogger(__name__)

DEFAULT_MAX_MERGED_BYTES = 4 * 1024 * 1024
"""``max_merged_bytes`` unless given (``ProxySettings.max_stream_buffer_mb``'s default)."""


_LOGPROB_BYTES = 96
"""About what one logprob entry (token, float, bytes) costs held in memory."""


@dataclass(slots=True)
class DeltaRun:
    """Consecutive ``TokenDelta``s of one request merged into one: text
    concatenated, ``num_tokens`` summed, logprob entries kept in order. Parts are
    joined once, by ``freeze``."""

    request_id: str
    parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None

    def add(self, ev: TokenDelta) -> int:
        """Merge ``ev``; returns about how many bytes it holds (its text's length
        plus a string's overhead, ``_LOGPROB_BYTES`` per logprob entry and alternative)."""
        self.parts.append(ev.text)
        self.num_tokens += ev.num_tokens
        size = len(ev.text) + 64
        if ev.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += ev.logprobs
            size += sum(_LOGPROB_BYTES * (1 + len(lp.top)) for lp in ev.logprobs)
        return size

    def freeze(self) -> TokenDelta:
        logprobs = tuple(self.logprobs) if self.logprobs is not None else None
        return TokenDelta(self.request_id, "".join(self.parts), self.num_tokens, logprobs)


Sink = Callable[[list[Event]], bool]
"""Takes the events one pass of the reader brought a request (one engine step,
or several when the reader fell behind; ``RequestStream.attach``); returns
False to hand the stream back to its consumer."""


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class RequestStream:
    """Events of one HTTP request (one engine request per choice), in arrival order.

    The producer calls ``put``/``fail``. The consumer either takes events
    (``get``, or ``take`` after ``wait``), or attaches a ``Sink`` for the time it
    waits (``attach``, ``wait``, ``detach``): then every pending event goes to
    the sink once per engine step, synchronously, from the reader (``deliver``);
    ``fail`` and a sink that returns False detach it and wake the consumer.

    At most ``max_pending`` events wait: beyond that a
    ``TokenDelta`` is merged into the pending delta of the same request (text
    concatenated, ``num_tokens`` summed) and a ``PrefillProgress`` replaces the
    pending intermediate progress of the same request (a ``QueueProgress`` the
    pending one), so a client that reads
    slower than the engine writes costs memory proportional to its text, not to
    its event count. ``Started``/``Finished``/``RequestError`` are never merged
    (there are few per request). What merged deltas hold is bounded too: past
    ``max_merged_bytes`` the stream fails with ``StalledClient``.

    ``ready``: the reader's list of streams to ``deliver`` once the current
    batch is routed (``ZmqEngineClient``); without one, a stream with a sink
    delivers from a ``call_soon`` callback.
    """

    __slots__ = (
        "_error",
        "_has_runs",
        "_max",
        "_max_merged",
        "_merged",
        "_pending",
        "_ready",
        "_scheduled",
        "_sink",
        "_waiter",
        "request_ids",
    )

    def __init__(
        self,
        request_ids: Sequence[str],
        max_pending: int,
        *,
        ready: list[RequestStream] | None = None,
        max_merged_bytes: int = DEFAULT_MAX_MERGED_BYTES,
    ) -> None:
        self.request_ids: tuple[str, ...] = tuple(request_ids)
        self._max = max_pending
        self._max_merged = max_merged_bytes
        self._merged = 0
        self._pending: list[Event | DeltaRun] = []
        self._has_runs = False
        self._error: ProxyError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None
        self._scheduled = False  # in the reader's ready list (or a call_soon) already
        self._ready = ready

    @property
    def failed(self) -> bool:
        """``fail`` was called; ``get`` raises once the events before it are taken."""
        return self._error is not None

    def put(self, ev: Event) -> None:
        """Queue one event (``ev.request_id`` must be one of ``request_ids``).
        Ignored after ``fail``."""
        if self._error is not None:
            return
        pending = self._pending
        if len(pending) >= self._max and ev.request_id is not None and self._merge(ev.request_id, ev):
            return
        pending.append(ev)
        if self._sink is None:
            self._wake()
        elif not self._scheduled:
            self._scheduled = True
            if self._ready is not None:
                self._ready.append(self)
            else:
                asyncio.get_running_loop().call_soon(self.deliver)

    def _merge(self, rid: str, ev: Event) -> bool:
        # The last pending item of this request: a few from the end, as every
        # step appends about one per choice (a search only while the backlog is
        # full, rather than bookkeeping on every event).
        pending = self._pending
        i = len(pending) - 1
        while i >= 0 and pending[i].request_id != rid:
            i -= 1
        if i < 0:
            return False
        last = pending[i]
        if isinstance(ev, TokenDelta):
            if isinstance(last, TokenDelta):
                run = DeltaRun(rid)
                run.add(last)
                last = pending[i] = run
                self._has_runs = True
            if isinstance(last, DeltaRun):
                self._merged += last.add(ev)
                if self._merged > self._max_merged:
                    self.fail(
                        StalledClient(
                            f"The client is not reading: over {self._max_merged // 1024} KiB of its "
                            "stream wait unread (max_stream_buffer_mb)"
                        )
                    )
                return True
        elif (isinstance(ev, QueueProgress) and isinstance(last, QueueProgress)) or (
            isinstance(ev, PrefillProgress)
            and isinstance(last, PrefillProgress)
            # The first progress (processed == cached) marks the start; keep it.
            and last.processed != last.cached
        ):
            pending[i] = ev
            return True
        return False

    def fail(self, exc: ProxyError) -> None:
        """End the stream with ``exc``: ``get`` returns what is pending, then raises it.
        Detaches the sink: the consumer takes what is left itself."""
        if self._error is None:
            self._error = exc
            self._sink = None
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            _wake(w)

    def _take(self) -> list[Event]:
        out = self._pending
        self._pending = []
        self._merged = 0
        if self._has_runs:
            self._has_runs = False
            return [x.freeze() if isinstance(x, DeltaRun) else x for x in out]
        return out  # type: ignore[return-value]  # no DeltaRun without _has_runs

    def take(self) -> list[Event]:
        """Every pending event, without waiting (``[]`` when none). Raises the
        ``ProxyError`` given to ``fail`` once no event is pending."""
        if self._pending:
            return self._take()
        if self._error is not None:
            raise self._error
        return []

    async def wait(self, until: float = math.inf) -> None:
        """Until there is something to ``take`` (without a sink), the sink handed
        back, ``fail`` was called, or the loop's clock reaches ``until``. One
        future and one timer per call, no ``asyncio.timeout``: a stream waits
        once per hand-over, not once per event."""
        if (self._pending and self._sink is None) or self._error is not None:
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiter = fut
        timer = loop.call_at(until, _wake, fut) if until != math.inf else None
        try:
            await fut
        finally:
            if self._waiter is fut:
                self._waiter = None
            if timer is not None:
                timer.cancel()

    async def get(self, max_wait_s: float | None = None) -> list[Event]:
        """Every pending event, waiting up to ``max_wait_s`` seconds (``None``: no
        limit) for at least one. Returns ``[]`` on timeout. Raises the
        ``ProxyError`` given to ``fail`` once no event is pending. Not while a
        sink is attached."""
        if not self._pending and self._error is None:
            until = math.inf if max_wait_s is None else asyncio.get_running_loop().time() + max_wait_s
            await self.wait(until)
        return self.take()

    def attach(self, sink: Sink) -> bool:
        """Send events to ``sink`` from now on, until ``detach``, ``fail`` or the
        sink returns False. Returns False (and attaches nothing) when events are
        pending or the stream failed: ``take`` them first."""
        if self._pending or self._error is not None:
            return False
        self._sink = sink
        return True

    def detach(self) -> None:
        """Stop sending events to the sink; they wait for ``take`` again."""
        self._sink = None

    def deliver(self) -> None:
        """Hand every pending event to the sink (the reader calls this once per
        batch for each stream that got events). A sink that returns False, or
        fails, is detached and the consumer woken."""
        self._scheduled = False
        sink = self._sink
        if sink is None or not self._pending:
            return
        events = self._take()
        try:
            keep = sink(events)
        except Exception as e:
            # A bug in one response must not stop the reader that serves all.
            log.exception("delivering events to request %s failed", self.request_ids[0])
            self.fail(EngineInternalError(f"Internal error: {type(e).__name__}"))
            return
        if not keep:
            self._sink = None
            self._wake()
