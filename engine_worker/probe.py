"""Kubernetes probes of the worker container, run with ``exec``.

``python -m engine_worker.probe live [--max-age S] [--max-step S] [--file PATH]``
exits 0 while the worker's heartbeat file (``protocol.liveness``; the path from
``--file`` or ``$EXL3_SIDECAR_HEARTBEAT_FILE``) holds a beat younger than
``--max-age`` seconds (and, with ``--max-step``, no engine step older than that),
else 1 with the reason on stdout (kubelet puts it in the pod's events). The same
command is the startupProbe (no file until the model is loaded: fails, within
the startup budget) and the livenessProbe (a frozen or hung worker stops
writing: fails, and the kubelet restarts the container).

``python -m engine_worker.probe wait-port-closed --port P --timeout S`` is the
worker's ``preStop``: it returns once nothing listens on ``127.0.0.1:P`` (the
proxy beside it has drained and exited) or after ``S`` seconds, so the worker
outlives the proxy's drain without a fixed sleep as long as the longest drain.

Only the standard library and ``protocol.liveness``: a probe runs every few
seconds, so it must start fast (about 50 ms).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from protocol.liveness import HEARTBEAT_FILE_ENV, check


def _live(args: argparse.Namespace) -> int:
    path = args.file or os.environ.get(HEARTBEAT_FILE_ENV)
    if not path:
        print(f"no heartbeat file: pass --file or set {HEARTBEAT_FILE_ENV}")
        return 1
    why = check(Path(path), max_age=args.max_age, max_step=args.max_step)
    if why is not None:
        print(why)
        return 1
    return 0


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _wait_port_closed(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.timeout
    while _listening(args.port):
        if time.monotonic() >= deadline:
            print(f"127.0.0.1:{args.port} still listening after {args.timeout:g} s")
            return 0
        time.sleep(args.interval)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one probe; returns its exit status (0: healthy / done)."""
    parser = argparse.ArgumentParser(prog="python -m engine_worker.probe", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    live = sub.add_parser("live", help="0 while the worker's heartbeats are fresh")
    live.add_argument("--file", help=f"heartbeat file (default: ${HEARTBEAT_FILE_ENV})")
    live.add_argument("--max-age", type=float, default=30.0, help="seconds a beat stays fresh (30)")
    live.add_argument("--max-step", type=float, default=0.0, help="longest engine step, seconds (0: any)")
    live.set_defaults(run=_live)
    wait = sub.add_parser("wait-port-closed", help="return once nothing listens on 127.0.0.1:PORT")
    wait.add_argument("--port", type=int, required=True)
    wait.add_argument("--timeout", type=float, required=True, help="seconds to wait at most")
    wait.add_argument("--interval", type=float, default=0.5, help="seconds between tries (0.5)")
    wait.set_defaults(run=_wait_port_closed)
    args = parser.parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
