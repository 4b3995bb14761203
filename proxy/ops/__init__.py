"""The operator's views: what the server is doing and has done.

| module | what |
|---|---|
| ``routes`` | ``/health``, ``/ready``, ``/metrics``, ``/v1/models`` |
| ``metrics`` | the Prometheus metrics of the pod |
| ``request_log`` | one record per HTTP request: its log line and what it adds to the metrics |
| ``inflight`` | the generation requests in flight (``/v1/status``, traces) |
| ``status`` | ``GET /v1/status``: one body or an SSE stream |
| ``status_types`` | the body of ``GET /v1/status`` as msgspec structs (``docs/status.md``) |
| ``tracing`` | request traces over OTLP |
"""
