"""The worker's engine loop: receive, admit, step, send — on one thread.

Every call into the backend happens on the thread that runs ``EngineLoop.run``
(ExLlamaV3 requires ``enqueue``/``cancel`` on the thread that calls
``iterate``). Socket I/O happens between engine steps, so a step's events leave
as one ``EventBatch`` as soon as the step returns.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from engine_worker.backend import Backend, RequestRejected
from engine_worker.sockets import WorkerSockets
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    ErrorCode,
    Event,
    EventBatch,
    Heartbeat,
    Hello,
    Ready,
    RequestError,
    Submit,
)

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs ``backend`` behind ``sockets`` until ``stop`` is set."""

    def __init__(self, backend: Backend, sockets: WorkerSockets, heartbeat_interval: float) -> None:
        self._backend = backend
        self._sockets = sockets
        self._heartbeat_interval = heartbeat_interval
        self.worker_id = uuid.uuid4().hex

    def _ready(self) -> Ready:
        info = self._backend.info
        return Ready(
            protocol_version=PROTOCOL_VERSION,
            worker_id=self.worker_id,
            model_id=info.model_id,
            backend=type(self._backend).__name__,
            max_context_tokens=info.max_context_tokens,
            drafting=info.drafting,
        )

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set; the caller closes backend and sockets."""
        self._sockets.send(self._ready())
        interval = self._heartbeat_interval
        backend = self._backend
        next_beat = time.monotonic() + interval
        while not stop.is_set():
            wait_ms = 0 if backend.active_ids() else max(0, int((next_beat - time.monotonic()) * 1000))
            pending: list[Event] = []
            for msg in self._sockets.receive(min(wait_ms, 100)):
                self._handle(msg, pending)
            if backend.active_ids():
                pending.extend(self._step())
            if pending:
                self._sockets.send(EventBatch(pending))
            now = time.monotonic()
            if now >= next_beat:
                self._sockets.send(Heartbeat(self.worker_id, len(backend.active_ids())))
                next_beat = now + interval

    def _handle(self, msg: Hello | Submit | Abort, pending: list[Event]) -> None:
        if isinstance(msg, Submit):
            if msg.request_id in self._backend.active_ids():
                pending.append(
                    RequestError(msg.request_id, ErrorCode.INVALID_REQUEST, "duplicate request id")
                )
                return
            try:
                self._backend.add(msg)
            except RequestRejected as e:
                pending.append(RequestError(msg.request_id, e.code, e.message, e.param))
                return
            except Exception as e:
                # A bug or an engine fault admitting one request must not take
                # the worker (and every other request) down.
                log.exception("admitting %s failed", msg.request_id)
                pending.append(
                    RequestError(
                        msg.request_id, ErrorCode.INTERNAL, f"admission failed: {type(e).__name__}: {e}"
                    )
                )
        elif isinstance(msg, Abort):
            active = self._backend.active_ids()
            for rid in msg.request_ids:
                if rid in active:
                    self._backend.abort(rid)
        elif msg.protocol_version == PROTOCOL_VERSION:
            self._sockets.send(self._ready())
        else:
            log.error(
                "proxy %s speaks protocol version %d, this worker speaks %d: not answering",
                msg.proxy_id,
                msg.protocol_version,
                PROTOCOL_VERSION,
            )

    def _step(self) -> list[Event]:
        try:
            events = self._backend.step()
        except Exception as e:
            # The backend's state for these requests is unknown now: fail them all
            # and keep serving new ones rather than taking the worker down.
            failed = sorted(self._backend.active_ids())
            log.exception("engine step failed; failing %d active requests", len(failed))
            for rid in failed:
                try:
                    self._backend.abort(rid)
                except Exception:
                    # The engine may be too broken to cancel cleanly; the request
                    # is failed towards the proxy either way.
                    log.exception("abort of %s after a failed step also failed", rid)
            return [RequestError(rid, ErrorCode.INTERNAL, f"engine step failed: {e}") for rid in failed]
        return events
