"""Worker configuration, read once at start into frozen objects.

The engine-specific settings live beside each backend
(``engine_worker.cpu.config``, ``engine_worker.exllamav3.config``); this module
holds what the loop and its sockets need.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class LoopConfig:
    """ZeroMQ endpoints and liveness cadence of the worker.

    ``input_addr``: where the worker binds its PULL socket (proxy -> worker).
    ``output_addr``: where it binds its PUSH socket (worker -> proxy).
    ``heartbeat_interval_s``: seconds between ``Heartbeat`` messages; the proxy's
    ``heartbeat_timeout_s`` must be several times larger than this plus the
    longest engine step.
    """

    input_addr: str
    output_addr: str
    heartbeat_interval_s: float = 1.0


def default_runtime_dir() -> Path:
    """A directory only this user can enter, for ``ipc://`` sockets:
    ``$XDG_RUNTIME_DIR/exl3-sidecar`` or ``<tmp>/exl3-sidecar-<uid>``.

    Raises ``PermissionError`` if it exists and is not private to this user,
    because anyone who can reach the sockets can submit and abort requests.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = (
        Path(base) / "exl3-sidecar" if base else Path(tempfile.gettempdir()) / f"exl3-sidecar-{os.getuid()}"
    )
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must be owned by uid {os.getuid()} with mode 0700")
    return path


def default_addresses(runtime_dir: Path | None = None) -> tuple[str, str]:
    """``(input_addr, output_addr)`` as ``ipc://`` endpoints in ``runtime_dir``."""
    d = runtime_dir if runtime_dir is not None else default_runtime_dir()
    return f"ipc://{d / 'input.sock'}", f"ipc://{d / 'output.sock'}"
