"""Worker process entry: build the backend, bind sockets, run the loop."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from engine_worker.backend import Backend
from engine_worker.config import LoopConfig
from engine_worker.loop import EngineLoop
from engine_worker.sockets import WorkerSockets

log = logging.getLogger(__name__)


def run_worker(config: LoopConfig, make_backend: Callable[[], Backend]) -> None:
    """Load the model, then serve until SIGTERM/SIGINT.

    Sockets are bound only after the model is loaded, so a proxy sees the worker
    as not ready (its ``Hello`` goes unanswered) for the whole load.
    """
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("worker: signal %d, stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    log.info("worker: loading the model")
    try:
        backend = make_backend()
    except Exception as e:
        # A missing model, GPU or package is an operator error: one clear line,
        # the traceback only at debug level, and a failing exit status so a
        # supervisor (Kubernetes, ``serve``) reports and retries it.
        log.debug("model load failed", exc_info=True)
        log.error("worker: cannot load the model: %s: %s", type(e).__name__, e)
        raise SystemExit(1) from None
    info = backend.info
    sockets = WorkerSockets(config.input_addr, config.output_addr)
    log.info(
        "worker: serving %s (context %d tokens, drafting %s) on %s / %s",
        info.model_id,
        info.max_context_tokens,
        info.drafting or "off",
        config.input_addr,
        config.output_addr,
    )
    try:
        EngineLoop(backend, sockets, config).run(stop)
    finally:
        sockets.close()
        backend.close()
