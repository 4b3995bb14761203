"""The proxy's side of the engine connection.

``EngineClient`` is the interface the HTTP handlers depend on; ``ZmqEngineClient``
implements it over ZeroMQ (tests use a scripted fake). Both hand out one
``proxy.engine.stream.RequestStream`` per request.

The fast path: a consumer with nothing to await (a stream whose client keeps up)
attaches a *sink* to its ``RequestStream``; the one reader task then hands each
engine step's events of that request straight to the sink, once per step and
after the whole batch is routed, and the consumer's task sleeps until the sink
hands back (the response is done, an error, a congested client) or one of its
deadlines comes. An engine step of N streams is then one pass of the reader,
not N task wake-ups.

Socket contract (the worker's ``engine_worker/sockets.py`` is the other side; default
addresses in ``protocol.endpoints``): the worker binds a
PULL socket at ``input_addr`` and a PUSH socket at ``output_addr``; the proxy
connects a PUSH to ``input_addr`` and a PULL to ``output_addr``. Frames are
``protocol.codec``'s ``[version, payload]``.

Life cycle: the client sends ``Hello`` every ``handshake_interval`` until a
``Ready`` of our protocol version arrives. The worker is declared dead when
nothing arrives for ``heartbeat_timeout`` or the PULL socket's connection
drops (socket monitor ``EVENT_DISCONNECTED``); a ``Ready`` carrying another
``worker_id`` means the worker restarted. In each case every request in flight
gets one ``EngineDead`` and the client goes back to sending ``Hello``, so a
restarted worker is picked up. A peer speaking another protocol version is
logged once at ERROR level and never becomes ready.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import zmq
import zmq.asyncio

from protocol.codec import decode_worker_message, encode
from protocol.errors import ProtocolError, VersionMismatch
from protocol.messages import (
    Abort,
    Detokenize,
    Detokenized,
    Event,
    EventBatch,
    Finished,
    Heartbeat,
    Hello,
    Loading,
    ProxyMessage,
    Ready,
    RequestError,
    Submit,
    Tokenize,
    Tokens,
    choice_ids,
)
from protocol.version import PROTOCOL_VERSION
from proxy.engine.stream import RequestStream
from proxy.errors import (
    NOT_READY_MESSAGE,
    EngineDead,
    EngineNotReady,
    EngineUnavailable,
    ProxyError,
    ShuttingDown,
)
from proxy.settings import MIB, ProxySettings

log = logging.getLogger(__name__)

# Request ids already sent an Abort for as orphans (see ``_route``).
_ORPHAN_MEMORY = 4096

SEND_HWM = 10_000
"""Messages the proxy's PUSH socket queues before sends fail with EAGAIN (503)."""

# A tuple: ``A | B`` would build a union per event.
_TERMINAL = (Finished, RequestError, Tokens, Detokenized)

_STEPS_PER_PASS = 16
"""Most worker messages (engine steps) the reader routes before it delivers and
yields to the event loop (``ZmqEngineClient._read_loop``)."""


class EngineClient(Protocol):
    """What the HTTP handlers need from the engine connection.

    ``worker`` is the last accepted ``Ready`` (model id, ``max_context_tokens``
    in tokens), ``None`` before the first handshake; ``ready`` is true while the
    worker is connected, alive and of our protocol version.
    """

    @property
    def ready(self) -> bool: ...

    @property
    def worker(self) -> Ready | None: ...

    @property
    def loading(self) -> Loading | None:
        """The latest ``Loading`` of a worker that is loading its model (its stage),
        while not ready and heard from within ``heartbeat_timeout``; else ``None``."""
        ...

    @property
    def worker_active_requests(self) -> int | None:
        """Requests the worker holds, from its latest ``Heartbeat``; ``None``
        before the first one. Lets operators (and tests) see that abandoned
        requests were freed in the engine, not just forgotten by the proxy."""
        ...

    @property
    def heartbeat(self) -> Heartbeat | None:
        """The latest ``Heartbeat`` of the current worker (running and waiting
        requests, KV cache usage); ``None`` before the first one."""
        ...

    @property
    def heartbeat_at(self) -> float | None:
        """``time.monotonic()`` when ``heartbeat`` arrived; ``None`` without one."""
        ...

    @property
    def worker_since(self) -> float | None:
        """``time.monotonic()`` when the current worker's first ``Ready`` was
        accepted (its uptime as this proxy sees it); ``None`` before one."""
        ...

    async def start(self) -> None:
        """Connect and begin the handshake; returns without waiting for it."""
        ...

    async def close(self) -> None:
        """Stop background work; pending streams fail with ``ShuttingDown``."""
        ...

    def submit(self, *submits: Submit) -> RequestStream:
        """Send the ``Submit``s of an HTTP request (one, or one per prompt of a
        ``/v1/completions`` prompt list) and return the one stream the events of
        all their choices (``choice_ids(s.request_id, s.n)``, in order) arrive
        on. Raises ``EngineNotReady`` when not ready and ``EngineUnavailable``
        when the worker cannot take them now; then nothing was submitted (those
        already sent are aborted)."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None:
        """Tell the worker to drop these choices (``choice_ids``); no more events
        are routed for them."""
        ...

    def lookup(self, msg: Tokenize | Detokenize) -> RequestStream:
        """Send a ``Tokenize``/``Detokenize``; its one answer (``Tokens``,
        ``Detokenized`` or a ``RequestError``) arrives on the returned stream.
        Raises as ``submit`` does."""
        ...


class ZmqEngineClient:
    """``EngineClient`` over ZeroMQ (``zmq.asyncio``). Use from one event loop.

    One reader task decodes the PULL socket and routes ``EventBatch`` events by
    request id into their ``RequestStream``; one supervisor task sends ``Hello``
    while not ready and checks the heartbeat deadline; one task watches the
    PULL socket's monitor for disconnects.
    """

    def __init__(self, settings: ProxySettings, *, proxy_id: str | None = None) -> None:
        self._settings = settings
        self.proxy_id = proxy_id or uuid.uuid4().hex
        self._ready = False
        self._worker: Ready | None = None
        self._heartbeat: Heartbeat | None = None
        self._heartbeat_at = 0.0
        self._loading: Loading | None = None
        self._loading_at = 0.0
        self._worker_since = 0.0
        self._orphans_aborted: set[str] = set()
        self._routes: dict[str, RequestStream] = {}
        # Streams with a sink that got events since the last delivery (_deliver).
        self._ready_streams: list[RequestStream] = []
        self._last_rx = 0.0
        self._last_hello = -float("inf")
        self._mismatch_logged: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.Socket[bytes] | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._broken = False  # a background task died: never ready again

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def worker(self) -> Ready | None:
        return self._worker

    @property
    def loading(self) -> Loading | None:
        if self._ready or self._loading is None:
            return None
        if time.monotonic() - self._loading_at > self._settings.heartbeat_timeout:
            return None  # the loading worker went silent: gone, or restarting
        return self._loading

    @property
    def worker_active_requests(self) -> int | None:
        hb = self.heartbeat
        return hb.active_requests if hb is not None else None

    @property
    def heartbeat(self) -> Heartbeat | None:
        # Only the current worker's: after a restart the dead one's last load
        # (running requests, KV use) would mislead a router until the new one beats.
        hb, worker = self._heartbeat, self._worker
        if hb is None or worker is None or hb.worker_id != worker.worker_id:
            return None
        return hb

    @property
    def heartbeat_at(self) -> float | None:
        return self._heartbeat_at if self.heartbeat is not None else None

    @property
    def worker_since(self) -> float | None:
        return self._worker_since if self._worker is not None else None

    @property
    def in_flight(self) -> int:
        """Engine requests with a route (submitted, not finished or aborted)."""
        return len(self._routes)

    async def start(self) -> None:
        """Create and connect the sockets and start the reader, supervisor and
        monitor tasks. Raises ``zmq.ZMQError`` for an invalid address."""
        if self._ctx is not None:
            return
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        # Sends are never awaited (NOBLOCK, EAGAIN -> 503), so a plain socket on
        # the same context is enough for the request direction.
        push: zmq.Socket[bytes] = zmq.Context.shadow(ctx.underlying).socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        # Queue only on a completed connection: with no worker, sends fail at
        # once instead of piling up for a worker that may never come.
        push.setsockopt(zmq.IMMEDIATE, 1)
        push.setsockopt(zmq.SNDHWM, SEND_HWM)
        input_addr, output_addr = self._settings.addresses
        push.connect(input_addr)
        self._push = push
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        self._monitor = pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        pull.connect(output_addr)
        self._pull = pull
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="engine-reader"),
            asyncio.create_task(self._supervise_loop(), name="engine-supervisor"),
            asyncio.create_task(self._monitor_loop(), name="engine-monitor"),
        ]
        for t in self._tasks:
            t.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        # These loops only end by cancellation; anything else leaves the proxy
        # deaf, so make it loud and stop claiming readiness.
        if task.cancelled():
            return
        exc = task.exception()
        log.critical("engine client task %s stopped: %r", task.get_name(), exc, exc_info=exc)
        self._declare_dead(f"the proxy's {task.get_name()} task failed")
        self._broken = True

    async def close(self) -> None:
        """Cancel the tasks, fail pending streams with ``ShuttingDown``, close the sockets."""
        for t in self._tasks:
            t.cancel()
        # A task that already failed was reported by _task_done.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._fail_all(ShuttingDown("The proxy is shutting down"))
        self._ready = False
        if self._pull is not None and self._monitor is not None:
            self._pull.disable_monitor()
            self._monitor.close(linger=0)
        for s in (self._pull, self._push):
            if s is not None:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._ctx = self._pull = self._push = self._monitor = None

    # ------------------------------------------------------------- requests

    def submit(self, *submits: Submit) -> RequestStream:
        if not self._ready:
            raise EngineNotReady(NOT_READY_MESSAGE)
        ids: list[str] = []
        for submit in submits:
            if not self._send(submit):
                if ids:
                    self.abort(ids)
                raise EngineUnavailable(
                    "The engine worker cannot take requests now "
                    "(its input queue is full or it is not connected)"
                )
            ids += choice_ids(submit.request_id, submit.n)
        stream = RequestStream(
            ids,
            self._settings.request_queue_max,
            ready=self._ready_streams,
            max_merged_bytes=int(self._settings.max_stream_buffer_mb * MIB),
        )
        for rid in ids:
            self._routes[rid] = stream
        return stream

    def lookup(self, msg: Tokenize | Detokenize) -> RequestStream:
        if not self._ready:
            raise EngineNotReady(NOT_READY_MESSAGE)
        rid = msg.submit.request_id if isinstance(msg, Tokenize) else msg.request_id
        if not self._send(msg):
            raise EngineUnavailable(
                "The engine worker cannot take requests now (its input queue is full or it is not connected)"
            )
        stream = RequestStream([rid], self._settings.request_queue_max, ready=self._ready_streams)
        self._routes[rid] = stream
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._routes.pop(rid, None)
        if not request_ids:
            return
        if self._send(Abort(tuple(request_ids))):
            self._orphans_aborted.update(request_ids)  # late events need no second Abort
        else:
            # Not lost for good: the request's next event will resend it (``_route``).
            log.debug("abort of %s not sent: worker not connected", ", ".join(request_ids))

    def _send(self, msg: ProxyMessage) -> bool:
        if self._push is None:
            return False
        try:
            # copy=False: a large frame (a Submit with images) is handed over instead of copied
            # into a zmq message, which costs the loop 18 ms for 32 MiB (benchmarks/submit_wire.py);
            # pyzmq still copies frames under the socket's copy_threshold (64 KiB), where that is cheaper.
            self._push.send_multipart(encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    # ------------------------------------------------------------- liveness

    def _fail_all(self, exc: ProxyError) -> None:
        streams = {id(s): s for s in self._routes.values()}
        self._routes.clear()
        for s in streams.values():
            s.fail(exc)

    def _declare_dead(self, reason: str) -> None:
        if self._ready:
            log.error("engine worker %s declared dead: %s", self._worker_id(), reason)
        self._ready = False
        if self._routes:
            lost = tuple(self._routes)
            # The worker may only be stalled: free its work if it comes back.
            self._send(Abort(lost))
            self._fail_all(
                EngineDead(f"The engine worker stopped responding ({reason}); the request was lost")
            )

    def _worker_id(self) -> str:
        return self._worker.worker_id if self._worker is not None else "?"

    def _refuse_version(self, theirs: str) -> None:
        if self._mismatch_logged != theirs:
            self._mismatch_logged = theirs
            log.error(
                "engine worker speaks protocol version %s, this proxy speaks %s: "
                "not connecting (upgrade the proxy and worker containers together)",
                theirs,
                PROTOCOL_VERSION,
            )
        if self._ready or self._routes:
            self._declare_dead(f"it now speaks protocol version {theirs}")
        self._ready = False

    def _on_ready(self, msg: Ready) -> None:
        if self._broken:
            return
        if msg.protocol_version != PROTOCOL_VERSION:
            self._refuse_version(str(msg.protocol_version))
            return
        self._mismatch_logged = None
        if self._worker is not None and msg.worker_id != self._worker.worker_id:
            log.warning("engine worker restarted: %s -> %s", self._worker.worker_id, msg.worker_id)
            if self._routes:
                self._fail_all(EngineDead("The engine worker restarted; the request was lost"))
        if not self._ready:
            log.info(
                "engine worker %s ready: model %s, backend %s, context %d tokens, drafting %s",
                msg.worker_id,
                msg.model_id,
                msg.backend,
                msg.max_context_tokens,
                msg.drafting or "off",
            )
        if self._worker is None or msg.worker_id != self._worker.worker_id:
            self._worker_since = time.monotonic()
        self._worker = msg
        self._ready = True
        self._loading = None

    def _route(self, events: list[Event]) -> None:
        orphans: list[str] = []
        for ev in events:
            rid = ev.request_id
            if rid is None:  # a RequestError of the whole worker
                assert isinstance(ev, RequestError)
                log.error("engine worker failed: %s (%s)", ev.message, ev.code)
                streams = {id(s): s for s in self._routes.values()}
                self._routes.clear()
                for s in streams.values():
                    s.put(ev)
                continue
            stream = self._routes.get(rid)
            if stream is None:
                # Aborted, owned by a request that already failed, or left over
                # from before a proxy restart. A request still producing events
                # is still using the engine: (re)send its Abort, once per id, so
                # an orphan never runs to max_tokens (a lost Abort included).
                if not isinstance(ev, _TERMINAL):
                    orphans.append(rid)
                continue
            stream.put(ev)
            if isinstance(ev, _TERMINAL):
                del self._routes[rid]

        if orphans:
            self._abort_orphans(orphans)

    def _deliver(self) -> None:
        """Hand the streams with a sink what the batches routed since the last
        call brought them: one delivery (one write to its client) per stream."""
        ready = self._ready_streams
        if ready:
            try:
                for s in ready:
                    s.deliver()
            finally:
                ready.clear()

    def _abort_orphans(self, ids: list[str]) -> None:
        fresh = [rid for rid in dict.fromkeys(ids) if rid not in self._orphans_aborted]
        if fresh and self._send(Abort(tuple(fresh))):
            log.info("aborting %d engine request(s) no client waits for: %s", len(fresh), ", ".join(fresh))
            # Bounded memory: only recent ids matter, late events stop soon after.
            if len(self._orphans_aborted) > _ORPHAN_MEMORY:
                self._orphans_aborted.clear()
            self._orphans_aborted.update(fresh)

    # ------------------------------------------------------------- tasks

    async def _read_loop(self) -> None:
        assert self._pull is not None
        pull = self._pull
        while True:
            self._on_message(await pull.recv_multipart())
            # Engine steps already queued behind this one mean the proxy fell
            # behind: route them too, so each stream gets one delivery (one write)
            # for all of them. A pass then costs per stream, not per step, and
            # the reader catches up instead of falling further behind.
            for _ in range(_STEPS_PER_PASS - 1):
                try:
                    frames = await pull.recv_multipart(zmq.NOBLOCK)  # a done future: no wait
                except zmq.Again:
                    break
                self._on_message(frames)
            self._deliver()
            # recv_multipart returns at once while messages are queued: yield, so
            # that transports, timers and new connections run between passes.
            await asyncio.sleep(0)

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = decode_worker_message(frames)
        except VersionMismatch as e:
            self._refuse_version(e.theirs)
            return
        except ProtocolError as e:
            log.error("dropping undecodable message from the engine worker: %s", e)
            return
        self._last_rx = time.monotonic()
        if isinstance(msg, EventBatch):
            self._route(msg.events)
        elif isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, Loading):
            if not self._ready:  # one sent just before the Ready may arrive after it
                self._loading, self._loading_at = msg, self._last_rx
        elif isinstance(msg, Heartbeat):
            if msg.worker_id == self._worker_id():
                self._heartbeat = msg
                self._heartbeat_at = self._last_rx
            elif self._ready:
                # Another worker process speaks on our socket: ours restarted and
                # its Ready was lost before we reconnected. Our requests died with
                # the old process; handshake again with the new one.
                self._declare_dead(f"worker {msg.worker_id} replaced {self._worker_id()}")
            else:
                log.debug("heartbeat from worker %s before its Ready", msg.worker_id)

    async def _supervise_loop(self) -> None:
        cfg = self._settings
        tick = min(cfg.handshake_interval, cfg.heartbeat_timeout / 4)
        while True:
            now = time.monotonic()
            if self._ready and now - self._last_rx > cfg.heartbeat_timeout:
                self._declare_dead(f"no message for {cfg.heartbeat_timeout:g} s, see heartbeat_timeout")
            if not self._ready and now - self._last_hello >= cfg.handshake_interval:
                self._last_hello = now
                self._send(Hello(PROTOCOL_VERSION, self.proxy_id))
            await asyncio.sleep(tick)

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        monitor = self._monitor
        while True:
            frames = await monitor.recv_multipart()
            # libzmq monitor event: frame 0 is a 16-bit event id and a 32-bit value.
            (event_id, _value) = struct.unpack("=hi", frames[0][:6])
            if event_id == zmq.EVENT_DISCONNECTED:
                self._declare_dead("its event socket disconnected")
