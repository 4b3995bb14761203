"""The proxy's settings, read once into a frozen object.

The CLI (``proxy.cli``) builds it from options and ``EXL3_SIDECAR_*`` variables;
tests build it directly. An error about a limit names the field that controls it.
"""

from __future__ import annotations

from dataclasses import dataclass

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    """Settings of the HTTP proxy and its engine connection.

    ``input_addr``/``output_addr`` are the ZeroMQ addresses the worker binds
    (its PULL and its PUSH socket); they have no default here because the CLI
    chooses them (a private ``ipc://`` directory unless given).

    Times are seconds; counts are requests or events.

    - ``served_model_name``: name reported in ``/v1/models`` and every response;
      ``None`` uses the worker's ``Ready.model_id``.
    - ``sse_ping_interval_s``: stream silence after which a ``: ping`` comment is
      sent. It also bounds how long a stream waits for the worker's first event
      before its headers are sent (after that an error can only be an SSE event).
    - ``max_in_flight``: concurrent completion requests; beyond it, 503.
    - ``request_queue_max``: pending events per request before consecutive token
      deltas of a slow client are merged instead of queued.
    - ``heartbeat_timeout_s``: worker silence after which it is declared dead.
    - ``handshake_interval_s``: pause between ``Hello`` messages while not ready.
    - ``shutdown_drain_s``: after SIGINT/SIGTERM, how long in-flight requests may
      finish before they are aborted; keep it below Kubernetes'
      ``terminationGracePeriodSeconds``.
    - ``log_level``: for the process's logging setup (done by the CLI).

    Raises ``ValueError`` naming the field when a value is out of range.
    """

    input_addr: str
    output_addr: str
    host: str = "0.0.0.0"
    port: int = 5000
    served_model_name: str | None = None
    sse_ping_interval_s: float = 15.0
    max_in_flight: int = 256
    request_queue_max: int = 256
    heartbeat_timeout_s: float = 30.0
    handshake_interval_s: float = 0.5
    shutdown_drain_s: float = 20.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.input_addr or not self.output_addr:
            raise ValueError("input_addr and output_addr must be ZeroMQ addresses such as ipc:///run/x.sock")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("sse_ping_interval_s", "heartbeat_timeout_s", "handshake_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_drain_s < 0:
            raise ValueError(f"shutdown_drain_s must be >= 0, got {self.shutdown_drain_s}")
        for name in ("max_in_flight", "request_queue_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(_LOG_LEVELS)}, got {self.log_level!r}")
