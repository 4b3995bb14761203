"""Prometheus metrics of the pod, served by the proxy at ``GET /metrics``.

The proxy is the pod's one scrape target: it counts what it sends to clients
(requests, usage tokens, latencies) and republishes what the worker reports in
its heartbeats (running and waiting requests, KV-cache use). Every family is
documented, with units, labels, PromQL and the vLLM metric each corresponds to,
in ``docs/metrics.md``; the names here are the contract of that page, of the
HPA and of the Inference Extension's endpoint picker in ``deploy/k8s/``.

Each ``Metrics`` has its own ``CollectorRegistry`` (one per app, so tests and
several apps in one process never share counters). Token counters move once
per completed request, by exactly the ``usage`` the response carries (or
would carry with ``include_usage``), so PromQL ratios of them are exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.version import PROTOCOL_VERSION
from proxy.engine.client import EngineClient

# No "<name>_created" timestamp series next to every counter and histogram
# (process-wide in prometheus-client): they double the exposition and no
# dashboard of ours reads them; vLLM turns them off the same way.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus-client

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus text exposition format 0.0.4."""

PREFIX = "exl3_sidecar_"

# From sub-millisecond (a GPU's first token after a cached prompt) to minutes
# (a 64k-token prefill on a CPU): both ends must land in a finite bucket.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
"""Buckets (seconds) of TTFT, request duration, queue time and prefill time."""

ITL_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02,
    0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
"""Buckets (seconds) of inter-token latency: 0.1 ms (an H100 with drafting
accepting several tokens per step) to 2.5 s (a loaded CPU engine)."""


@dataclass(frozen=True, slots=True)
class CompletedRequest:
    """What one completed request adds to the metrics.

    Token counts are the response's ``usage`` (prompt counted once for ``n``
    choices; completion and draft counts summed over choices). Times are
    seconds: ``ttft`` measured by the proxy from the request's arrival to its
    first generated token, ``duration`` from arrival to the end of the
    response; ``queue``, ``prefill`` and ``decode`` are the worker's (choice 0
    for queue and prefill, the longest choice for decode); ``itl`` is the mean
    inter-token latency of each choice that produced two or more tokens.
    """

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    draft_accepted: int
    draft_rejected: int
    ttft: float | None
    duration: float
    queue: float
    prefill: float
    itl: tuple[float, ...]
    reasoning_tokens: int = 0


class _EngineCollector(Collector):
    """Gauges read from the engine client at scrape time (no update path to
    keep in sync): the worker's latest heartbeat and handshake."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        up = engine.ready
        hb = engine.heartbeat if up else None
        running = GaugeMetricFamily(
            PREFIX + "requests_running",
            "Requests running in the engine (a request with n choices counts once, as vLLM and the "
            "Inference Extension's model-server protocol count), from the worker's latest heartbeat.",
        )
        sequences = GaugeMetricFamily(
            PREFIX + "sequences_running",
            "Sequences running in the engine (a request with n choices counts n), from the worker's "
            "latest heartbeat.",
        )
        waiting = GaugeMetricFamily(
            PREFIX + "requests_waiting",
            "Requests waiting in the worker's queue for a batch slot or KV-cache room, from the worker's "
            "latest heartbeat.",
        )
        kv = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_ratio",
            "Fraction (0-1) of the KV cache reserved by running sequences, from the worker's latest "
            "heartbeat.",
        )
        if hb is not None:
            # A worker that does not count requests: its sequences are the closest bound.
            running.add_metric([], hb.active_requests if hb.running_requests is None else hb.running_requests)
            sequences.add_metric([], hb.active_requests)
            waiting.add_metric([], hb.waiting_requests)
            kv.add_metric([], hb.kv_cache_usage)
        else:
            # No worker, no load: routers and autoscalers read 0, and
            # worker_up says why.
            for family in (running, sequences, waiting, kv):
                family.add_metric([], 0)
        yield running
        yield sequences
        yield waiting
        yield kv
        yield CounterMetricFamily(
            PREFIX + "kv_events_dropped",
            "KV-cache event batches the worker dropped because its publishing queue was full "
            "(--kv-events-endpoint; each drop is followed by a full resend), since the worker started.",
            value=hb.kv_events_dropped if hb is not None else 0,
        )
        yield GaugeMetricFamily(
            PREFIX + "worker_up",
            "1 when the engine worker has answered the handshake and its heartbeats are on time, else 0.",
            value=1 if up else 0,
        )
        worker = engine.worker
        if worker is not None:
            info = GaugeMetricFamily(
                PREFIX + "info",
                "Constant 1, labelled with what this pod serves.",
                labels=["model", "backend", "drafting", "protocol_version"],
            )
            info.add_metric(
                [worker.model_id, worker.backend, worker.drafting or "none", str(PROTOCOL_VERSION)], 1
            )
            yield info
            if worker.kv_block_tokens > 0:
                # vLLM's cache_config_info labels, which the Inference Extension's
                # prefix-cache scorer reads (cacheInfoSpec) to size its block index.
                cache = GaugeMetricFamily(
                    PREFIX + "cache_config_info",
                    "Constant 1, labelled with the KV cache's geometry: block_size (tokens per block "
                    "the prefix cache reuses whole) and num_gpu_blocks (blocks in the cache).",
                    labels=["block_size", "num_gpu_blocks"],
                )
                blocks = worker.kv_cache_tokens // worker.kv_block_tokens
                cache.add_metric([str(worker.kv_block_tokens), str(blocks)], 1)
                yield cache


class Metrics:
    """The metric families of one proxy app (names in the module docstring).

    ``count_request`` and ``count_error`` are called once per HTTP request and
    per failure; ``observe_completed`` once per completed completion request.
    """

    def __init__(self, engine: EngineClient) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of completed requests (usage.prompt_tokens)."
        )
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached",
            "Prompt tokens reused from the prefix cache (usage.prompt_tokens_details.cached_tokens).",
        )
        self.generation_tokens = counter(
            "generation_tokens", "Completion tokens of completed requests (usage.completion_tokens)."
        )
        self.reasoning_tokens = counter(
            "reasoning_tokens",
            "Completion tokens reasoning models spent thinking, of completed requests "
            "(usage.completion_tokens_details.reasoning_tokens).",
        )
        self.draft_accepted = counter(
            "draft_tokens_accepted",
            "Drafted tokens the target model accepted "
            "(usage.completion_tokens_details.accepted_prediction_tokens).",
        )
        self.draft_rejected = counter(
            "draft_tokens_rejected",
            "Drafted tokens the target model rejected "
            "(usage.completion_tokens_details.rejected_prediction_tokens).",
        )
        self.requests = counter(
            "requests",
            "HTTP requests by route and status code (499: the client went away before the response ended).",
            ("endpoint", "status"),
        )
        self.request_errors = counter(
            "request_errors",
            "Errors sent to clients, as an HTTP status or as an error event in a stream, by OpenAI "
            "error code.",
            ("code",),
        )
        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token, completed requests.",
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Mean seconds between tokens of one sequence after its first (decode time / (tokens - 1)), "
            "one observation per sequence of two or more tokens.",
            ITL_BUCKETS,
        )
        self.duration = histogram(
            "request_duration_seconds",
            "Seconds from a completed request's arrival to the end of its response.",
        )
        self.queue_time = histogram(
            "queue_time_seconds",
            "Seconds from the worker's receipt of a completed request to the start of its prefill "
            "(tokenizing and the wait for a batch slot or KV room).",
        )
        self.prefill_time = histogram(
            "prefill_time_seconds",
            "Seconds of prompt processing (prefill) of a completed request, cached tokens excluded.",
        )
        r.register(_EngineCollector(engine))

    def count_request(self, endpoint: str, status: int) -> None:
        """One HTTP request answered with ``status`` (499: the client left before the end)."""
        self.requests.labels(endpoint, str(status)).inc()

    def count_error(self, code: str) -> None:
        """One error sent to a client, by its envelope's ``code`` (else ``type``)."""
        self.request_errors.labels(code).inc()

    def observe_completed(self, done: CompletedRequest) -> None:
        """Add one completed request's usage and latencies."""
        self.prompt_tokens.inc(done.prompt_tokens)
        self.prompt_tokens_cached.inc(done.cached_tokens)
        self.generation_tokens.inc(done.completion_tokens)
        self.reasoning_tokens.inc(done.reasoning_tokens)
        self.draft_accepted.inc(done.draft_accepted)
        self.draft_rejected.inc(done.draft_rejected)
        if done.ttft is not None:
            self.ttft.observe(done.ttft)
        self.duration.observe(done.duration)
        self.queue_time.observe(done.queue)
        self.prefill_time.observe(done.prefill)
        for itl in done.itl:
            self.itl.observe(itl)

    def exposition(self) -> bytes:
        """Every family in the text exposition format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)
