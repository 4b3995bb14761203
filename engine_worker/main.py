"""Worker process entry: build the backend, bind sockets, run the loop."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import zmq

from engine_worker.backend import Backend
from engine_worker.kv_events import KvEventPublisher, KvEvents, KvEventSource, default_topic
from engine_worker.load_stages import LoadAnnouncer, LoadReporter, Stage
from engine_worker.loop import EngineLoop
from engine_worker.settings import WorkerSettings
from engine_worker.sockets import WorkerSockets
from protocol.messages import Loading

log = logging.getLogger(__name__)


def make_backend(settings: WorkerSettings, stages: LoadReporter | None = None) -> Backend:
    """Load the model of ``settings.backend``, its stages reported to ``stages``. The
    engine packages (torch, exllamav3) are imported here, not when the worker's
    settings are parsed, so ``--check`` and a bad option answer in a fraction of a
    second."""
    stages = stages or LoadReporter()
    if settings.backend == "cpu":
        stages.stage(Stage.IMPORT, "import torch and transformers")
        from engine_worker.cpu.backend import CpuBackend

        return CpuBackend(settings, stages=stages)
    if settings.backend == "synthetic":
        from engine_worker.synthetic import SyntheticBackend

        return SyntheticBackend(settings)
    from engine_worker.exllamav3.loader import build_backend

    return build_backend(settings, stages)


def run_worker(settings: WorkerSettings) -> None:
    """Bind the sockets, load the model, then serve until SIGTERM/SIGINT.

    A proxy's ``Hello`` goes unanswered for the whole load (the loop that answers
    it starts after), so it sees the worker as not ready; meanwhile the worker
    sends ``Loading`` with its load stage (``load_stages.LoadAnnouncer``), which the
    proxy's ``/ready`` shows. Sockets that cannot be bound, or a model that cannot
    load, are one ERROR line and ``SystemExit(1)``.
    """
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("worker: signal %d, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if settings.heartbeat_file is not None:
        # A beat of the process this one replaces must not pass for ours while we load.
        with contextlib.suppress(OSError):
            settings.heartbeat_file.unlink(missing_ok=True)
    input_addr, output_addr = settings.addresses
    try:
        sockets = WorkerSockets(input_addr, output_addr)
    except zmq.ZMQError as e:
        # ipc:// paths over ~107 bytes, a port in use, a directory not there.
        log.error("worker: cannot bind %s / %s: %s", input_addr, output_addr, e)
        raise SystemExit(1) from None
    worker_id = uuid.uuid4().hex
    announcer = LoadAnnouncer(worker_id, lambda: _sender(sockets)).start()
    stages = LoadReporter(announcer.update)
    log.info("worker: loading the model")
    try:
        backend = make_backend(settings, stages)
    except Exception as e:
        # A missing model, GPU or package is an operator error: one clear line,
        # the traceback only at debug level, and a failing exit status so a
        # supervisor (Kubernetes, ``serve``) reports and retries it.
        log.debug("model load failed", exc_info=True)
        log.error("worker: cannot load the model: %s: %s", type(e).__name__, e)
        announcer.stop()  # before its sockets go
        sockets.close()
        _remove_ipc_files((input_addr, output_addr), remove_dir=settings.parent_pid is not None)
        raise SystemExit(1) from None
    finally:
        announcer.stop()
    info = backend.info
    stages.ready()
    log.info(
        "worker: serving %s (context %d tokens, drafting %s) on %s / %s",
        info.model_id,
        info.max_context_tokens,
        info.drafting or "off",
        input_addr,
        output_addr,
    )
    publisher, kv_events = _kv_events(settings, backend)
    if publisher is None and settings.kv_events_endpoint is not None:
        sockets.close()
        backend.close()
        raise SystemExit(1)
    loop = EngineLoop(
        backend,
        sockets,
        heartbeat_interval=settings.heartbeat_interval,
        max_queue=settings.max_queue,
        backfill_max_wait=settings.backfill_max_wait,
        parent_pid=settings.parent_pid,
        heartbeat_file=settings.heartbeat_file,
        kv_events=kv_events,
        kv_events_sink=publisher,
        worker_id=worker_id,
    )
    try:
        loop.run(stop)
    finally:
        sockets.close()
        if publisher is not None:
            publisher.close()
        backend.close()
        remove_dir = settings.parent_pid is not None
        _remove_ipc_files((input_addr, output_addr), remove_dir=remove_dir)
        if settings.heartbeat_file is not None:
            # Stopped is not hung: no beat may be left to age.
            with contextlib.suppress(OSError):
                settings.heartbeat_file.unlink(missing_ok=True)
                if remove_dir:
                    settings.heartbeat_file.parent.rmdir()


def _kv_events(settings: WorkerSettings, backend: Backend) -> tuple[KvEventPublisher | None, KvEvents | None]:
    """The KV-cache event publisher of ``--kv-events-endpoint`` hooked into ``backend``'s
    cache; ``(None, None)`` when off, and also (after one ERROR line) when its endpoints
    cannot be bound."""
    endpoint = settings.kv_events_endpoint
    if endpoint is None:
        return None, None
    if not isinstance(backend, KvEventSource):
        log.error("worker: --kv-events-endpoint: backend %s publishes no KV-cache events", settings.backend)
        return None, None
    topic = settings.kv_events_topic or default_topic(backend.info.model_id)
    try:
        publisher = KvEventPublisher(
            endpoint, topic, settings.kv_events_replay_endpoint, connect=settings.kv_events_connect
        )
    except zmq.ZMQError as e:
        log.error(
            "worker: cannot open the KV-event sockets %s / %s: %s",
            endpoint,
            settings.kv_events_replay_endpoint,
            e,
        )
        return None, None
    events = backend.attach_kv_events(publisher)
    log.info(
        "worker: KV-cache events %s %s (topic %s, blocks of %d tokens, replay %s)",
        "listening on" if publisher.bound else "sent to a subscriber bound at",
        endpoint,
        topic,
        events.block_size,
        settings.kv_events_replay_endpoint or "off",
    )
    return publisher, events


def _sender(sockets: WorkerSockets) -> tuple[Callable[[Loading], object], Callable[[], None]]:
    """A ``Sender`` of the calling thread (the announcer's): its send and close."""
    sender = sockets.sender()
    return sender.send, sender.close


def _remove_ipc_files(addresses: tuple[str, ...], *, remove_dir: bool) -> None:
    """Unlink our ``ipc://`` socket files, and with ``remove_dir`` (a child of
    ``serve``, whose directory is private to this pair) their directory when it is
    left empty, so no stale endpoint outlives the worker."""
    for addr in addresses:
        if not addr.startswith("ipc://"):
            continue
        path = Path(addr.removeprefix("ipc://"))
        path.unlink(missing_ok=True)
        if remove_dir:
            with contextlib.suppress(OSError):  # not empty, or already gone
                path.parent.rmdir()
