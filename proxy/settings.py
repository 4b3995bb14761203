"""The proxy's settings: every option of ``exl3-sidecar proxy`` written once.

``ProxySettings`` is the one source of each option's name, type, default, range,
environment variable and help (``protocol.settings`` derives the CLI from it);
tests build it directly. An error about a limit names the field that controls it.
"""

from __future__ import annotations

import dataclasses

from protocol.endpoints import LinkSettings
from protocol.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxySettings(LinkSettings):
    """Settings of the HTTP proxy and its engine connection (plus ``LinkSettings``:
    the ZeroMQ addresses the worker binds and the log level). Times are seconds;
    counts are requests or events. Raises ``ValueError`` naming the field when a
    value is out of range."""

    host: str = setting("0.0.0.0", "Address the HTTP server listens on.")
    port: int = setting(5000, "HTTP port.", ge=0, le=65535)
    served_model_name: str | None = setting(
        None, "Model name reported to clients (default: the worker's model id)."
    )
    sse_ping_interval: float = setting(
        15.0,
        "Seconds of stream silence before a ': ping' SSE comment is sent; also how long a stream "
        "waits for the worker's first event before its headers go out.",
        gt=0,
    )
    max_in_flight: int = setting(256, "Concurrent completion requests admitted; beyond it, 503.", ge=1)
    request_queue_max: int = setting(
        256,
        "Events pending per request before a slow client's consecutive token deltas are merged.",
        ge=1,
    )
    heartbeat_timeout: float = setting(
        30.0, "Seconds without any worker message before the worker is declared dead.", gt=0
    )
    handshake_interval: float = setting(0.5, "Seconds between Hello messages while not ready.", gt=0)
    shutdown_drain: float = setting(
        20.0,
        "Seconds in-flight requests may finish after SIGTERM before they are aborted; keep it "
        "below Kubernetes' terminationGracePeriodSeconds.",
        ge=0,
    )
