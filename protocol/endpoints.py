"""Where the worker and the proxy meet: ZeroMQ addresses and the private runtime directory.

The worker binds, the proxy connects (``engine_worker.sockets``,
``proxy.engine.client``). Without explicit addresses both use ``ipc://`` sockets
in ``runtime_dir()``, a directory only this user can enter, because anyone who
can reach the sockets can submit and abort requests. ``serve`` runs its pair in a
subdirectory of its own (``instance_dir``), so two ``serve`` processes of one
user never share sockets.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from protocol.logs import LogFormat
from protocol.settings import check_ranges, setting

LogLevel = Literal["debug", "info", "warning", "error"]


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(f"{path} must be owned by uid {os.getuid()} with mode 0700")
    return path


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/exl3-sidecar``, else ``<tmp>/exl3-sidecar-<uid>``, created
    with mode 0700. Raises ``PermissionError`` if it exists and is not private to
    this user."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = (
        Path(base) / "exl3-sidecar" if base else Path(tempfile.gettempdir()) / f"exl3-sidecar-{os.getuid()}"
    )
    return _private_dir(path)


def default_addresses(directory: Path | None = None) -> tuple[str, str]:
    """``(input_addr, output_addr)``: ``ipc://`` endpoints in ``directory``
    (default ``runtime_dir()``)."""
    d = directory if directory is not None else runtime_dir()
    return f"ipc://{d / 'input.sock'}", f"ipc://{d / 'output.sock'}"


@contextmanager
def instance_dir() -> Iterator[Path]:
    """A fresh private subdirectory of ``runtime_dir()`` for one ``serve``,
    removed with its sockets on exit."""
    path = _private_dir(runtime_dir() / f"serve-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


_LOOPBACK_HOSTS = ("localhost", "[::1]", "::1")


def check_link_address(addr: str | None, setting: str) -> None:
    """Raises ``ValueError`` naming ``setting`` for a ``tcp://`` address that is not
    on the loopback interface. The link carries prompts and completions in the
    clear and accepts Submit/Abort from whoever connects: it stays inside the
    machine or the pod (``ipc://``, or ``tcp://`` on 127.0.0.0/8 or ::1), which
    is where the worker and its proxy always run."""
    if addr is None or not addr.startswith("tcp://"):
        return
    host = addr.removeprefix("tcp://").rsplit(":", 1)[0]
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host in _LOOPBACK_HOSTS
    if not loopback:
        raise ValueError(
            f"{setting}={addr!r}: the worker link is unencrypted and unauthenticated, so it must stay "
            "on this machine or pod: use ipc:// or tcp://127.0.0.1:PORT"
        )


# No slots: subclasses call super().__post_init__(), which slotted dataclasses break.
@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkSettings:
    """The options both processes have: the two ZeroMQ endpoints and the log level and format.

    Addresses left ``None`` mean ``default_addresses()``, resolved by ``addresses``
    (not at construction, which has no side effects). Raises ``ValueError``
    naming the field for a bad value.
    """

    input_addr: str | None = setting(
        None,
        "ZeroMQ address of the worker's request socket, proxy -> worker "
        "(default: ipc:// in a private runtime directory).",
    )
    output_addr: str | None = setting(
        None,
        "ZeroMQ address of the worker's event socket, worker -> proxy "
        "(default: ipc:// in a private runtime directory).",
    )
    log_level: LogLevel = setting("info", "Log level.")
    log_format: LogFormat = setting(
        "text", "Log line format: text, or json (one JSON object per line, for log collectors)."
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        for name in ("input_addr", "output_addr"):
            check_link_address(getattr(self, name), name)

    @property
    def addresses(self) -> tuple[str, str]:
        """``(input_addr, output_addr)``, defaults filled in (which creates the
        runtime directory if needed; ``PermissionError`` if it is not private)."""
        if self.input_addr is not None and self.output_addr is not None:
            return self.input_addr, self.output_addr
        din, dout = default_addresses()
        return self.input_addr or din, self.output_addr or dout
