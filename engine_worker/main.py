"""Worker process entry: build the backend, bind sockets, run the loop."""

from __future__ import annotations

import logging
import signal
import threading

from engine_worker.backend import Backend
from engine_worker.loop import EngineLoop
from engine_worker.settings import WorkerSettings
from engine_worker.sockets import WorkerSockets

log = logging.getLogger(__name__)


def make_backend(settings: WorkerSettings) -> Backend:
    """Load the model of ``settings.backend``. The engine packages (torch,
    exllamav3) are imported here, not when the worker's settings are parsed, so
    ``--check`` and a bad option answer in a fraction of a second."""
    if settings.backend == "cpu":
        from engine_worker.cpu.engine import CpuBackend

        return CpuBackend(settings)
    from engine_worker.exllamav3.loader import build_backend

    return build_backend(settings)


def run_worker(settings: WorkerSettings) -> None:
    """Load the model, then serve until SIGTERM/SIGINT.

    Sockets are bound only after the model is loaded, so a proxy sees the worker
    as not ready (its ``Hello`` goes unanswered) for the whole load. A model that
    cannot load is one ERROR line and ``SystemExit(1)``.
    """
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("worker: signal %d, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    log.info("worker: loading the model")
    try:
        backend = make_backend(settings)
    except Exception as e:
        # A missing model, GPU or package is an operator error: one clear line,
        # the traceback only at debug level, and a failing exit status so a
        # supervisor (Kubernetes, ``serve``) reports and retries it.
        log.debug("model load failed", exc_info=True)
        log.error("worker: cannot load the model: %s: %s", type(e).__name__, e)
        raise SystemExit(1) from None
    info = backend.info
    input_addr, output_addr = settings.addresses
    sockets = WorkerSockets(input_addr, output_addr)
    log.info(
        "worker: serving %s (context %d tokens, drafting %s) on %s / %s",
        info.model_id,
        info.max_context_tokens,
        info.drafting or "off",
        input_addr,
        output_addr,
    )
    try:
        EngineLoop(backend, sockets, settings.heartbeat_interval).run(stop)
    finally:
        sockets.close()
        backend.close()
