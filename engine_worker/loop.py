"""The worker's engine loop: receive, queue, admit, step, send.

Every call that touches engine state happens on the thread that runs
``EngineLoop.run`` (ExLlamaV3 requires ``enqueue``/``cancel`` on the thread that
calls ``iterate``). Socket I/O happens between engine steps, so a step's events
leave as one ``EventBatch`` as soon as the step returns. Heartbeats come from a
thread of their own (``_beat``), so a long step never looks like a dead worker.

Admission: a ``Submit`` is validated at once (``admission.validate_request``:
sampling and limits, by the backend's ``ModelInfo``; the one place they are
checked), then prepared (templated, tokenized once for its ``n`` choices) on a
thread of its own, so a long prompt never stalls the token flow of the running
sequences (``Tokenize``/``Detokenize`` lookups run on another, so a generation
request's preparation never waits behind them; both refuse at once a prompt
that cannot fit whatever it tokenizes to: ``admission.check_prompt_size``), then
checked against the context and given its completion budget
(``admission.budget``). So a request that would fail never shows queue
progress. Then, in arrival order, it waits in a
bounded queue until all its choices fit together: running sequences plus
``n`` within ``max_batch_size``, and KV reservations within
``kv_cache_tokens`` (``ModelInfo``). The queue is FIFO with backfilling: when
the head does not fit, the first later request that does may start, so short
requests keep moving while long reservations fill the budget; once the head has
waited ``backfill_max_wait`` seconds nothing passes it until it starts, so it
cannot starve (the KV reservations are backend-neutral: the CPU engine's
``--kv-cache-mb`` budget and ExLlamaV3's cache pages, which 1.6.5 allocates
per job at admission, are both counted this way). A request that can never fit is refused at
once (``n`` over the batch size: ``INVALID_REQUEST``; KV:
``CONTEXT_LENGTH_EXCEEDED``), and so is one that finds the queue full
(``QUEUE_FULL``). While a request waits it gets ``QueueProgress`` events: when
queued and whenever its position changes (``_report_queue``). Every sequence
the worker drops gets a terminal event: refused, failed in a step, or still
queued, preparing or running when the worker stops, or aborted (``_abort``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import msgspec

from engine_worker.admission import budget, check_prompt_size, validate_request
from engine_worker.backend import (
    ENGINE_FAILED_EXIT_STATUS,
    Backend,
    EngineFailed,
    ModelInfo,
    Prepared,
    RequestRejected,
)
from engine_worker.kv_events import BatchSink, KvEvents
from engine_worker.sockets import WorkerSockets
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    Detokenize,
    Detokenized,
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    Heartbeat,
    ProxyMessage,
    QueueProgress,
    Ready,
    RequestError,
    Submit,
    Tokenize,
    Tokens,
    choice_ids,
    choice_seed,
)
from protocol.liveness import Beat, write_beat
from protocol.messages import QUEUE_PROGRESS_INTERVAL_S, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Queued:
    prepared: Prepared
    ids: list[str]
    reservation: int  # KV tokens of all n choices
    arrived: float  # time.monotonic() when the Submit was received
    waited: bool = False  # still queued after the admission pass that queued it
    position: int = 0  # last position sent in a QueueProgress; 0: none sent
    reported_at: float = 0.0


class QueueRate:
    """How fast the queue empties: the times of the last ``window`` departures
    of requests that had to wait (a request admitted at once says nothing about
    the wait). ``eta(position, now)`` is the seconds until ``position`` more
    departures at the measured mean interval, counted from the last departure;
    ``None`` (no guess) with fewer than 3 departures, or when the last one is
    older than 3 mean intervals (the rate no longer holds: a long prefill, a
    batch of long generations)."""

    def __init__(self, window: int = 8) -> None:
        self._times: deque[float] = deque(maxlen=window)

    def departed(self, now: float) -> None:
        self._times.append(now)

    def eta(self, position: int, now: float) -> float | None:
        t = self._times
        if len(t) < 3:
            return None
        interval = (t[-1] - t[0]) / (len(t) - 1)
        if now - t[-1] > 3 * interval:
            return None
        return max(0.0, t[-1] + position * interval - now)


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
        self._heartbeat_interval = heartbeat_interval
        self._max_queue = max_queue
        self._backfill_max_wait = backfill_max_wait
        self._parent_pid = parent_pid
        self._heartbeat_file = heartbeat_file
        self._kv_events = kv_events
        self._kv_events_sink = kv_events_sink
        self.worker_id = worker_id or uuid.uuid4().hex
        self._hello_pending = False
        self._queue: deque[_Queued] = deque()
        self._queued_ids: dict[str, _Queued] = {}
        self._preparing: deque[_Preparing] = deque()
        self._preparing_ids: dict[str, _Preparing] = {}
        # Tokenize / Detokenize answers being computed on the lookup thread, in arrival order.
        self._lookups: deque[tuple[str, Future[Event]]] = deque()
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="worker-prepare")
        # Lookups have a thread of their own: a generation request's preparation never
        # waits behind them (each is bounded like a generation prompt: check_prompt_size).
        self._lookup_pool = ThreadPoolExecutor(1, thread_name_prefix="worker-lookup")
        self._queue_rate = QueueRate()
        # Seconds each running sequence spent from arrival to start (_add_wait).
        self._waited: dict[str, float] = {}
        # Written by the loop thread only, read by the heartbeat thread.
        self._waiting = 0
        self._running = 0
        self._running_requests = 0
        # Request id of each started choice id, to count requests, not sequences.
        self._request_of: dict[str, str] = {}
        self._kv_usage = 0.0
        self._step_started = 0.0

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
        )

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; the caller closes backend and sockets.

        ``Ready`` goes out only as the answer to a ``Hello``: a Hello that arrived
        proves the proxy's request socket is connected, so a proxy never turns
        ready before it can submit."""
        done = threading.Event()
        beats = threading.Thread(target=self._beat, args=(stop, done), name="worker-heartbeat", daemon=True)
        beats.start()
        backend = self._backend
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
                self._collect_lookups(pending)
                self._admit(pending)
                self._update_stats()
                if backend.active_ids():
                    self._step_started = time.monotonic()
                    try:
                        pending.extend(self._add_wait(self._step()))
                    except EngineFailed as e:
                        self._give_up(e, pending)
                    self._step_started = 0.0
                    # Prepared during the step: queued (and reported) now, not after the next one.
                    self._collect_prepared(pending)
                    self._admit(pending)
                    self._update_stats()
                if self._queue:
                    self._report_queue(pending)
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
            self._lookup_pool.shutdown(wait=True, cancel_futures=True)
            done.set()
            beats.join(5)

    def _update_stats(self) -> None:
        info = self._backend.info
        self._waiting = len(self._queue)
        active = self._backend.active_ids()
        self._running = len(active)
        request_of = self._request_of
        self._running_requests = len({request_of.get(rid, rid) for rid in active})
        if len(request_of) > 2 * len(active) + 64:
            self._request_of = {rid: r for rid, r in request_of.items() if rid in active}
        self._kv_usage = min(1.0, self._backend.kv_reserved() / info.kv_cache_tokens)

    def _beat(self, stop: threading.Event, done: threading.Event) -> None:
        sender = self._sockets.sender()
        try:
            self._write_beat(0.0)
            while not done.wait(self._heartbeat_interval):
                if self._parent_pid is not None and os.getppid() != self._parent_pid:
                    log.error("worker: parent process %d is gone, stopping", self._parent_pid)
                    stop.set()
                started = self._step_started
                step_s = time.monotonic() - started if started else 0.0
                kv = round(self._kv_usage, 4)
                sink = self._kv_events_sink
                sender.send(
                    Heartbeat(
                        self.worker_id,
                        self._running,
                        self._waiting,
                        kv,
                        step_s,
                        self._running_requests,
                        sink.dropped if sink is not None else 0,
                    )
                )
                self._write_beat(step_s)
        finally:
            sender.close()

    def _write_beat(self, step_s: float) -> None:
        path = self._heartbeat_file
        if path is None:
            return
        try:
            write_beat(path, Beat(os.getpid(), self.worker_id, time.monotonic(), step_s))
        except OSError as e:
            # Stop trying: a probe reading the file then restarts the worker, and
            # this line says why.
            log.error("worker: cannot write the heartbeat file %s: %s", path, e)
            self._heartbeat_file = None

    # ---------------------------------------------------------------- messages

    def _handle(self, msg: ProxyMessage, pending: list[Event]) -> None:
        if isinstance(msg, Submit):
            self._submit(msg, pending)
        elif isinstance(msg, Tokenize):
            self._lookups.append((msg.submit.request_id, self._lookup_pool.submit(self._tokenize, msg)))
        elif isinstance(msg, Detokenize):
            self._lookups.append((msg.request_id, self._lookup_pool.submit(self._detokenize, msg)))
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
            queued = self._queued_ids.get(rid)
            preparing = self._preparing_ids.get(rid)
            if queued is not None:
                self._unqueue(queued)
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
        if any(rid in active or rid in self._queued_ids or rid in self._preparing_ids for rid in ids):
            duplicate = "duplicate request id"
            pending.extend(RequestError(rid, ErrorCode.INVALID_REQUEST, duplicate) for rid in ids)
            return
        info = self._backend.info
        unsupported = _unsupported(msg, info)
        if unsupported is not None:
            pending.extend(RequestError(rid, ErrorCode.INVALID_REQUEST, *unsupported) for rid in ids)
            return
        if not 1 <= msg.n <= info.max_batch_size:
            message = (
                f"n={msg.n} choices can never run together: this worker runs at most "
                f"{info.max_batch_size} sequences at once (max_batch_size)"
                if msg.n > 1
                else f"n must be >= 1, got {msg.n}"
            )
            pending.extend(RequestError(rid, ErrorCode.INVALID_REQUEST, message, "n") for rid in ids)
            return
        try:
            validate_request(msg, info)
        except RequestRejected as e:
            pending.extend(RequestError(rid, e.code, e.message, e.param) for rid in ids)
            return
        entry = _Preparing(msg, ids, self._prepare_pool.submit(self._backend.prepare, msg))
        self._preparing.append(entry)
        for rid in ids:
            self._preparing_ids[rid] = entry

    def _tokenize(self, msg: Tokenize) -> Event:
        """``Tokenize``'s answer: the prompt exactly as ``prepare`` makes it for generation
        (a prompt generation refuses untokenized is refused here too), and with
        ``add_special_tokens`` on messages the tokenizer's leading specials before it."""
        submit = msg.submit
        check_prompt_size(submit, self._backend.info)
        # The prompt alone: a grammar or logprobs do not change it, and compiling one (or
        # building the vocabulary) here would race the prepare thread's.
        params = msgspec.structs.replace(submit.params, grammar=None, grammar_param=None, logprobs=None)
        prepared = self._backend.prepare(msgspec.structs.replace(submit, params=params))
        ids = self._backend.prompt_ids(prepared)
        if msg.add_special_tokens and submit.prompt is None:
            ids = self._backend.text_prefix_ids() + ids
        return Tokens(submit.request_id, tuple(ids))

    def _detokenize(self, msg: Detokenize) -> Event:
        context = self._backend.info.max_context_tokens
        if len(msg.token_ids) > context:
            message = f"{len(msg.token_ids)} token ids: a sequence of this model holds at most {context}"
            raise RequestRejected(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message, param="tokens")
        text = self._backend.detokenize(list(msg.token_ids), msg.skip_special_tokens)
        return Detokenized(msg.request_id, text)

    def _collect_lookups(self, pending: list[Event]) -> None:
        """Send the ``Tokens``/``Detokenized`` answers that are ready, in arrival order."""
        while self._lookups and self._lookups[0][1].done():
            rid, future = self._lookups.popleft()
            try:
                pending.append(future.result())
            except RequestRejected as e:
                pending.append(RequestError(rid, e.code, e.message, e.param))
            except Exception as e:
                log.error("tokenizing for %s failed", rid, exc_info=e)
                pending.append(RequestError(rid, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

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
        queued = _Queued(prepared, ids, reservation, entry.arrived)
        self._queue.append(queued)
        for rid in ids:
            self._queued_ids[rid] = queued
        # At once, so the queue holds only what cannot start yet.
        self._admit(pending)
        queued.waited = True

    def _report_queue(self, pending: list[Event]) -> None:
        """A ``QueueProgress`` for each waiting request whose position changed
        (or that was just queued), at most every ``QUEUE_PROGRESS_INTERVAL_S``;
        ``time_ms`` counts from the Submit's receipt, preparation included."""
        now = time.monotonic()
        waiting = len(self._queue)
        rate = self._queue_rate
        for position, q in enumerate(self._queue, 1):
            if q.position == position or (q.position and now - q.reported_at < QUEUE_PROGRESS_INTERVAL_S):
                continue
            q.position = position
            q.reported_at = now
            eta = rate.eta(position, now)
            pending.append(
                QueueProgress(
                    q.ids[0],
                    position,
                    waiting,
                    round((now - q.arrived) * 1000),
                    None if eta is None else round(eta * 1000),
                )
            )

    def _unqueue(self, queued: _Queued) -> None:
        self._queue.remove(queued)
        for rid in queued.ids:
            del self._queued_ids[rid]

    # ---------------------------------------------------------------- admission and steps

    def _fits_now(self, n: int, reservation: int) -> bool:
        backend = self._backend
        info = backend.info
        return (
            len(backend.active_ids()) + n <= info.max_batch_size
            and backend.kv_reserved() + reservation <= info.kv_cache_tokens
        )

    def _admit(self, pending: list[Event]) -> None:
        """Start what fits, in queue order; a later request that fits may start
        before a head that does not (backfilling) while the head has waited
        less than ``backfill_max_wait``: then strict FIFO until it starts."""
        while self._queue:
            chosen = self._queue[0]
            if not self._fits_now(len(chosen.ids), chosen.reservation):
                if time.monotonic() - chosen.arrived >= self._backfill_max_wait:
                    return
                later = islice(self._queue, 1, None)
                found = next((q for q in later if self._fits_now(len(q.ids), q.reservation)), None)
                if found is None:
                    return
                chosen = found
            self._unqueue(chosen)
            if chosen.waited:
                self._queue_rate.departed(time.monotonic())
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

    def _start(self, queued: _Queued, pending: list[Event]) -> None:
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
            self._unqueue(queued)
            out.extend(RequestError(rid, ErrorCode.OVERLOADED, message) for rid in queued.ids)
        return out


def _unsupported(msg: Submit, info: ModelInfo) -> tuple[str, str | None] | None:
    """``(message, param)`` when ``msg`` asks for a feature this backend lacks."""
    params = msg.params
    if msg.tools_json is not None and not info.template_tools:
        return "this engine cannot pass 'tools' to its chat template", "tools"
    if params.grammar is not None and not info.grammar:
        param = params.grammar_param or "response_format"
        return f"'{param}' (constrained decoding) is not supported by this engine", param
    if params.logprobs is not None and not info.logprobs:
        return "'logprobs' are not supported by this engine", "logprobs"
    if msg.cache_salt is not None and not info.cache_salt:
        return "'cache_salt' (a prefix cache of its own) is not supported by this engine", "cache_salt"
    return None


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return msgspec.structs.replace(params, seed=seed)
