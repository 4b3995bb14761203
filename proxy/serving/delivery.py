"""How the events of one request reach its client: an SSE stream, or one JSON body.

``stream_response`` and ``complete_response`` are the two ends of every
dialect's generation endpoint (``proxy.serving.serve``). Both feed the request's
``Generation`` (``proxy.core.generation``: the per-request rules; for a stream it
calls the dialect's encoder, ``Frames``) with the events of its
``RequestStream``, in one of two ways:

- *Handed over* (the fast path): while the handler's task has nothing to do
  but wait, it attaches a sink to the stream (``RequestStream.attach``), and the
  engine client's reader calls it once per engine step with that step's events
  of the request. The sink feeds them (the dialect's encoder appends each SSE
  event, encoded once) and writes them to the client's transport in one
  synchronous write (``proxy.server.sse.TransportWriter``): an engine step of N streams
  is one pass of the reader, with no task wake-up per stream. The sink hands
  the stream back to the task (returns False) when the response is done, on an
  error, and when the client's transport is above its high-water mark: then
  the task awaits the drain, while the stream's backlog is merged
  (``RequestStream``) instead of holding up anyone else.
- *Taken* by the task (``RequestStream.take``/``get``): before the SSE headers,
  after a hand-back, and for what arrived while the task was busy.

Deadlines ride on the task's one wait (``RequestStream.wait``), not on a timer
per event: the sink only records when the last event came and the last write
went out, and the task, woken at the earlier of the ping and idle deadlines,
checks which one really passed and otherwise waits again. A stream that keeps
flowing wakes its task about once per ``sse_ping_interval``.

- Idle limit: a request that gets no worker event for
  ``request_idle_timeout`` seconds fails with ``GatewayTimeout`` (504, or an
  error event after the headers); the handler then aborts its choices.
- When the SSE headers go out: a stream first waits for every choice's first
  event (``Started``, or a ``RequestError`` such as
  ``context_length_exceeded``, which then becomes a real 400), but at most
  ``sse_ping_interval``; after that the headers are sent with a ``: ping`` and
  later errors can only be error events. With ``return_progress`` a
  ``queue_progress`` chunk also sends them: the worker queues a request only
  after every check that refuses one.
- Pings: the dialect's ping (``: ping``, or Anthropic's ``ping`` event) after
  ``sse_ping_interval`` seconds without a write (not without an event: events
  that make no chunk can keep coming).
- ``stream_interval`` (``TokenGrouper``): tokens per content event.
- A client that takes nothing of what waits for it for
  ``stalled_client_timeout`` seconds, or whose unread backlog in the
  ``RequestStream`` passes ``max_stream_buffer_mb``, is cut
  (``StalledClient``): its connection is aborted, one log line, and the
  handler's exit aborts its engine work and frees its slot. A non-stream body
  the client does not take is cut after the same time.
- Errors after the headers: the events still pending, then the dialect's error
  event(s) and terminator (``Frames.error``); ``RequestRecord.fail`` records it.
- The end: the dialect's closing events and terminator (``Frames.close``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from aiohttp import web

from protocol.messages import Event, TokenDelta
from proxy.core.generation import Frames, Generation
from proxy.engine.stream import DeltaRun, RequestStream
from proxy.errors import EngineInternalError, GatewayTimeout, ProxyError, StalledClient
from proxy.ops.request_log import RequestRecord
from proxy.server import sse
from proxy.settings import ProxySettings

log = logging.getLogger(__name__)


def idle_timeout(idle_s: float) -> GatewayTimeout:
    return GatewayTimeout(
        f"No progress from the engine worker for {idle_s:g} s (request_idle_timeout); the request was aborted"
    )


class TokenGrouper:
    """``stream_interval``: ``TokenDelta``s of each choice held and merged until
    ``interval`` tokens have come, so that each content event carries that many
    (vLLM's ``--stream-interval``). A choice's first delta passes at once (the
    time to first token is not delayed); what a choice holds goes out before
    any other event of it (its ``Finished``), and everything held before an
    event of no choice (a failure of the whole worker)."""

    __slots__ = ("_held", "_interval", "_seen")

    def __init__(self, interval: int) -> None:
        self._interval = interval
        self._held: dict[str, DeltaRun] = {}
        self._seen: set[str] = set()

    def apply(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        held = self._held
        for ev in events:
            if isinstance(ev, TokenDelta):
                choice = ev.request_id
                if choice not in self._seen:
                    self._seen.add(choice)
                    out.append(ev)
                    continue
                run = held.get(choice)
                if run is None:
                    run = held[choice] = DeltaRun(choice)
                run.add(ev)
                if run.num_tokens >= self._interval:
                    out.append(held.pop(choice).freeze())
                continue
            rid = ev.request_id
            if rid is None:
                out += [run.freeze() for run in held.values()]
                held.clear()
            else:
                run = held.pop(rid, None)
                if run is not None:
                    out.append(run.freeze())
            out.append(ev)
        return out


class _SseOut:
    """One stream's state between its task and the reader: what was fed and not
    yet written (``buf``: whole SSE events), the error that stopped it, and
    when its last event came and its last write went out (loop time)."""

    __slots__ = (
        "buf",
        "closed",
        "error",
        "frames",
        "gen",
        "grouper",
        "last_event",
        "last_write",
        "loop",
        "writer",
    )

    def __init__(
        self, gen: Generation, frames: Frames, loop: asyncio.AbstractEventLoop, interval: int
    ) -> None:
        self.gen = gen
        self.frames = frames
        self.loop = loop
        self.grouper = TokenGrouper(interval) if interval > 1 else None
        self.buf: list[bytes] = []
        self.error: Exception | None = None
        self.closed = False  # the closing events and terminator are in buf
        self.writer: sse.TransportWriter | None = None
        self.last_event = self.last_write = loop.time()

    def feed(self, events: list[Event]) -> None:
        """Apply ``events``, the encoder appending their SSE events to ``buf``.
        The error of an event (a ``RequestError``'s ``ProxyError``, or a bug) is
        kept in ``error``, with the events before it: the reader runs this too,
        and must never see it raise."""
        if self.grouper is not None:
            events = self.grouper.apply(events)
        gen = self.gen
        buf = self.buf
        try:
            for ev in events:
                gen.feed(ev, buf)
            if gen.done and not self.closed:
                self.closed = True
                self.frames.close(buf)
        except Exception as e:
            self.error = e

    def take(self, stream: RequestStream) -> None:
        """Feed what ``stream`` holds (raises its failure, once nothing is left)."""
        events = stream.take()
        if events:
            self.last_event = self.loop.time()
            self.feed(events)

    def deliver(self, events: list[Event]) -> bool:
        """The sink (``RequestStream.attach``): feed one engine step's events and
        write their SSE events at once. False hands the stream back to the task:
        the response is done or failed, or the client is not keeping up."""
        now = self.loop.time()
        self.last_event = now
        self.feed(events)
        if self.error is not None:
            return False
        if self.buf:
            writer = self.writer
            assert writer is not None
            if writer.congested or not writer.write(self.buf):
                return False
            self.buf.clear()
            self.last_write = now
        return not self.closed


async def stream_response(
    request: web.Request,
    settings: ProxySettings,
    stream: RequestStream,
    gen: Generation,
    frames: Frames,
    record: RequestRecord,
) -> web.StreamResponse:
    """Serve ``gen`` as an SSE stream encoded by ``frames`` (module docstring).
    Raises ``ProxyError`` only before the headers are sent."""
    ping_s = settings.sse_ping_interval
    idle_s = settings.request_idle_timeout
    idle_after = idle_s or math.inf
    loop = asyncio.get_running_loop()
    gen.stream_to(frames)
    o = _SseOut(gen, frames, loop, settings.stream_interval)
    # Before the headers: errors are still HTTP statuses (ProxyError propagates).
    deadline = o.last_event + ping_s
    silent = False
    # A queue_progress event (the request waits in the worker's queue, after
    # every check that could refuse it) is worth sending the headers for.
    while not (gen.started or gen.done or o.buf):
        now = loop.time()
        if now >= o.last_event + idle_after:
            raise idle_timeout(idle_s)
        if now >= deadline:
            silent = True
            break
        events = await stream.get(min(deadline, o.last_event + idle_after) - now)
        if events:
            o.last_event = loop.time()
            o.feed(events)
            if o.error is not None:
                raise o.error

    resp = web.StreamResponse(headers=sse.HEADERS)
    try:
        writer = await resp.prepare(request)
    except ConnectionResetError:
        # Gone between the last event and the headers: nothing was sent, nothing
        # failed here (aiohttp finishes an unsent response quietly).
        log.debug("client of %s went away before the headers", record.request_id)
        record.client_gone = True
        return resp
    assert writer is not None
    o.last_write = loop.time()  # the headers count: the first ping is due ping_s after them
    head: list[bytes] = []
    frames.open(head)
    if silent:
        head.append(frames.ping)
    o.buf[:0] = head
    try:
        o.writer = out = sse.TransportWriter(request, resp, writer)
        while True:
            o.take(stream)
            if o.error is not None:
                raise o.error
            if o.buf:
                if not out.write(o.buf):
                    raise ConnectionResetError("the client went away")
                o.buf.clear()
                o.last_write = loop.time()
                if out.congested:
                    # A stream failed meanwhile (its backlog over the limit) raises at take().
                    failed = lambda: stream.take() if stream.failed else None  # noqa: E731
                    await out.drain_or_cut(settings.stalled_client_timeout, failed)
                    continue
            if o.closed:
                break
            now = loop.time()
            if now >= o.last_event + idle_after:
                raise idle_timeout(idle_s)
            if now >= o.last_write + ping_s:
                o.buf.append(frames.ping)
                continue
            if not stream.attach(o.deliver):
                continue  # events came meanwhile: take them first
            try:
                await stream.wait(min(o.last_write + ping_s, o.last_event + idle_after))
            finally:
                stream.detach()
        await resp.write_eof()
    except StalledClient as e:
        log.warning("cut the stream of %s: %s", record.request_id, e.message)
        record.fail(e)
        record.client_gone = True
        if o.writer is not None:
            o.writer.abort()
    except ProxyError as e:
        record.fail(e)
        await _write_error(resp, o, e)
    except ConnectionResetError:
        log.debug("client of %s went away", record.request_id)
        record.client_gone = True
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("stream %s failed", record.request_id, exc_info=e)
        err = EngineInternalError(f"Internal error: {type(e).__name__}")
        record.fail(err)
        await _write_error(resp, o, err)
    return resp


async def send_body(
    request: web.Request, body: bytes, stalled_s: float, record: RequestRecord
) -> web.Response:
    """Send a non-stream JSON body, cutting the connection when the client
    takes nothing of it for ``stalled_s`` seconds (0: no limit)."""
    resp = web.Response(body=body, content_type="application/json")
    await resp.prepare(request)
    try:
        await asyncio.wait_for(resp.write_eof(), stalled_s or None)
    except TimeoutError:
        log.warning("cut the response of %s: the client took nothing for %g s", record.request_id, stalled_s)
        record.client_gone = True
        if request.transport is not None:
            sse.abort(request.transport)
    return resp


async def _write_error(resp: web.StreamResponse, o: _SseOut, exc: ProxyError) -> None:
    """After the headers the status is fixed: the events still pending, then
    the dialect's error event(s) and terminator."""
    try:
        o.frames.error(exc, o.buf)
    except Exception:
        log.exception("encoding the error event of %s failed", type(o.frames).__name__)
    try:
        await resp.write(b"".join(o.buf))
        await resp.write_eof()
    except ConnectionResetError:
        pass


class _Collected:
    """A non-stream response's state between its task and the reader: the
    events only accumulate in the ``Generation`` (no encoder)."""

    __slots__ = ("error", "gen", "last_event", "loop", "scratch")

    def __init__(self, gen: Generation, loop: asyncio.AbstractEventLoop) -> None:
        self.gen = gen
        self.loop = loop
        self.scratch: list[bytes] = []  # stays empty: there is no encoder
        self.error: Exception | None = None
        self.last_event = loop.time()

    def feed(self, events: list[Event]) -> None:
        try:
            for ev in events:
                self.gen.feed(ev, self.scratch)
        except Exception as e:
            self.error = e

    def deliver(self, events: list[Event]) -> bool:
        self.last_event = self.loop.time()
        self.feed(events)
        return self.error is None and not self.gen.done


async def complete_response(
    stream: RequestStream, gen: Generation, body: Callable[[], bytes], idle_s: float
) -> bytes:
    """Wait until every choice of ``gen`` finished, then return ``body()`` (the
    dialect's JSON body). Raises the ``ProxyError`` of a failed request,
    ``GatewayTimeout`` after ``idle_s`` seconds without an event (0: no limit)."""
    loop = asyncio.get_running_loop()
    idle_after = idle_s or math.inf
    c = _Collected(gen, loop)
    while True:
        events = stream.take()
        if events:
            c.last_event = loop.time()
            c.feed(events)
        if c.error is not None:
            raise c.error
        if gen.done:
            return body()
        if loop.time() >= c.last_event + idle_after:
            raise idle_timeout(idle_s)
        if not stream.attach(c.deliver):
            continue
        try:
            await stream.wait(c.last_event + idle_after)
        finally:
            stream.detach()
