"""How the events of one request reach its client: an SSE stream, or one JSON body.

``stream_response`` and ``complete_response`` are the two ends of
``proxy.handlers``' completion endpoints. Both feed the request's
``ResponseState`` (``proxy.streaming``: the per-request rules) with the events
of its ``RequestStream``, in one of two ways:

- *Handed over* (the fast path): while the handler's task has nothing to do
  but wait, it attaches a sink to the stream (``RequestStream.attach``), and the
  engine client's reader calls it once per engine step with that step's events
  of the request. The sink feeds them, encodes each chunk once
  (``proxy.sse.event``) and writes them to the client's transport in one
  synchronous write (``proxy.sse.TransportWriter``): an engine step of N streams
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
- Pings: ``: ping`` after ``sse_ping_interval`` seconds without a write (not
  without an event: events that make no chunk can keep coming).
- ``stream_interval`` (``TokenGrouper``): tokens per content event.
- Errors after the headers: the chunks still pending, one ``data: {"error":
  ...}`` event, ``[DONE]``; ``RequestRecord.fail`` records it.
"""

from __future__ import annotations

import asyncio
import logging
import math

from aiohttp import web

from protocol.messages import Event, TokenDelta
from proxy import sse
from proxy.errors import EngineInternalError, GatewayTimeout, ProxyError, envelope
from proxy.request_log import RequestRecord
from proxy.request_stream import DeltaRun, RequestStream
from proxy.responses import StreamChunk, encode
from proxy.settings import ProxySettings
from proxy.streaming import ResponseState

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
        "grouper",
        "last_event",
        "last_write",
        "loop",
        "out",
        "response",
        "writer",
    )

    def __init__(self, response: ResponseState, loop: asyncio.AbstractEventLoop, interval: int) -> None:
        self.response = response
        self.loop = loop
        self.grouper = TokenGrouper(interval) if interval > 1 else None
        self.out: list[StreamChunk] = []
        self.buf: list[bytes] = []
        self.error: Exception | None = None
        self.closed = False  # usage chunk and [DONE] are in buf
        self.writer: sse.TransportWriter | None = None
        self.last_event = self.last_write = loop.time()

    def feed(self, events: list[Event]) -> None:
        """Apply ``events`` and encode the chunks they make into ``buf``. The
        error of an event (a ``RequestError``'s ``ProxyError``, or a bug) is
        kept in ``error``, with the chunks of the events before it: the reader
        runs this too, and must never see it raise."""
        if self.grouper is not None:
            events = self.grouper.apply(events)
        out = self.out
        response = self.response
        try:
            for ev in events:
                response.feed(ev, out)
        except Exception as e:
            self.error = e
        if out:
            buf = self.buf
            for c in out:
                buf.append(sse.event(c))
            out.clear()
        if response.done and self.error is None and not self.closed:
            self.closed = True
            if response.flags.include_usage:
                self.buf.append(sse.event(response.usage_chunk()))
            self.buf.append(sse.DONE)

    def take(self, stream: RequestStream) -> None:
        """Feed what ``stream`` holds (raises its failure, once nothing is left)."""
        events = stream.take()
        if events:
            self.last_event = self.loop.time()
            self.feed(events)

    def deliver(self, events: list[Event]) -> bool:
        """The sink (``RequestStream.attach``): feed one engine step's events and
        write their chunks at once. False hands the stream back to the task:
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
    response: ResponseState,
    record: RequestRecord,
) -> web.StreamResponse:
    """Serve ``response`` as an SSE stream (module docstring). Raises
    ``ProxyError`` only before the headers are sent."""
    ping_s = settings.sse_ping_interval
    idle_s = settings.request_idle_timeout
    idle_after = idle_s or math.inf
    loop = asyncio.get_running_loop()
    o = _SseOut(response, loop, settings.stream_interval)
    # Before the headers: errors are still HTTP statuses (ProxyError propagates).
    deadline = o.last_event + ping_s
    silent = False
    # A queue_progress chunk (the request waits in the worker's queue, after
    # every check that could refuse it) is worth sending the headers for.
    while not (response.started or response.done or o.buf):
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
        log.debug("client of %s went away before the headers", response.header.id)
        record.client_gone = True
        return resp
    assert writer is not None
    o.last_write = loop.time()  # the headers count: the first ping is due ping_s after them
    if silent:
        o.buf.append(sse.PING)
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
                    await out.drain()
                    continue
            if o.closed:
                break
            now = loop.time()
            if now >= o.last_event + idle_after:
                raise idle_timeout(idle_s)
            if now >= o.last_write + ping_s:
                o.buf.append(sse.PING)
                continue
            if not stream.attach(o.deliver):
                continue  # events came meanwhile: take them first
            try:
                await stream.wait(min(o.last_write + ping_s, o.last_event + idle_after))
            finally:
                stream.detach()
        await resp.write_eof()
    except ProxyError as e:
        record.fail(e)
        await _write_error(resp, o.buf, e)
    except ConnectionResetError:
        log.debug("client of %s went away", response.header.id)
        record.client_gone = True
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("stream %s failed", response.header.id, exc_info=e)
        err = EngineInternalError(f"Internal error: {type(e).__name__}")
        record.fail(err)
        await _write_error(resp, o.buf, err)
    return resp


async def _write_error(resp: web.StreamResponse, buf: list[bytes], exc: ProxyError) -> None:
    """After the headers the status is fixed: the chunks still pending, one
    ``data: {"error": ...}`` event, then ``[DONE]``."""
    buf.append(sse.event(envelope(exc)))
    buf.append(sse.DONE)
    try:
        await resp.write(b"".join(buf))
        await resp.write_eof()
    except ConnectionResetError:
        pass


class _Collected:
    """A non-stream response's state between its task and the reader."""

    __slots__ = ("error", "last_event", "loop", "response", "scratch")

    def __init__(self, response: ResponseState, loop: asyncio.AbstractEventLoop) -> None:
        self.response = response
        self.loop = loop
        # Feeding is what assembles the response; its stream chunks are dropped.
        self.scratch: list[StreamChunk] = []
        self.error: Exception | None = None
        self.last_event = loop.time()

    def feed(self, events: list[Event]) -> None:
        try:
            for ev in events:
                self.response.feed(ev, self.scratch)
        except Exception as e:
            self.error = e
        self.scratch.clear()

    def deliver(self, events: list[Event]) -> bool:
        self.last_event = self.loop.time()
        self.feed(events)
        return self.error is None and not self.response.done


async def complete_response(stream: RequestStream, response: ResponseState, idle_s: float) -> web.Response:
    """Serve ``response`` as one JSON body once every choice finished. Raises
    the ``ProxyError`` of a failed request, ``GatewayTimeout`` after
    ``idle_s`` seconds without an event (0: no limit)."""
    loop = asyncio.get_running_loop()
    idle_after = idle_s or math.inf
    c = _Collected(response, loop)
    while True:
        events = stream.take()
        if events:
            c.last_event = loop.time()
            c.feed(events)
        if c.error is not None:
            raise c.error
        if response.done:
            return web.Response(body=encode(response.response()), content_type="application/json")
        if loop.time() >= c.last_event + idle_after:
            raise idle_timeout(idle_s)
        if not stream.attach(c.deliver):
            continue
        try:
            await stream.wait(c.last_event + idle_after)
        finally:
            stream.detach()
