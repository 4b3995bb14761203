"""The paths Kubernetes and Prometheus poll: one set, treated alike by every guard.

``/health`` (liveness), ``/ready`` (readiness) and ``/metrics`` (the scrape)
carry no request content. So they are served without an API key (``proxy.app``),
whatever the ``Host`` header (``proxy.server.host_check``), on a connection over
the per-client cap (``proxy.server.connections``: a flood of idle sockets must
not make Kubernetes restart the pod or hide it from its monitoring), and logged
at DEBUG only, never counted in the request metrics (``proxy.ops.request_log``).
"""

from __future__ import annotations

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
