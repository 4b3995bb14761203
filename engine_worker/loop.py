"""The worker's engine loop: receive, queue, admit, step, send; dispatch only.

Every call that touches engine state happens on the thread that runs
``EngineLoop.run`` (ExLlamaV3 requires ``enqueue``/``cancel`` on the thread that
calls ``iterate``). Socket I/O happens between engine steps, so a step's events
leave as one ``EventBatch`` as soon as the step returns. Heartbeats come from a
thread of their own (``engine_worker.heartbeat``), so a long step never looks like
a dead worker.

A ``Submit`` is validated at once (``admission.validate_request``, the one place
requests are checked, by the backend's ``ModelInfo``), then prepared (templated,
tokenized once for its ``n`` choices) on a thread of its own, so a long prompt
never stalls the token flow of the running sequences (``Tokenize``/``Detokenize``
run on another: ``engine_worker.lookups``), then checked against the context and
given its completion budget (``admission.budget``): a request that would fail
never shows queue progress. Then it waits in the bounded ``AdmissionQueue``
(``engine_worker.waiting``: FIFO with backfilling, ``QueueProgress``) until all
its choices fit together: running sequences plus ``n`` within ``max_batch_size``,
and KV reservations within ``kv_cache_tokens`` (``ModelInfo``; the CPU engine's
``--kv-cache-mb`` and ExLlamaV3's cache pages, which 1.6.5 allocates per job at
admission, are both counted this way). A request that can never fit is refused at
once (``n`` over the batch size: ``INVALID_REQUEST``; KV:
``CONTEXT_LENGTH_EXCEEDED``), and so is one that finds the queue full
(``QUEUE_FULL``). Every sequence the worker drops gets a terminal event: refused,
failed in a step, or still queued, preparing or running when the worker stops, or
aborted (``_abort``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from engine_worker.admission import budget, validate_request
from engine_worker.backend import ENGINE_FAILED_EXIT_STATUS, Backend, EngineFailed, Prepared, RequestRejected
from engine_worker.heartbeat import Heartbeats, LoopStats
from engine_worker.kv_events import BatchSink, KvEvents
from engine_worker.lookups import Lookups
from engine_worker.sockets import WorkerSockets
from engine_worker.waiting import AdmissionQueue, Queued
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    Detokenize,
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    ProxyMessage,
    Ready,
    RequestError,
    Submit,
    Tokenize,
    choice_ids,
    choice_seed,
)
from protocol.messages import MODALITY_IMAGE, MODALITY_TEXT, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Preparing:
    submit: Submit
    ids: list[str]
    future: Future[Prepared]
    aborted: bool = False
    arrived: float = field(default_factory=time.monotonic)


class EngineLoop:
    """Runs ``backend`` behind ``sockets`` until ``stop`` is set.

    ``heartbeat_interval``: seconds between heartbeats. ``max_queue``: requests
    that may wait for admission. ``backfill_max_wait``: seconds the queue's
    head may be passed by later requests that fit (0: strict FIFO).
    ``parent_pid``: stop when this process is gone (checked every heartbeat;
    ``serve`` passes its own pid). ``heartbeat_file``:
    where each heartbeat is also written (``protocol.liveness``), for probes
    that need no ZeroMQ peer. ``kv_events``: the backend's KV-cache events
    (``engine_worker.kv_events``), flushed at the start and once per turn of the loop;
    ``kv_events_sink``: where they go, whose drops the heartbeats report.
    ``worker_id``: this process's id in ``Ready`` and heartbeats (default: a new
    one), the one its ``Loading`` messages carried.
    """

    def __init__(
        self,
        backend: Backend,
        sockets: WorkerSockets,
        *,
        heartbeat_interval: float,
        max_queue: int,
        backfill_max_wait: float = 0.0,
        parent_pid: int | None = None,
        heartbeat_file: Path | None = None,
        kv_events: KvEvents | None = None,
        kv_events_sink: BatchSink | None = None,
        worker_id: str | None = None,
    ) -> None:
        self._backend = backend
        self._sockets = sockets
        self._max_queue = max_queue
        self._kv_events = kv_events
        self.worker_id = worker_id or uuid.uuid4().hex
        self._hello_pending = False
        self._queue = AdmissionQueue(backfill_max_wait)
        self._preparing: deque[_Preparing] = deque()
        self._preparing_ids: dict[str, _Preparing] = {}
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="worker-prepare")
        self._lookups = Lookups(backend)
        # Seconds each running sequence spent from arrival to start (_add_wait).
        self._waited: dict[str, float] = {}
        # Request id of each started choice id, to count requests, not sequences.
        self._request_of: dict[str, str] = {}
        self._stats = LoopStats()
        self._heartbeats = Heartbeats(
            sockets,
            self.worker_id,
            self._stats,
            interval=heartbeat_interval,
            parent_pid=parent_pid,
            heartbeat_file=heartbeat_file,
            kv_events_sink=kv_events_sink,
        )

    def _ready(self) -> Ready:
        info = self._backend.info
        return Ready(
            protocol_version=PROTOCOL_VERSION,
            worker_id=self.worker_id,
            model_id=info.model_id,
            backend=type(self._backend).__name__,
            max_context_tokens=info.max_context_tokens,
            drafting=info.drafting,
            longest_token_chars=info.longest_token_chars,
            max_batch_size=info.max_batch_size,
            max_queue=self._max_queue,
            kv_cache_tokens=min(info.kv_cache_tokens, 2**62),
            chat_template=info.chat_template,
            kv_block_tokens=info.kv_block_tokens,
            reasoning_parser=info.reasoning_parser,
            kernels=dict(info.kernels) or None,
            modalities=(MODALITY_TEXT, MODALITY_IMAGE) if info.vision else (MODALITY_TEXT,),
        )

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; the caller closes backend and sockets.

        ``Ready`` goes out only as the answer to a ``Hello``: a Hello that arrived
        proves the proxy's request socket is connected, so a proxy never turns
        ready before it can submit."""
        self._heartbeats.start(stop)
        backend = self._backend
        stats = self._stats
        if self._kv_events is not None:
            self._kv_events.flush()  # AllBlocksCleared: this process starts empty
        try:
            while not stop.is_set():
                pending: list[Event] = []
                busy = self._preparing or self._lookups
                wait_ms = 0 if backend.active_ids() else 5 if busy else 100
                for msg in self._sockets.receive(wait_ms):
                    self._handle(msg, pending)
                if self._hello_pending:
                    self._hello_pending = False
                    self._sockets.send(self._ready())
                self._collect_prepared(pending)
                self._lookups.collect(pending)
                self._admit(pending)
                self._update_stats()
                if backend.active_ids():
                    stats.step_started = time.monotonic()
                    try:
                        pending.extend(self._add_wait(self._step()))
                    except EngineFailed as e:
                        self._give_up(e, pending)
                    stats.step_started = 0.0
                    # Prepared during the step: queued (and reported) now, not after the next one.
                    self._collect_prepared(pending)
                    self._admit(pending)
                    self._update_stats()
                if self._queue:
                    pending.extend(self._queue.progress())
                if self._kv_events is not None:
                    # What this turn's step and aborts changed in the cache: one batch
                    # (nothing when nothing changed, a set lookup).
                    self._kv_events.flush()
                if pending:
                    self._sockets.send(EventBatch(pending))
            dropped = self._drop_all("the engine worker is shutting down")
            if dropped:
                self._sockets.send(EventBatch(dropped))
        finally:
            self._prepare_pool.shutdown(wait=True, cancel_futures=True)
            self._lookups.close()
            self._heartbeats.close()

    def _update_stats(self) -> None:
        stats = self._stats
        stats.waiting = len(self._queue)
        active = self._backend.active_ids()
        stats.running = len(active)
        request_of = self._request_of
        stats.running_requests = len({request_of.get(rid, rid) for rid in active})
        if len(request_of) > 2 * len(active) + 64:
            self._request_of = {rid: r for rid, r in request_of.items() if rid in active}
        stats.kv_usage = min(1.0, self._backend.kv_reserved() / self._backend.info.kv_cache_tokens)

    # ---------------------------------------------------------------- messages

    def _handle(self, msg: ProxyMessage, pending: list[Event]) -> None:
        if isinstance(msg, Submit):
            self._submit(msg, pending)
        elif isinstance(msg, Tokenize | Detokenize):
            self._lookups.submit(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.request_ids, pending)
        elif msg.protocol_version == PROTOCOL_VERSION:
            # Answered once per batch received: the Hellos a proxy kept sending
            # while the model loaded (every handshake_interval) arrive together.
            self._hello_pending = True
        else:
            log.error(
                "proxy %s speaks protocol version %d, this worker speaks %d: not answering",
                msg.proxy_id,
                msg.protocol_version,
                PROTOCOL_VERSION,
            )

    def _abort(self, request_ids: tuple[str, ...], pending: list[Event]) -> None:
        """Drop these choices now: running ones one by one, a queued or preparing
        request whole (its choices wait and start together). Every sequence dropped
        gets a terminal ``RequestError`` (``ABORTED``): the proxy that sent the
        Abort has forgotten the ids and ignores it (``ZmqEngineClient._route`` drops
        terminal events of unknown ids without a second Abort), and whoever else
        holds the stream (an Abort it did not send, a choice its Abort did not name)
        learns at once that it is over instead of waiting for its idle timeout."""
        active = self._backend.active_ids()
        dropped: list[str] = []
        for rid in request_ids:
            queued = self._queue.get(rid)
            preparing = self._preparing_ids.get(rid)
            if queued is not None:
                self._queue.remove(queued)
                dropped += queued.ids
            elif preparing is not None and not preparing.aborted:
                preparing.aborted = True
                dropped += preparing.ids
            elif rid in active:
                self._backend.abort(rid)
                dropped.append(rid)
        message = "the request was aborted in the engine worker (an Abort for it arrived)"
        pending.extend(RequestError(rid, ErrorCode.ABORTED, message) for rid in dict.fromkeys(dropped))

    def _submit(self, msg: Submit, pending: list[Event]) -> None:
        ids = choice_ids(msg.request_id, max(1, msg.n))
        active = self._backend.active_ids()
        if any(rid in active or rid in self._queue or rid in self._preparing_ids for rid in ids):
            duplicate = "duplicate request id"
            pending.extend(RequestError(rid, ErrorCode.INVALID_REQUEST, duplicate) for rid in ids)
            return
        try:
            validate_request(msg, self._backend.info)
        except RequestRejected as e:
            pending.extend(RequestError(rid, e.code, e.message, e.param) for rid in ids)
            return
        entry = _Preparing(msg, ids, self._prepare_pool.submit(self._backend.prepare, msg))
        self._preparing.append(entry)
        for rid in ids:
            self._preparing_ids[rid] = entry

    def _collect_prepared(self, pending: list[Event]) -> None:
        """Queue the requests whose preparation finished, in arrival order."""
        while self._preparing and self._preparing[0].future.done():
            entry = self._preparing.popleft()
            for rid in entry.ids:
                del self._preparing_ids[rid]
            if not entry.aborted:
                self._enqueue(entry, pending)

    def _enqueue(self, entry: _Preparing, pending: list[Event]) -> None:
        msg, ids, info = entry.submit, entry.ids, self._backend.info
        try:
            prepared = budget(entry.future.result(), info)
            reservation = msg.n * self._backend.reservation(prepared)
            if reservation > info.kv_cache_tokens:
                raise RequestRejected(
                    ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                    f"This request needs {reservation} tokens of KV cache ({msg.n} choice(s) of "
                    f"{prepared.prompt_tokens} prompt tokens plus max_tokens), more than the "
                    f"{info.kv_cache_tokens} the worker has (kv_cache_mb / cache_size); lower "
                    "max_tokens or n.",
                    prepared.param,
                )
            full = len(self._queue) >= self._max_queue
            if full and (self._queue or not self._fits_now(msg.n, reservation)):
                raise RequestRejected(
                    ErrorCode.QUEUE_FULL,
                    f"The engine queue is full ({self._max_queue} requests waiting, max_queue); retry later",
                )
        except RequestRejected as e:
            pending.extend(RequestError(rid, e.code, e.message, e.param) for rid in ids)
            return
        except Exception as e:
            # A bug or an engine fault preparing one request must not take the
            # worker (and every other request) down.
            log.error("preparing %s failed", msg.request_id, exc_info=e)
            text = f"admission failed: {type(e).__name__}: {e}"
            pending.extend(RequestError(rid, ErrorCode.INTERNAL, text) for rid in ids)
            return
        queued = Queued(prepared, ids, reservation, entry.arrived)
        self._queue.append(queued)
        # At once, so the queue holds only what cannot start yet.
        self._admit(pending)
        queued.waited = True

    # ---------------------------------------------------------------- admission and steps

    def _fits_now(self, n: int, reservation: int) -> bool:
        backend = self._backend
        info = backend.info
        return (
            len(backend.active_ids()) + n <= info.max_batch_size
            and backend.kv_reserved() + reservation <= info.kv_cache_tokens
        )

    def _admit(self, pending: list[Event]) -> None:
        """Start what fits, in the queue's order (``AdmissionQueue.next_to_start``)."""
        while (chosen := self._queue.next_to_start(self._fits_now)) is not None:
            self._start(chosen, pending)

    def _add_wait(self, events: list[Event]) -> list[Event]:
        """``Finished.time_queued`` from the Submit's arrival: the backend counts
        only its own wait, not tokenizing and this loop's queue before ``start``."""
        waited = self._waited
        if not waited:
            return events
        for i, ev in enumerate(events):
            if isinstance(ev, Finished | RequestError) and ev.request_id is not None:
                w = waited.pop(ev.request_id, None)
                if w is not None and isinstance(ev, Finished):
                    events[i] = msgspec.structs.replace(ev, time_queued=ev.time_queued + w)
        if len(waited) > 2 * self._backend.info.max_batch_size:
            # Aborted sequences end without an event here: forget them.
            active = self._backend.active_ids()
            self._waited = {rid: w for rid, w in waited.items() if rid in active}
        return events

    def _start(self, queued: Queued, pending: list[Event]) -> None:
        waited = time.monotonic() - queued.arrived
        for rid in queued.ids:
            self._waited[rid] = waited
            self._request_of[rid] = queued.prepared.submit.request_id
        params = queued.prepared.submit.params
        started: list[str] = []
        try:
            for i, rid in enumerate(queued.ids):
                p = params if params.seed is None else _with_seed(params, choice_seed(params.seed, i))
                self._backend.start(rid, queued.prepared, p)
                started.append(rid)
        except Exception as e:
            # The choices run together or not at all.
            for rid in started:
                self._backend.abort(rid)
            if isinstance(e, RequestRejected):
                pending.extend(RequestError(rid, e.code, e.message, e.param) for rid in queued.ids)
            else:
                log.exception("starting %s failed", queued.ids[0])
                text = f"admission failed: {type(e).__name__}: {e}"
                pending.extend(RequestError(rid, ErrorCode.INTERNAL, text) for rid in queued.ids)

    def _give_up(self, error: EngineFailed, pending: list[Event]) -> None:
        """Fail everything held and exit: a fresh process is the only repair left."""
        log.critical("worker: %s; exiting with status %d to be restarted", error, ENGINE_FAILED_EXIT_STATUS)
        pending.extend(self._drop_all(f"the engine failed and the worker is restarting: {error}"))
        self._sockets.send(EventBatch(pending))
        raise SystemExit(ENGINE_FAILED_EXIT_STATUS) from error

    def _step(self) -> list[Event]:
        try:
            return self._backend.step()
        except EngineFailed:
            raise
        except Exception as e:
            # The backend's state for these requests is unknown now: fail them all
            # and keep serving new ones rather than taking the worker down.
            log.exception("engine step failed; failing %d active requests", len(self._backend.active_ids()))
            return self._fail_active(f"engine step failed: {e}", ErrorCode.INTERNAL)

    def _fail_active(self, message: str, code: ErrorCode) -> list[Event]:
        failed = sorted(self._backend.active_ids())
        for rid in failed:
            try:
                self._backend.abort(rid)
            except Exception:
                # The engine may be too broken to cancel cleanly; the request
                # is failed towards the proxy either way.
                log.exception("abort of %s also failed", rid)
        return [RequestError(rid, code, message) for rid in failed]

    def _drop_all(self, message: str) -> list[Event]:
        out = self._fail_active(message, ErrorCode.OVERLOADED)
        for entry in self._preparing:
            if not entry.aborted:
                out.extend(RequestError(rid, ErrorCode.OVERLOADED, message) for rid in entry.ids)
        self._preparing.clear()
        self._preparing_ids.clear()
        for queued in list(self._queue):
            self._queue.remove(queued)
            out.extend(RequestError(rid, ErrorCode.OVERLOADED, message) for rid in queued.ids)
        return out


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(params, seed=seed)
