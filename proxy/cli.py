"""The ``exl3-sidecar`` command: ``serve``, ``worker`` and ``proxy``.

Every option can also be set by the environment variable shown in ``--help``
(``EXL3_SIDECAR_<NAME>``); the values are read once into frozen config objects.
``worker`` imports the engine lazily, so ``proxy`` runs on the base install
without torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

log = logging.getLogger("exl3_sidecar")


def _opt(*decls: str, env: str, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(*decls, envvar=f"EXL3_SIDECAR_{env}", show_envvar=True, show_default=True, **kw)


def _apply(options: list[Callable[[Callable[..., Any]], Callable[..., Any]]]) -> Callable[..., Any]:
    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        for o in reversed(options):
            f = o(f)
        return f

    return deco


_ADDR_OPTIONS = [
    _opt(
        "--input-addr",
        env="INPUT_ADDR",
        default=None,
        help="ZeroMQ address of the worker's request socket (default: ipc:// in a private runtime dir).",
    ),
    _opt(
        "--output-addr",
        env="OUTPUT_ADDR",
        default=None,
        help="ZeroMQ address of the worker's event socket (default: ipc:// in a private runtime dir).",
    ),
    _opt(
        "--log-level",
        env="LOG_LEVEL",
        default="info",
        type=click.Choice(["debug", "info", "warning", "error"]),
    ),
]

# Worker options; names follow TabbyAPI's where one exists (max_seq_len, cache_size,
# cache_mode, chunk_size, gpu_split, tensor_parallel, draft_model_dir, ...).
_WORKER_SPECS: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
    (
        ("--backend",),
        "BACKEND",
        dict(
            default="cpu",
            type=click.Choice(["cpu", "exllamav3"]),
            help="Engine: the CPU engine (embedded SmolLM2-135M-Instruct by default) or ExLlamaV3 on CUDA.",
        ),
    ),
    (
        ("--model-dir",),
        "MODEL_DIR",
        dict(
            default=None,
            type=click.Path(file_okay=False, path_type=Path),
            help="Model directory (EXL3 for exllamav3, HF safetensors for cpu; cpu default: embedded model).",
        ),
    ),
    (
        ("--max-seq-len",),
        "MAX_SEQ_LEN",
        dict(
            default=None,
            type=click.IntRange(min=16),
            help="Context length in tokens, prompt + completion (default: cpu 8192, exllamav3 the model's).",
        ),
    ),
    (
        ("--chunk-size",),
        "CHUNK_SIZE",
        dict(
            default=None,
            type=click.IntRange(min=1),
            help="Prefill chunk size in tokens, one progress event each (default: cpu 256, exllamav3 2048).",
        ),
    ),
    (
        ("--draft-mode",),
        "DRAFT_MODE",
        dict(
            default="none",
            type=click.Choice(["none", "ngram", "draft_model", "mtp"]),
            help="Speculative decoding: n-gram prompt lookup, or (exllamav3) a draft model or MTP head.",
        ),
    ),
    (
        ("--num-draft-tokens",),
        "NUM_DRAFT_TOKENS",
        dict(
            default=None,
            type=click.IntRange(min=1),
            help="Draft length in tokens per verification (default: cpu 4, exllamav3 the drafter's own).",
        ),
    ),
    (
        ("--ngram-match-min",),
        "NGRAM_MATCH_MIN",
        dict(
            default=2,
            type=click.IntRange(min=1),
            help="Shortest n-gram (tokens) that must match before n-gram drafting proposes tokens.",
        ),
    ),
    # cpu engine
    (
        ("--cache-dir",),
        "CACHE_DIR",
        dict(
            default=None,
            type=click.Path(file_okay=False, path_type=Path),
            help="[cpu] Where the embedded model is converted once (default: $XDG_CACHE_HOME/exl3-sidecar).",
        ),
    ),
    (
        ("--dtype",),
        "DTYPE",
        dict(default="float32", type=click.Choice(["float32", "bfloat16"]), help="[cpu] Compute dtype."),
    ),
    (
        ("--prefix-cache-mb",),
        "PREFIX_CACHE_MB",
        dict(
            default=1024,
            type=click.IntRange(min=0),
            help="[cpu] Memory budget of the prefix cache (KV of earlier sequences), MiB.",
        ),
    ),
    (
        ("--threads",),
        "THREADS",
        dict(
            default=None,
            type=click.IntRange(min=1),
            help="[cpu] torch intra-op threads (default: torch's choice).",
        ),
    ),
    # exllamav3
    (
        ("--cache-size",),
        "CACHE_SIZE",
        dict(
            default=None,
            type=click.IntRange(min=256),
            help="[exllamav3] KV cache size in tokens, a multiple of 256 (default: max-seq-len).",
        ),
    ),
    (
        ("--cache-mode",),
        "CACHE_MODE",
        dict(
            default="FP16", help="[exllamav3] KV cache precision: FP16, or k_bits,v_bits such as 8,8 or 4,4."
        ),
    ),
    (
        ("--max-batch-size",),
        "MAX_BATCH_SIZE",
        dict(default=None, type=click.IntRange(min=1), help="[exllamav3] Most sequences decoded together."),
    ),
    (
        ("--gpu-split",),
        "GPU_SPLIT",
        dict(default=None, help="[exllamav3] GB of VRAM per GPU, comma-separated (default: autosplit)."),
    ),
    (
        ("--tensor-parallel/--no-tensor-parallel",),
        "TENSOR_PARALLEL",
        dict(default=False, help="[exllamav3] Load with tensor parallelism across GPUs."),
    ),
    (
        ("--draft-model-dir",),
        "DRAFT_MODEL_DIR",
        dict(
            default=None,
            type=click.Path(file_okay=False, path_type=Path),
            help="[exllamav3] Draft model (EXL3) for --draft-mode draft_model.",
        ),
    ),
    (
        ("--draft-cache-size",),
        "DRAFT_CACHE_SIZE",
        dict(
            default=None,
            type=click.IntRange(min=256),
            help="[exllamav3] Draft model KV cache size in tokens (default: cache-size).",
        ),
    ),
    (
        ("--draft-cache-mode",),
        "DRAFT_CACHE_MODE",
        dict(default="FP16", help="[exllamav3] Draft model KV cache precision, as --cache-mode."),
    ),
    (
        ("--draft-gpu-split",),
        "DRAFT_GPU_SPLIT",
        dict(default=None, help="[exllamav3] GB of VRAM per GPU for the draft model, comma-separated."),
    ),
    (
        ("--tensor-parallel-backend",),
        "TENSOR_PARALLEL_BACKEND",
        dict(
            default="native",
            type=click.Choice(["native", "nccl"]),
            help="[exllamav3] Tensor-parallel transport.",
        ),
    ),
    (
        ("--max-rq-tokens",),
        "MAX_RQ_TOKENS",
        dict(
            default=None,
            type=click.IntRange(min=1),
            help="[exllamav3] Output chunking: requeue a job after this many new tokens (default 2048).",
        ),
    ),
    (
        ("--warmup/--no-warmup",),
        "WARMUP",
        dict(default=True, help="[exllamav3] Run one warm-up pass before serving."),
    ),
    (
        ("--heartbeat-interval",),
        "HEARTBEAT_INTERVAL",
        dict(default=1.0, type=click.FloatRange(min=0.05), help="Seconds between worker heartbeats."),
    ),
]

_WORKER_OPTIONS = [_opt(*decls, env=env, **kw) for decls, env, kw in _WORKER_SPECS]


_PROXY_OPTIONS = [
    _opt("--host", env="HOST", default="0.0.0.0", help="Address the HTTP server listens on."),
    _opt("--port", env="PORT", default=5000, type=click.IntRange(1, 65535), help="HTTP port."),
    _opt(
        "--served-model-name",
        env="SERVED_MODEL_NAME",
        default=None,
        help="Model name reported to clients (default: the worker's model id).",
    ),
    _opt(
        "--sse-ping-interval",
        env="SSE_PING_INTERVAL",
        default=15.0,
        type=click.FloatRange(min=0.01),
        help="Seconds of stream silence before a ': ping' SSE comment is sent.",
    ),
    _opt(
        "--max-in-flight",
        env="MAX_IN_FLIGHT",
        default=256,
        type=click.IntRange(min=1),
        help="Concurrent requests admitted; beyond it requests get 503.",
    ),
    _opt(
        "--heartbeat-timeout",
        env="HEARTBEAT_TIMEOUT",
        default=30.0,
        type=click.FloatRange(min=0.1),
        help="Seconds without any worker message before the worker is declared dead.",
    ),
    _opt(
        "--shutdown-drain",
        env="SHUTDOWN_DRAIN",
        default=20.0,
        type=click.FloatRange(min=0),
        help="Seconds in-flight requests may finish after SIGTERM before they are aborted.",
    ),
]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def _addresses(input_addr: str | None, output_addr: str | None) -> tuple[str, str]:
    if input_addr and output_addr:
        return input_addr, output_addr
    from engine_worker.config import default_addresses

    din, dout = default_addresses()
    return input_addr or din, output_addr or dout


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """OpenAI-compatible server that streams prefill progress and reports prefix-cache and draft usage."""


def _make_backend_factory(p: dict[str, Any]) -> Callable[[], Any]:
    if p["backend"] == "cpu":
        from engine_worker.cpu.config import CpuEngineConfig

        if p["draft_mode"] not in ("none", "ngram"):
            raise click.UsageError(f"--draft-mode {p['draft_mode']} needs --backend exllamav3")
        kw: dict[str, Any] = {
            "model_dir": p["model_dir"],
            "num_draft_tokens": p["num_draft_tokens"] or 4,
            "dtype": p["dtype"],
            "prefix_cache_mb": p["prefix_cache_mb"],
            "ngram_drafting": p["draft_mode"] == "ngram",
            "ngram_match_min": p["ngram_match_min"],
            "ngram_match_max": max(4, p["ngram_match_min"]),
            "num_threads": p["threads"],
        }
        if p["cache_dir"] is not None:
            kw["cache_dir"] = p["cache_dir"]
        if p["max_seq_len"] is not None:
            kw["max_context_tokens"] = p["max_seq_len"]
        if p["chunk_size"] is not None:
            kw["prefill_chunk_size"] = p["chunk_size"]
        try:
            cpu_config = CpuEngineConfig(**kw)
        except ValueError as e:
            raise click.UsageError(str(e)) from e

        def make_cpu() -> Any:
            from engine_worker.cpu.engine import CpuBackend

            return CpuBackend(cpu_config)

        return make_cpu

    from engine_worker.exllamav3.config import ExLlamaV3Config

    if p["model_dir"] is None:
        raise click.UsageError("--backend exllamav3 needs --model-dir (an EXL3 model directory)")
    try:
        exl3_config = ExLlamaV3Config.from_cli(p)
    except ValueError as e:
        raise click.UsageError(str(e)) from e

    def make_exl3() -> Any:
        from engine_worker.exllamav3.loader import build_backend

        return build_backend(exl3_config)

    return make_exl3


@main.command()
@_apply(_ADDR_OPTIONS + _WORKER_OPTIONS)
def worker(**p: Any) -> None:
    """Run the engine worker alone (one container of a pod)."""
    _setup_logging(p["log_level"])
    from engine_worker.config import LoopConfig
    from engine_worker.main import run_worker

    input_addr, output_addr = _addresses(p["input_addr"], p["output_addr"])
    factory = _make_backend_factory(p)
    run_worker(LoopConfig(input_addr, output_addr, p["heartbeat_interval"]), factory)


def _proxy_config(p: dict[str, Any], input_addr: str, output_addr: str) -> Any:
    from proxy.config import ProxyConfig

    return ProxyConfig(
        host=p["host"],
        port=p["port"],
        input_addr=input_addr,
        output_addr=output_addr,
        served_model_name=p["served_model_name"],
        sse_ping_interval_s=p["sse_ping_interval"],
        max_in_flight=p["max_in_flight"],
        heartbeat_timeout_s=p["heartbeat_timeout"],
        shutdown_drain_s=p["shutdown_drain"],
        log_level=p["log_level"],
    )


@main.command()
@_apply(_ADDR_OPTIONS + _PROXY_OPTIONS)
def proxy(**p: Any) -> None:
    """Run the HTTP proxy alone (the sidecar container of a pod)."""
    _setup_logging(p["log_level"])
    from proxy.app import run_proxy
    from proxy.engine_client import ZmqEngineClient

    config = _proxy_config(p, *_addresses(p["input_addr"], p["output_addr"]))
    asyncio.run(run_proxy(config, ZmqEngineClient(config)))


def _worker_env(p: dict[str, Any], input_addr: str, output_addr: str) -> dict[str, str]:
    """Environment for a ``worker`` child carrying ``serve``'s worker options, so
    both commands share one option table and its parsing."""
    env = dict(os.environ)
    values = {"INPUT_ADDR": input_addr, "OUTPUT_ADDR": output_addr, "LOG_LEVEL": p["log_level"]}
    params = {prm.envvar: prm.name for prm in click.get_current_context().command.params}
    for _decls, name, _kw in _WORKER_SPECS:
        value = p[params[f"EXL3_SIDECAR_{name}"]]
        if value is not None:
            values[name] = str(int(value)) if isinstance(value, bool) else str(value)
    env.update({f"EXL3_SIDECAR_{k}": v for k, v in values.items()})
    return env


async def _supervise_worker(env: dict[str, str], stopping: asyncio.Event) -> None:
    """Keep a worker subprocess running; restart it if it dies, the way a
    Kubernetes pod would, backing off from 2 s to 30 s while it keeps failing
    fast (a bad model path). Its requests fail cleanly in the proxy."""
    backoff = 1.0
    while True:
        started = time.monotonic()
        # A session of its own: Ctrl-C in the terminal reaches only serve, which
        # drains in-flight requests before it stops the worker.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.cli", "worker", env=env, start_new_session=True
        )
        try:
            rc = await proc.wait()
        except asyncio.CancelledError:
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            raise
        if stopping.is_set():
            return
        backoff = 2.0 if time.monotonic() - started > 60 else min(backoff * 2, 30.0)
        log.error("worker exited with code %s; restarting in %.0f s", rc, backoff)
        await asyncio.sleep(backoff)


@main.command()
@_apply(_ADDR_OPTIONS + _WORKER_OPTIONS + _PROXY_OPTIONS)
def serve(**p: Any) -> None:
    """Run worker and proxy together: the embedded default model on port 5000."""
    _setup_logging(p["log_level"])
    from proxy.app import run_proxy
    from proxy.engine_client import ZmqEngineClient

    with contextlib.ExitStack() as stack:
        if p["input_addr"] and p["output_addr"]:
            input_addr, output_addr = p["input_addr"], p["output_addr"]
        else:
            # A fresh private directory per serve: two serves never share sockets.
            rundir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="exl3-sidecar-")))
            os.chmod(rundir, 0o700)
            input_addr, output_addr = f"ipc://{rundir / 'input.sock'}", f"ipc://{rundir / 'output.sock'}"
        _make_backend_factory(p)  # validate worker options before starting anything
        config = _proxy_config(p, input_addr, output_addr)
        env = _worker_env(p, input_addr, output_addr)

        async def run() -> None:
            stopping = asyncio.Event()
            sup = asyncio.create_task(_supervise_worker(env, stopping))
            try:
                await run_proxy(config, ZmqEngineClient(config))
            finally:
                stopping.set()
                sup.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sup

        asyncio.run(run())


if __name__ == "__main__":
    main()
