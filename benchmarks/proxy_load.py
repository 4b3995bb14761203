"""What the proxy adds: latency, CPU and memory per stream against the raw ZeroMQ
floor, at 1 to 1,000 streams and up to saturation, beside LiteLLM's proxy.

Run it (from the repository root; it installs what it needs first)::

    benchmarks/proxy_load.sh            # every section, about 10 minutes on 2 cores
    benchmarks/proxy_load.sh --help     # options: levels, sections, --compare TREE

and it prints Markdown tables. Every process runs on this host: two synthetic
workers of one configuration (``--synthetic-step-ms``, one token per sequence per
step), the proxy (``python -m proxy``) in front of the first, the raw floor
(``raw_floor.py``: the protocol spoken straight to the second worker), and the
load generator (``loadgen.py``: one asyncio protocol per stream, no parsing while
the load runs, every stream checked after).

How latency is measured. The prompts carry ``engine_worker.synthetic.STAMP_WORD``,
so each token's text carries the ``CLOCK_MONOTONIC`` microsecond its engine step
began; a token's latency is its arrival time minus that stamp, on the same clock.
The proxy path and the floor run the same load at the same moment, each on its
own worker (a worker's PUSH socket round-robins, so two readers cannot share
one); **added** = a percentile of the proxy path's latencies minus the same
percentile of the floor's. Both include the step's own work and the ZeroMQ hop;
only the proxy's share differs.

Sections (``--sections``):

- ``levels``: N concurrent streams for each N of ``--levels``; added p50/p99/max,
  delivered tokens/s, proxy CPU per token in the steady window (every stream
  started, none finished), the load generator's CPU beside it, proxy RSS per open
  stream (peak minus the idle RSS before the level) and RSS after the level ends.
- ``saturation``: more streams (``--saturation``) without the floor, which would
  take CPU from the proxy: delivered tokens/s, the worker's steps/s, proxy CPU
  and absolute p99 (stamp to arrival) per level.
- ``ttft``: one request with a long prompt (``--ttft-words``) and
  ``return_progress`` at a time, proxy and floor side by side: added latency of the
  first ``prompt_progress`` chunk and of the first token (medians of ``--ttft-repeat``).
- ``idle``: RSS per open stream that gets no events (queued behind one running
  request on a worker with one batch slot), and RSS after they are dropped.
- ``dialects``: the same streams (``--dialect-streams``, 64) in each dialect the
  proxy speaks, chat completions, the Responses API and Anthropic's Messages,
  each beside the floor, interleaved over ``--dialect-rounds`` rounds (the
  medians are reported, so that a noisy moment of a shared host does not land
  on one dialect): added latency and proxy CPU per token, and each as a ratio to
  chat's.
- ``litellm``: the same load through LiteLLM's proxy in front of this proxy
  (``--litellm`` names its executable; ``proxy_load.sh`` installs it into its own
  virtual environment), beside the floor: added latency and LiteLLM's CPU.
- ``profile`` (only when asked, ``--profile DIR``): each proxy under test under
  ``py-spy record --native`` at ``--profile-streams`` streams (no floor beside
  it); top functions by own and total share of its busy samples.

``--compare TREE`` runs the ``levels`` section a second time, level by level in
the same run, with the proxy of another checkout (e.g. ``git worktree add
/tmp/before HEAD~1``; the workers, which must speak its protocol version, and
the load tools always come from this tree), and prints the ratios.

CPU and RSS come from ``/proc/PID/stat`` and ``/proc/PID/status`` (Linux), sampled
every 50 ms; CPU time has the kernel's 10 ms tick resolution.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(x) for x in task.read_text().split()]
    return out


def tree_pids(pid: int) -> list[int]:
    pids = [pid]
    for c in children(pid):
        pids += tree_pids(c)
    return pids


def cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_kb(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KB
    except OSError:
        return 0


class Sampler:
    """CPU seconds and RSS of some processes (with their children), every 50 ms."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.samples: dict[str, list[tuple[float, float, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def watch(self, name: str, pid: int) -> None:
        with self._lock:
            self.pids[name] = pid
            self.samples[name] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with self._lock:
                for name, pid in self.pids.items():
                    pids = tree_pids(pid)
                    t = time.monotonic()
                    self.samples[name].append((t, sum(cpu_s(p) for p in pids), sum(rss_kb(p) for p in pids)))

    def cpu_between(self, name: str, t0: float, t1: float) -> float:
        s = self.samples[name]

        def at(t: float) -> float:
            for i, (ts, c, _) in enumerate(s):
                if ts >= t:
                    if i == 0:
                        return c
                    tp, cp, _ = s[i - 1]
                    return cp + (c - cp) * (t - tp) / max(1e-9, ts - tp)
            return s[-1][1]

        return at(t1) - at(t0)

    def rss_max(self, name: str, t0: float, t1: float) -> int:
        return max((r for t, _, r in self.samples[name] if t0 <= t <= t1), default=0)

    def rss_now(self, name: str) -> int:
        return rss_kb(self.pids[name])


@dataclass
class Procs:
    """Every process started, stopped in reverse order at the end."""

    items: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def add(self, name: str, p: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.items.append((name, p))
        return p

    def stop(self, p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 15) -> None:
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        for _, p in reversed(self.items):
            self.stop(p)


PROXY_CPUS: set[int] = set()
"""CPUs the process under test runs on (``--pin``); empty: wherever the kernel puts it."""


def pin(pid: int) -> None:
    """Move every thread of ``pid`` onto ``PROXY_CPUS``."""
    if not PROXY_CPUS:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), PROXY_CPUS)


def env_for(tree: Path = ROOT) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env.pop("EXL3_SIDECAR_LOG_LEVEL", None)
    return env


def worker_cmd(args: argparse.Namespace, addrs: tuple[str, str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "engine_worker",
        "--backend",
        "synthetic",
        "--synthetic-step-ms",
        str(args.step_ms),
        "--synthetic-tokens-per-step",
        "1",
        "--synthetic-kv-tokens",
        str(1 << 30),
        "--max-queue",
        "8192",
        "--max-seq-len",
        "8192",
        "--chunk-size",
        "256",
        "--input-addr",
        addrs[0],
        "--output-addr",
        addrs[1],
        "--log-level",
        "warning",
        *extra,
    ]


def proxy_cmd(addrs: tuple[str, str], port: int, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "proxy",
        "--port",
        str(port),
        "--input-addr",
        addrs[0],
        "--output-addr",
        addrs[1],
        "--max-in-flight",
        "20000",
        "--shutdown-drain",
        "0",
        *extra,
    ]


def wait_http(url: str, timeout: float = 60, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited with status {proc.returncode} (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not ready after {timeout:g} s")
        time.sleep(0.2)


@dataclass
class Target:
    """One proxy under test and the worker behind it."""

    label: str
    tree: Path
    addrs: tuple[str, str]
    port: int
    worker: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None
    proxy_pid: int = 0
    offset: int = 0  # distinct prompts per phase

    def next_offset(self, n: int) -> int:
        o = self.offset
        self.offset += n
        return o


def start_target(
    t: Target,
    args: argparse.Namespace,
    procs: Procs,
    logs: Path,
    sampler: Sampler,
    *,
    worker_extra: Sequence[str] = ("--max-batch-size", "8192"),
    profile: Path | None = None,
) -> None:
    if t.worker is None:
        log = (logs / f"worker-{t.label}.log").open("ab")
        t.worker = procs.add(
            f"worker-{t.label}",
            subprocess.Popen(
                worker_cmd(args, t.addrs, *worker_extra), cwd=ROOT, env=env_for(), stdout=log, stderr=log
            ),
        )
    cmd = proxy_cmd(t.addrs, t.port, args.proxy_arg)
    if profile is not None:
        cmd = [
            str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--native",
            "--rate",
            "200",
            "--format",
            "raw",
            "-o",
            str(profile),
            "--",
            *cmd,
        ]
    log = (logs / f"proxy-{t.label}.log").open("ab")
    t.proxy = procs.add(
        f"proxy-{t.label}", subprocess.Popen(cmd, cwd=t.tree, env=env_for(t.tree), stdout=log, stderr=log)
    )
    wait_http(f"http://127.0.0.1:{t.port}/ready", proc=t.proxy)
    t.proxy_pid = t.proxy.pid
    if profile is not None:
        kids = children(t.proxy.pid)
        t.proxy_pid = kids[0] if kids else t.proxy.pid
    pin(t.proxy_pid)
    sampler.watch(t.label, t.proxy_pid)
    warm_up(t)


def stop_proxy(t: Target, procs: Procs) -> None:
    if t.proxy is not None:
        if t.proxy_pid != t.proxy.pid:  # py-spy: stop its child, then it writes its file
            with contextlib.suppress(ProcessLookupError):
                os.kill(t.proxy_pid, signal.SIGINT)
            t.proxy.wait(60)
        procs.stop(t.proxy, signal.SIGINT)
        t.proxy = None


def warm_up(t: Target, api: str = "chat") -> None:
    """A few requests, so imports and first-use caches are not in the first level."""
    run_json(
        [
            sys.executable,
            str(HERE / "loadgen.py"),
            "streams",
            "--api",
            api,
            "--port",
            str(t.port),
            "--streams",
            "8",
            "--max-tokens",
            "5",
            "--ramp",
            "0",
            "--start-at",
            "0",
            "--offset",
            str(t.next_offset(8)),
        ],
    )


def run_json(cmd: list[str]) -> dict[str, Any]:
    p = subprocess.run(cmd, capture_output=True, cwd=ROOT, env=env_for(), check=False)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{p.stderr.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(p.stdout.decode().strip().splitlines()[-1])
    return result


def spawn_json(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, cwd=ROOT, env=env_for(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def collect(p: subprocess.Popen[bytes], what: str) -> dict[str, Any]:
    out, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"{what} failed:\n{err.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------- sections


def host_idle(probe_s: float = 1.0) -> float:
    """Percent of all CPUs idle over ``probe_s`` seconds (/proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    i0, t0 = sample()
    time.sleep(probe_s)
    i1, t1 = sample()
    return 100 * (i1 - i0) / max(1, t1 - t0)


def settle(args: argparse.Namespace) -> float:
    """Wait (at most ``--settle`` seconds) for the host to be quiet: on a shared
    machine other jobs come and go, and a phase measured beside them says more
    about them than about the proxy. Returns the idle percent last seen."""
    deadline = time.monotonic() + args.settle
    while True:
        idle = host_idle()
        if idle >= args.settle_idle or time.monotonic() >= deadline:
            return idle


def ramp_for(n: int) -> float:
    # Connect over up to 1 s, as clients arrive, not in one instant.
    return min(1.0, n / 1000)


def streams_phase(
    t: Target,
    n: int,
    args: argparse.Namespace,
    sampler: Sampler,
    *,
    floor: Target | None,
    port: int | None = None,
    model: str = "synthetic",
    cpu_name: str | None = None,
    headers: Sequence[str] = (),
    api: str = "chat",
) -> dict[str, Any]:
    """N streams through ``t`` (or another HTTP ``port`` in front of it) in the
    dialect ``api``, the floor's N at the same moment; proxy CPU and RSS from the
    sampler."""
    name = cpu_name or t.label
    quiet = settle(args)
    idle_rss = sampler.rss_now(name)
    ramp = ramp_for(n)
    start_at = time.monotonic() + 1.0
    offset = t.next_offset(n)
    common = [
        "--streams",
        str(n),
        "--max-tokens",
        str(args.max_tokens),
        "--ramp",
        str(ramp),
        "--start-at",
        str(start_at),
        "--offset",
        str(offset),
    ]
    lg = spawn_json(
        [
            sys.executable,
            str(HERE / "loadgen.py"),
            "streams",
            "--api",
            api,
            "--port",
            str(port or t.port),
            "--model",
            model,
            *(f"--header={h}" for h in headers),
            *common,
        ],
    )
    fl = None
    if floor is not None:
        fl = spawn_json(
            [
                sys.executable,
                str(HERE / "raw_floor.py"),
                "streams",
                "--input-addr",
                floor.addrs[0],
                "--output-addr",
                floor.addrs[1],
                *common,
            ],
        )
    proxied = collect(lg, "load generator")
    raw = collect(fl, "raw floor") if fl is not None else None
    end = time.monotonic()
    w0, w1 = (x / 1e9 for x in proxied["window_ns"])
    window_cpu = sampler.cpu_between(name, w0, w1)
    phase_cpu = sampler.cpu_between(name, start_at, end)
    peak = sampler.rss_max(name, start_at, end)
    time.sleep(1.0)
    after = sampler.rss_now(name)
    return {
        "streams": n,
        "api": api,
        "host_idle_pct": quiet,
        "proxied": proxied,
        "floor": raw,
        "window_s": w1 - w0,
        "tok_s": proxied["window_tokens"] / max(1e-9, w1 - w0),
        "cpu_us_per_token": 1e6 * window_cpu / max(1, proxied["window_tokens"]),
        "cpu_us_per_token_all": 1e6 * phase_cpu / max(1, proxied["tokens"]),
        "proxy_cpu_s": phase_cpu,
        "proxy_cpu_pct": 100 * window_cpu / max(1e-9, w1 - w0),
        "idle_rss_kb": idle_rss,
        "peak_rss_kb": peak,
        "after_rss_kb": after,
        "rss_per_stream_kb": (peak - idle_rss) / n,
    }


DIALECTS = ("chat", "responses", "messages")


def dialects_phase(t: Target, floor: Target, args: argparse.Namespace, sampler: Sampler) -> dict[str, Any]:
    """``--dialect-streams`` streams in each dialect, beside the floor, the
    dialects interleaved over ``--dialect-rounds`` rounds."""
    for api in DIALECTS[1:]:
        warm_up(t, api)
    rounds: dict[str, list[dict[str, Any]]] = {api: [] for api in DIALECTS}
    for k in range(args.dialect_rounds):
        for api in DIALECTS:
            print(f"[dialects] round {k + 1}: {api}", file=sys.stderr, flush=True)
            rounds[api].append(streams_phase(t, args.dialect_streams, args, sampler, floor=floor, api=api))
    return rounds


def _median(xs: Sequence[float | None]) -> float | None:
    vs = [x for x in xs if x is not None]
    return statistics.median(vs) if vs else None


def dialects_table(rounds: dict[str, list[dict[str, Any]]], streams: int) -> list[str]:
    """One row per dialect: medians over the rounds, and each as a ratio to chat's."""
    med: dict[str, dict[str, float | None]] = {}
    for api, rs in rounds.items():
        med[api] = {
            "p50": _median([added(r, "p50") for r in rs]),
            "p99": _median([added(r, "p99") for r in rs]),
            "cpu": _median([r["cpu_us_per_token"] for r in rs]),
            "cpu_all": _median([r["cpu_us_per_token_all"] for r in rs]),
            "tok_s": _median([r["tok_s"] for r in rs]),
        }
    chat = med["chat"]
    out = [
        f"**Dialects** ({streams} streams each, beside the floor; medians of {len(rounds['chat'])} "
        "interleaved rounds; ratios to chat)",
        "",
        "| API | tok/s | added p50 / p99 ms | proxy CPU µs/token (steady · all) | CPU per round "
        "| vs chat: CPU · added p50 · added p99 | verified |",
        "|---|---|---|---|---|---|---|",
    ]
    for api, rs in rounds.items():
        m = med[api]
        per_round = ", ".join(f"{r['cpu_us_per_token']:.1f}" for r in rs)
        ok = sum(r["proxied"]["verified"] for r in rs)
        total = sum(r["proxied"]["streams"] for r in rs)
        vs = " · ".join(ratio(m[k], chat[k]) for k in ("cpu", "p50", "p99"))
        out.append(
            f"| {api} | {m['tok_s'] or 0:,.0f} | {fmt_ms(m['p50'])} / {fmt_ms(m['p99'])} "
            f"| {fmt_ms(m['cpu'])} · {fmt_ms(m['cpu_all'])} | {per_round} | {vs} | {ok}/{total} |"
        )
    return out


def send_floor(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """CPU of one plain ``send()`` per stream per step to ``n`` loopback sockets
    (``loadgen.py sendfloor``): what writing alone costs on this host."""
    settle(args)
    return run_json(
        [
            sys.executable,
            str(HERE / "loadgen.py"),
            "sendfloor",
            "--port",
            "0",
            "--streams",
            str(n),
            "--max-tokens",
            "100",
            "--step-ms",
            str(args.step_ms),
        ]
    )


def ttft_phase(t: Target, floor: Target, args: argparse.Namespace) -> dict[str, Any]:
    start_at = time.monotonic() + 1.0
    common = [
        "--repeat",
        str(args.ttft_repeat),
        "--prompt-words",
        str(args.ttft_words),
        "--max-tokens",
        "4",
        "--start-at",
        str(start_at),
        "--offset",
        str(t.next_offset(args.ttft_repeat)),
    ]
    lg = spawn_json([sys.executable, str(HERE / "loadgen.py"), "ttft", "--port", str(t.port), *common])
    fl = spawn_json(
        [
            sys.executable,
            str(HERE / "raw_floor.py"),
            "ttft",
            "--input-addr",
            floor.addrs[0],
            "--output-addr",
            floor.addrs[1],
            *common,
        ],
    )
    return {"proxied": collect(lg, "load generator"), "floor": collect(fl, "raw floor")}


def idle_phase(
    args: argparse.Namespace, procs: Procs, logs: Path, sampler: Sampler, tmp: Path, tree: Path
) -> dict[str, Any]:
    """A worker with one batch slot: one stream runs, the rest wait in its queue
    and get no events; the proxy's RSS per waiting stream."""
    t = Target("idle", tree, (f"ipc://{tmp}/idle-in", f"ipc://{tmp}/idle-out"), free_port())
    start_target(t, args, procs, logs, sampler, worker_extra=("--max-batch-size", "1"))
    time.sleep(1.0)
    idle = sampler.rss_now("idle")
    n = args.idle_streams
    start_at = time.monotonic() + 1.0
    hold = 4.0 + ramp_for(n)
    p = spawn_json(
        [
            sys.executable,
            str(HERE / "loadgen.py"),
            "hold",
            "--port",
            str(t.port),
            "--streams",
            str(n),
            "--max-tokens",
            "8000",
            "--ramp",
            str(ramp_for(n)),
            "--start-at",
            str(start_at),
            "--hold",
            str(hold),
        ],
    )
    time.sleep(1.0 + hold - 0.5)
    held = sampler.rss_now("idle")
    result = collect(p, "load generator (hold)")
    time.sleep(2.0)
    after = sampler.rss_now("idle")
    stop_proxy(t, procs)
    if t.worker is not None:
        procs.stop(t.worker)
    return {
        "streams": n,
        "idle_kb": idle,
        "held_kb": held,
        "after_kb": after,
        "per_stream_kb": (held - idle) / n,
        "hold": result,
    }


def litellm_phase(
    t: Target, floor: Target, args: argparse.Namespace, procs: Procs, logs: Path, sampler: Sampler, tmp: Path
) -> dict[str, Any] | None:
    exe = Path(args.litellm) if args.litellm else None
    if exe is None or not exe.exists():
        return None
    port = free_port()
    config = tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: synthetic\n"
        "    litellm_params:\n"
        "      model: openai/synthetic\n"
        f"      api_base: http://127.0.0.1:{t.port}/v1\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n"
    )
    key = "sk-" + os.urandom(32).hex()  # it refuses to start without one
    auth = f"Authorization: Bearer {key}"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR", LITELLM_MASTER_KEY=key)
    log = (logs / "litellm.log").open("ab")
    p = procs.add(
        "litellm",
        subprocess.Popen(
            [
                str(exe),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            env=env,
            stdout=log,
            stderr=log,
            cwd=tmp,
        ),
    )
    wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout=180, proc=p)
    for pid in tree_pids(p.pid):
        pin(pid)
    sampler.watch("litellm", p.pid)
    # Its first requests build clients and caches.
    run_json(
        [
            sys.executable,
            str(HERE / "loadgen.py"),
            "streams",
            "--port",
            str(port),
            "--streams",
            "4",
            "--max-tokens",
            "5",
            "--ramp",
            "0",
            "--start-at",
            "0",
            "--offset",
            str(t.next_offset(4)),
            f"--header={auth}",
        ],
    )
    results = {}
    for n in args.litellm_streams:
        results[n] = streams_phase(
            t, n, args, sampler, floor=floor, port=port, cpu_name="litellm", headers=[auth]
        )
    procs.stop(p)
    return results


def profile_phase(
    t: Target, args: argparse.Namespace, procs: Procs, logs: Path, sampler: Sampler
) -> dict[str, Any]:
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"proxy-{t.label.replace(' ', '-')}-{args.profile_streams}-streams.txt"
    stop_proxy(t, procs)
    start_target(t, args, procs, logs, sampler, profile=raw)
    r = streams_phase(t, args.profile_streams, args, sampler, floor=None)
    stop_proxy(t, procs)
    return {"file": str(raw), "top": top_entries(raw), "run": r}


CATEGORIES = [
    # (name, what a leaf frame's function or file contains): the first that matches
    ("socket writes (kernel)", ("write (libc", "send (libc", "writev (libc", "sendmsg (libc")),
    ("waiting for events (epoll)", ("epoll_wait", "epoll_pwait")),
    ("garbage collector", ("gc_collect", "gc_collect_main", "collect_generation")),
    ("this proxy's Python (proxy/)", ("(proxy/",)),
    ("msgspec (encode, decode)", ("msgspec/",)),
    ("ZeroMQ (pyzmq, libzmq)", ("zmq/", "libzmq", "getpid (libc")),
    ("aiohttp", ("aiohttp/", "_http_parser", "_helpers_c", "multidict", "yarl")),
    ("event loop (asyncio, uvloop, libuv)", ("asyncio/", "_asynciomodule", "loop.c", "core.c", "stream.c")),
]


def top_entries(path: Path, n: int = 15) -> dict[str, list[tuple[str, float]]]:
    """Where the proxy's busy samples went, over the samples taken while the event
    loop ran (py-spy raw: one collapsed stack and its count per line; idle
    samples are not recorded, but a thread in epoll counts as busy): by area
    (``CATEGORIES``, of the leaf frame), by function of the leaf frame (own),
    and by Python function anywhere on the stack (total; the frames under every
    sample left out)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    samples = 0
    if not path.exists():
        return {"own": [], "total": [], "areas": []}
    for line in path.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        # Only the serving: start-up (imports) and shutdown are not the load.
        if not stack or "run_forever" not in stack:
            continue
        count = int(count_s)
        samples += count
        raw = stack.split(";")
        frames = [_frame(f) for f in raw]
        own[frames[-1]] += count
        areas[next((name for name, keys in CATEGORIES if any(k in raw[-1] for k in keys)), "other")] += count
        for f in set(frames):
            total[f] += count
    if not samples:
        return {"own": [], "total": [], "areas": []}
    inner = [(f, c) for f, c in total.most_common() if c < 0.97 * samples and f.endswith(".py)")]
    return {
        "areas": [(a, 100 * c / samples) for a, c in areas.most_common()],
        "own": [(f, 100 * c / samples) for f, c in own.most_common(n)],
        "total": [(f, 100 * c / samples) for f, c in inner[:n]],
        "samples": [("samples", float(samples))],
    }


def _frame(f: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file.py)": one entry per function.
    name, _, where = f.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0].rsplit("/", 1)[-1]
    return f"{name} ({file})" if file else name


# ---------------------------------------------------------------- report


def fmt_ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 100 else f"{x:.0f}"


def added(r: dict[str, Any], key: str) -> float | None:
    if r.get("floor") is None:
        return None
    p, f = r["proxied"]["latency_ms"], r["floor"]["latency_ms"]
    return float(p[key] - f[key]) if key in p and key in f else None


def verified(r: dict[str, Any]) -> str:
    parts = [f"{r['proxied']['verified']}/{r['proxied']['streams']}"]
    if r.get("floor") is not None:
        parts.append(f"{r['floor']['verified']}/{r['floor']['streams']}")
    return " · ".join(parts)


def levels_table(label: str, rows: list[dict[str, Any]]) -> list[str]:
    out = [
        f"**{label}**",
        "",
        "| streams | tok/s | added p50 / p99 / max ms | floor p50 / p99 ms | proxy p50 / p99 ms "
        "| proxy CPU µs/token (steady · all) | load gen CPU vs proxy | RSS KB/stream | RSS after, MB "
        "| verified (proxy · floor) | host idle before |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, f = r["proxied"]["latency_ms"], (r["floor"] or {}).get("latency_ms", {})
        lg = r["proxied"]["cpu_s"] / max(1e-9, r["proxy_cpu_s"])
        out.append(
            f"| {r['streams']} | {r['tok_s']:,.0f} "
            f"| {fmt_ms(added(r, 'p50'))} / {fmt_ms(added(r, 'p99'))} / {fmt_ms(added(r, 'max'))} "
            f"| {fmt_ms(f.get('p50'))} / {fmt_ms(f.get('p99'))} "
            f"| {fmt_ms(p.get('p50'))} / {fmt_ms(p.get('p99'))} "
            f"| {r['cpu_us_per_token']:.1f} · {r['cpu_us_per_token_all']:.1f} | {lg:.2f}x "
            f"| {r['rss_per_stream_kb']:.1f} "
            f"| {r['after_rss_kb'] / 1024:.1f} (idle {r['idle_rss_kb'] / 1024:.1f}) "
            f"| {verified(r)} | {r.get('host_idle_pct', 0):.0f}% |"
        )
    return out


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"## Proxy overhead ({results['when']})",
        "",
        f"Machine: {results['machine']}. Workers: synthetic, {args.step_ms:g} ms steps, one token per "
        f"stream per step ({1000 / args.step_ms:g} tok/s per stream), {args.max_tokens} tokens per stream. "
        "Added = proxy path minus raw-ZeroMQ floor, same percentile, same moment.",
        "",
    ]
    for label, rows in results["levels"].items():
        lines += levels_table(label, rows)
        lines.append("")
    if results.get("send_floor"):
        floors = " · ".join(f"{n}: {v['us_per_send']:.1f}" for n, v in results["send_floor"].items())
        lines += [
            "**Write floor**: CPU µs of one plain `send()` of a 330-byte event per stream per step to "
            f"loopback sockets, by streams (the least any proxy writing each stream once per step pays "
            f"per token): {floors}",
            "",
        ]
    for label, ratios in results.get("compare_ratios", {}).items():
        lines += [
            f"**Ratios, this tree / {label}** (lower is better)",
            "",
            "| streams | added p50 | added p99 | CPU µs/token | RSS/stream |",
            "|---|---|---|---|---|",
        ]
        for n, rr in ratios.items():
            lines.append(f"| {n} | {rr['p50']} | {rr['p99']} | {rr['cpu']} | {rr['rss']} |")
        lines.append("")
    if results.get("saturation"):
        lines += [
            "**Saturation** (no floor beside it; p99 is absolute, stamp to arrival)",
            "",
            "| streams | offered tok/s | delivered tok/s | worker steps/s | proxy CPU % | µs/token "
            "| p50 / p99 / max ms | verified |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results["saturation"]:
            p = r["proxied"]["latency_ms"]
            offered = r["streams"] * 1000 / args.step_ms
            lines.append(
                f"| {r['streams']} | {offered:,.0f} | {r['tok_s']:,.0f} "
                f"| {r['proxied'].get('steps_per_s', 0):.1f} "
                f"| {r['proxy_cpu_pct']:.0f} | {r['cpu_us_per_token']:.1f} "
                f"| {fmt_ms(p.get('p50'))} / {fmt_ms(p.get('p99'))} / {fmt_ms(p.get('max'))} "
                f"| {verified(r)} |"
            )
        lines.append("")
    if results.get("ttft"):
        tt = results["ttft"]
        pr, fl = tt["proxied"], tt["floor"]

        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        def diff(a: float | None, b: float | None) -> float | None:
            return a - b if a is not None and b is not None else None

        lines += [
            f"**Long prefill** ({args.ttft_words}-word prompt, chunk 256, `return_progress`; median of "
            f"{args.ttft_repeat}, one request at a time)",
            "",
            "| | floor ms | proxy ms | added ms |",
            "|---|---|---|---|",
        ]
        for key, name in (
            ("progress_ms", "first prompt_progress chunk"),
            ("first_token_ms", "first token (TTFT)"),
        ):
            a, b = med(pr[key]), med(fl[key])
            lines.append(f"| {name} | {fmt_ms(b)} | {fmt_ms(a)} | {fmt_ms(diff(a, b))} |")
        lines.append("")
    if results.get("idle"):
        i = results["idle"]
        lines += [
            f"**Idle open streams**: {i['streams']} streams waiting in the worker's queue (no events): "
            f"RSS {i['idle_kb'] / 1024:.1f} MB idle, {i['held_kb'] / 1024:.1f} MB with them open "
            f"(**{i['per_stream_kb']:.1f} KB per stream**), {i['after_kb'] / 1024:.1f} MB after they left.",
            "",
        ]
    if results.get("dialects"):
        lines += dialects_table(results["dialects"], args.dialect_streams)
        lines.append("")
    if results.get("litellm"):
        lines += [
            "**Through LiteLLM's proxy** (client → LiteLLM → this proxy → worker), beside the floor",
            "",
            "| streams | tok/s | added p50 / p99 / max ms | LiteLLM CPU µs/token (steady · all) | verified |",
            "|---|---|---|---|---|",
        ]
        for n, r in results["litellm"].items():
            lines.append(
                f"| {n} | {r['tok_s']:,.0f} | {fmt_ms(added(r, 'p50'))} / {fmt_ms(added(r, 'p99'))} / "
                f"{fmt_ms(added(r, 'max'))} | {r['cpu_us_per_token']:.0f} · {r['cpu_us_per_token_all']:.0f} "
                f"| {verified(r)} |"
            )
        lines.append("")
    for label, pf in results.get("profile", {}).items():
        run = pf["run"]
        lines += [
            f"**Profile of {label}** (py-spy --native, {args.profile_streams} streams, "
            f"{run['tok_s']:,.0f} tok/s, {run['proxy_cpu_pct']:.0f}% CPU; shares of the busy samples "
            f"while serving; `{pf['file']}`)",
            "",
        ]
        for kind in ("areas", "own", "total"):
            lines += [f"| {kind} % | {'area' if kind == 'areas' else 'function'} |", "|---|---|"]
            lines += [f"| {pct:.1f} | `{f}` |" for f, pct in pf["top"].get(kind, [])]
            lines.append("")
    runs = [
        *results["levels"].items(),
        *((f"dialect {a}", rs) for a, rs in results.get("dialects", {}).items()),
    ]
    for label, rows in runs:
        bad = [f for r in rows for f in r["proxied"]["failures"] + ((r["floor"] or {}).get("failures") or [])]
        if bad:
            lines.append(f"FAILURES ({label}): {bad[:5]}")
    return "\n".join(lines)


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import uvloop  # noqa: F401

        loop = "uvloop installed"
    except ImportError:
        loop = "no uvloop"
    return (
        f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}, "
        f"{loop}, load average {os.getloadavg()[0]:.2f} at start"
    )


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b <= 0:
        return "—"
    return f"{a / b:.2f}"


# ---------------------------------------------------------------- main


@contextlib.contextmanager
def run_dir() -> Iterator[Path]:
    # Short: ipc:// paths are limited to ~100 bytes.
    d = Path(tempfile.mkdtemp(prefix="pl-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument(
        "--sections",
        default="levels,dialects,saturation,ttft,idle,litellm",
        help="comma-separated: levels, dialects, saturation, ttft, idle, litellm",
    )
    parser.add_argument("--levels", type=ints, default=[1, 16, 64, 256, 1000])
    parser.add_argument("--saturation", type=ints, default=[1000, 2000, 3000])
    parser.add_argument("--dialect-streams", type=int, default=64, help="dialects: streams per phase")
    parser.add_argument("--dialect-rounds", type=int, default=3, help="dialects: interleaved rounds")
    parser.add_argument("--max-tokens", type=int, default=250, help="tokens per stream")
    parser.add_argument("--step-ms", type=float, default=20.0, help="worker step period")
    parser.add_argument("--ttft-words", type=int, default=4000)
    parser.add_argument("--ttft-repeat", type=int, default=10)
    parser.add_argument("--idle-streams", type=int, default=1000)
    parser.add_argument(
        "--litellm",
        default=str(ROOT / ".cache/bench/litellm-venv/bin/litellm"),
        help="LiteLLM's executable (section skipped when absent)",
    )
    parser.add_argument("--litellm-streams", type=ints, default=[64])
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        help="extra option for the proxy under test, e.g. --proxy-arg=--stream-interval=4",
    )
    parser.add_argument(
        "--tree",
        type=Path,
        help="run the proxy of this checkout instead of this tree's (the workers stay this tree's)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        action="append",
        default=[],
        help="another checkout (repeatable): its proxy runs the levels too, level by level",
    )
    parser.add_argument("--profile", help="directory: profile the proxy with py-spy at --profile-streams")
    parser.add_argument("--profile-streams", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the proxy under test alone on the first CPU, everything else on the others",
    )
    parser.add_argument(
        "--settle", type=float, default=30.0, help="seconds to wait, before each phase, for a quiet host"
    )
    parser.add_argument(
        "--settle-idle", type=float, default=90.0, help="percent of CPU idle that counts as quiet"
    )
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:
        # The proxy alone on one CPU, everything else (workers, floor, load
        # generator, this script) on the others: otherwise the load generator,
        # woken by each write, preempts the proxy in the middle of its fan-out,
        # and the wake-up ping-pong of a shared core is measured as proxy latency.
        PROXY_CPUS.add(cpus[0])
        os.sched_setaffinity(0, set(cpus[1:]))

    procs = Procs()
    sampler = Sampler()
    sampler.start()
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine()
        + (
            f"; proxy pinned to CPU {min(PROXY_CPUS)}, everything else to the other CPUs"
            if PROXY_CPUS
            else "; nothing pinned"
        ),
        "args": {k: str(v) for k, v in vars(args).items()},
        "levels": {},
    }
    with run_dir() as tmp:
        logs = tmp / "logs"
        logs.mkdir()
        try:
            main_tree = args.tree.resolve() if args.tree else ROOT
            main_label = "this tree" if args.tree is None else main_tree.name
            main_t = Target(main_label, main_tree, (f"ipc://{tmp}/a-in", f"ipc://{tmp}/a-out"), free_port())
            floor = Target("floor", ROOT, (f"ipc://{tmp}/f-in", f"ipc://{tmp}/f-out"), 0)
            targets = [main_t]
            for k, tree in enumerate(args.compare):
                targets.append(
                    Target(
                        tree.resolve().name,
                        tree.resolve(),
                        (f"ipc://{tmp}/c{k}-in", f"ipc://{tmp}/c{k}-out"),
                        free_port(),
                    )
                )
            log = (logs / "worker-floor.log").open("ab")
            floor.worker = procs.add(
                "worker-floor",
                subprocess.Popen(
                    worker_cmd(args, floor.addrs, "--max-batch-size", "8192"),
                    cwd=ROOT,
                    env=env_for(),
                    stdout=log,
                    stderr=log,
                ),
            )
            for t in targets:
                start_target(t, args, procs, logs, sampler)
            if "levels" in sections:
                for t in targets:
                    results["levels"][t.label] = []
                results["send_floor"] = {}
                for n in args.levels:
                    for t in targets:
                        print(f"[levels] {t.label}: {n} streams", file=sys.stderr, flush=True)
                        results["levels"][t.label].append(streams_phase(t, n, args, sampler, floor=floor))
                    if n not in results["send_floor"]:
                        results["send_floor"][n] = send_floor(n, args)
                results["compare_ratios"] = {}
                for t in targets[1:]:
                    ratios = {}
                    for a, b in zip(results["levels"][main_t.label], results["levels"][t.label], strict=True):
                        ratios[a["streams"]] = {
                            "p50": ratio(added(a, "p50"), added(b, "p50")),
                            "p99": ratio(added(a, "p99"), added(b, "p99")),
                            "cpu": ratio(a["cpu_us_per_token"], b["cpu_us_per_token"]),
                            "rss": ratio(a["rss_per_stream_kb"], b["rss_per_stream_kb"]),
                        }
                    results["compare_ratios"][t.label] = ratios
            for t in targets[1:]:
                stop_proxy(t, procs)
            if "dialects" in sections:
                results["dialects"] = dialects_phase(main_t, floor, args, sampler)
            if "ttft" in sections:
                print("[ttft]", file=sys.stderr, flush=True)
                results["ttft"] = ttft_phase(main_t, floor, args)
            if "saturation" in sections:
                results["saturation"] = []
                for n in args.saturation:
                    print(f"[saturation] {n} streams", file=sys.stderr, flush=True)
                    results["saturation"].append(streams_phase(main_t, n, args, sampler, floor=None))
            if "litellm" in sections:
                print("[litellm]", file=sys.stderr, flush=True)
                results["litellm"] = litellm_phase(main_t, floor, args, procs, logs, sampler, tmp)
            if args.profile:
                results["profile"] = {}
                for t in targets:
                    print(f"[profile] {t.label}", file=sys.stderr, flush=True)
                    results["profile"][t.label] = profile_phase(t, args, procs, logs, sampler)
            stop_proxy(main_t, procs)
            if "idle" in sections:
                print("[idle]", file=sys.stderr, flush=True)
                results["idle"] = idle_phase(args, procs, logs, sampler, tmp, main_tree)
        finally:
            procs.stop_all()
            sampler.stop()
            if args.json:
                args.json.write_text(json.dumps(results, indent=1, default=str))
            keep = ROOT / ".cache/bench/last-logs"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(logs, keep)
    print(report(results, args))


if __name__ == "__main__":
    main()
