"""What request traces and ``GET /v1/status`` cost the proxy.

Run it from the repository root (``pip install -e '.[tracing]'`` first)::

    python benchmarks/tracing_cost.py                    # 64 streams, 2 rounds, ~2 minutes
    python benchmarks/tracing_cost.py --streams 64 --rounds 3 --max-tokens 250

Reuses ``proxy_load.py``'s pieces: a synthetic worker (one token per sequence
per ``--step-ms`` step), the proxy (``python -m proxy``) pinned to the first CPU,
the load generator (``loadgen.py``) and the ``/proc`` sampler. Three parts:

- **traces**: ``--streams`` streams of ``--max-tokens`` tokens, the proxy started
  with tracing off, then on (``OTEL_EXPORTER_OTLP_ENDPOINT`` naming a local OTLP
  sink that answers 200 and counts the export requests it gets), alternating for
  ``--rounds``. Proxy CPU per token: in the steady window (every stream
  started, none finished: per-token work) and over the whole phase (a trace is
  built once per request, at its end: that is where it costs).
- **scrape under load**: while the streams of the first "off" phase run, one
  ``GET /v1/status`` every 100 ms: its latency (p50/max) and how many requests
  it listed.
- **snapshot**: in this process, ``proxy.ops.status.snapshot`` + JSON encoding over
  64 requests in flight (each fed the events of a decoding request): the loop
  time one scrape costs.

Prints Markdown; numbers only mean something on a quiet host (``--settle``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import proxy_load as pl  # noqa: E402  (benchmarks/ is not a package)

SINK = r"""
import http.server, sys, threading
count = 0
lock = threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        global count
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with lock:
            count += 1
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def do_GET(self):
        body = str(count).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def scrape_while(port: int, stop: threading.Event, out: list[tuple[float, int]]) -> None:
    """``GET /v1/status`` every 100 ms until ``stop``: (seconds, requests listed)."""
    url = f"http://127.0.0.1:{port}/v1/status"
    while not stop.wait(0.1):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        out.append((time.perf_counter() - t0, len(body["requests"])))


def snapshot_cost(n: int = 64, repeat: int = 2000) -> dict[str, float]:
    """Microseconds to build and encode one snapshot of ``n`` decoding requests."""
    from types import SimpleNamespace
    from typing import cast

    import msgspec

    from protocol.messages import Heartbeat, PrefillProgress, Ready, Started, TokenDelta
    from protocol.version import PROTOCOL_VERSION
    from proxy.core.generation import Generation, Options
    from proxy.ops.inflight import InFlight, Tracked
    from proxy.ops.request_log import RequestRecord
    from proxy.ops.status import snapshot
    from proxy.server.state import ProxyState
    from proxy.settings import ProxySettings

    inflight = InFlight()
    for i in range(n):
        rid = f"chatcmpl-{i:032x}"
        gen = Generation([rid], Options())
        for ev in (
            Started(rid, 1000, 256),
            PrefillProgress(rid, 1000, 256, 1000, 900),
            TokenDelta(rid, "x", 50),
        ):
            gen.feed(ev, [])
        rec = RequestRecord(time.monotonic() - 5)
        inflight.requests[rid] = Tracked(rid, "m", "chat", "/v1/chat/completions", True, 1, gen, rec, {})
    ready = Ready(PROTOCOL_VERSION, "w", "m", "synthetic", 8192, None, 4, 64, 256, 100000)
    engine = SimpleNamespace(
        ready=True,
        worker=ready,
        heartbeat=Heartbeat("w", n, 0, 0.5),
        heartbeat_at=time.monotonic(),
        worker_since=time.monotonic() - 60,
    )
    settings = ProxySettings(input_addr="inproc://a", output_addr="inproc://b")
    state = ProxyState(settings, cast(Any, engine))
    encode = msgspec.json.Encoder().encode
    size = len(encode(snapshot(state, inflight)))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat // 5):
            encode(snapshot(state, inflight))
        times.append((time.perf_counter() - t0) / (repeat // 5))
    return {"us": 1e6 * min(times), "bytes": size}


def trace_cost(repeat: int = 2000) -> float:
    """Microseconds of the request's loop to build the spans of one finished request
    (4 spans) into the SDK's batch processor, whose exporter here drops them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from protocol.messages import Finished, FinishReason, PrefillProgress, Started, TokenDelta
    from proxy.core.generation import Generation, Options
    from proxy.ops.inflight import Tracked
    from proxy.ops.request_log import RequestRecord
    from proxy.ops.tracing import RequestTracer

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tracer = RequestTracer(provider)
    rid = "chatcmpl-0"
    gen = Generation([rid], Options())
    for ev in (
        Started(rid, 1000, 256),
        PrefillProgress(rid, 1000, 256, 1000, 900),
        TokenDelta(rid, "x", 250),
        Finished(rid, FinishReason.STOP, 1000, 256, 250, None, None, 0.1, 0.9, 5.0),
    ):
        gen.feed(ev, [])
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    t = Tracked(
        rid, "m", "chat", "/v1/chat/completions", True, 1, gen, RequestRecord(time.monotonic() - 6), headers
    )
    t.closed_at = time.monotonic()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat // 5):
            tracer(t)
        best = min(best, (time.perf_counter() - t0) / (repeat // 5))
    provider.shutdown()
    return 1e6 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=250, help="tokens per stream")
    parser.add_argument("--step-ms", type=float, default=20.0, help="worker step period")
    parser.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds to wait for a quiet host")
    parser.add_argument("--settle-idle", type=float, default=90.0)
    args = parser.parse_args()
    args.proxy_arg = []

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        pl.PROXY_CPUS.add(cpus[0])
        os.sched_setaffinity(0, set(cpus[1:]))
    sink_port = pl.free_port()
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(sink_port)])
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
        "OTEL_SERVICE_NAME": "exl3-sidecar-bench",
    }
    plain_env = pl.env_for
    procs = pl.Procs()
    sampler = pl.Sampler()
    sampler.start()
    rows: list[dict[str, Any]] = []
    scrapes: list[tuple[float, int]] = []
    try:
        with pl.run_dir() as tmp:
            logs = tmp / "logs"
            logs.mkdir()
            t = pl.Target("proxy", pl.ROOT, (f"ipc://{tmp}/in", f"ipc://{tmp}/out"), pl.free_port())
            for r in range(args.rounds):
                for mode in ("off", "on"):
                    extra = otel if mode == "on" else {}
                    pl.env_for = lambda tree=pl.ROOT, extra=extra: plain_env(tree) | extra  # type: ignore[misc]
                    pl.start_target(t, args, procs, logs, sampler)
                    stop = threading.Event()
                    scraper = None
                    if mode == "off" and r == 0:
                        scraper = threading.Thread(target=scrape_while, args=(t.port, stop, scrapes))
                        scraper.start()
                    res = pl.streams_phase(t, args.streams, args, sampler, floor=None)
                    stop.set()
                    if scraper is not None:
                        scraper.join()
                    pl.stop_proxy(t, procs)
                    res["mode"] = mode
                    rows.append(res)
    finally:
        pl.env_for = plain_env
        procs.stop_all()
        with urllib.request.urlopen(f"http://127.0.0.1:{sink_port}/", timeout=5) as resp:
            exports = int(resp.read())
        sink.terminate()
        sink.wait(10)
        sampler.stop()

    snap = snapshot_cost(args.streams)
    per_request = trace_cost()
    print(f"## Traces and status: {args.streams} streams x {args.max_tokens} tokens\n")
    print(pl.machine() + "\n")
    print("| tracing | CPU µs/token, steady window | µs/token, whole phase (ends included) | tok/s |")
    print("|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['cpu_us_per_token']:.1f} | {row['cpu_us_per_token_all']:.1f} "
            f"| {row['tok_s']:.0f} |"
        )
    for mode in ("off", "on"):
        got = [r["cpu_us_per_token_all"] for r in rows if r["mode"] == mode]
        print(f"\nmedian µs/token over the whole phase, tracing {mode}: {statistics.median(got):.1f}", end="")
    print(f"\n\nOTLP export requests the sink received: {exports}")
    print(
        f"\nspans of one finished request built in-process: {per_request:.0f} µs "
        f"({per_request / args.max_tokens:.2f} µs per token at {args.max_tokens} tokens)"
    )
    if scrapes:
        lat = sorted(s for s, _ in scrapes)
        listed = max(n for _, n in scrapes)
        print(
            f"\nGET /v1/status under load: {len(lat)} scrapes, p50 {1000 * statistics.median(lat):.2f} ms, "
            f"max {1000 * lat[-1]:.2f} ms, up to {listed} requests listed"
        )
    print(
        f"\nsnapshot of {args.streams} requests in flight, built and encoded in-process: "
        f"{snap['us']:.0f} µs ({snap['bytes']:.0f} bytes)"
    )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
