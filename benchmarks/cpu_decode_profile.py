"""Where one decode step of the CPU engine spends its time: torch's profiler over
greedy decode steps of the embedded model (int4, the default), one sequence or
several at once, grouped by kind of work.

Groups (by the profiled op's name; the profiler sees torch's ops only, so with
the VNNI kernels (``engine_worker.cpu.vnni``) their time is in ``Python and
dispatch``: use ``--ablate``): ``int4 matmuls`` (the decoder's linear layers),
``LM head`` (oneDNN's int8 product, or ``torch._int_mm``),
``attention`` (the fused kernel), ``RMSNorm`` (``F.rms_norm``: the final norm;
the layers' norms are generic kernels, ``llama._rms_norm``, counted with the
rest), ``other torch ops`` (RoPE, KV
writes, casts, residual adds, the head's activation quantization), and
``Python and dispatch`` (the wall time of the forward passes not inside any op:
the interpreter running ``LlamaRunner.forward``). The engine's own work around
a pass (sampling, detokenizing, events) is not in it.

The profiler adds a little to each op; ``--plain`` prints the step times
without it. ``--ablate`` measures without a profiler what each kind of work
costs inside the pass: the step time as the layers' matrix products, then also
the LM head, then also attention are replaced by their first result for that
shape (memoized, so nothing but a lookup runs), each cost the difference. It
counts what the profiler cannot: a kernel's cache misses and thread wake-ups
inside a pass, where the weights of 30 layers and the head do not stay in
cache between steps as one kernel's do when timed alone.

``--torch-kernels`` builds the engine without the VNNI kernels (torch's int4
kernel and fused attention, as on a CPU without AVX-512 VNNI), for a before and
after in one session.

Usage: python benchmarks/cpu_decode_profile.py [--sequences N] [--steps N] [--context N] [--threads N]
       [--plain | --ablate] [--torch-kernels]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from engine_worker.cpu import CpuBackend
from engine_worker.cpu.kernels import int4
from engine_worker.cpu.kernels.attention import DecodeAttention
from engine_worker.cpu.llama import Segment
from engine_worker.cpu.model_store import load_embedded
from engine_worker.settings import WorkerSettings

GROUPS = (
    ("int4 matmuls", ("_weight_int4pack_mm",)),
    ("LM head", ("qlinear_pointwise", "_int_mm")),
    ("attention", ("_scaled_dot_product_flash_attention",)),
    ("RMSNorm", ("aten::rms_norm",)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=1, help="sequences decoded at once")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--context", type=int, default=100, help="positions already in each KV cache")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--plain", action="store_true", help="step times only, no profiler")
    parser.add_argument("--ablate", action="store_true", help="each kind of work's cost, no profiler")
    parser.add_argument(
        "--torch-kernels", action="store_true", help="torch's int4 kernel and attention, not the VNNI ones"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with mock.patch.object(int4, "available", return_value=False) if args.torch_kernels else nullcontext():
        backend = CpuBackend.from_loaded(
            load_embedded(), WorkerSettings(prefix_cache_mb=0, threads=args.threads)
        )
    if args.torch_kernels:
        backend.runner._native_attention = False
    runner = backend.runner

    with torch.inference_mode():
        kvs = [runner.new_kv(args.context + args.steps + 8) for _ in range(args.sequences)]
        for kv in kvs:
            runner.forward([Segment(kv, [1] * args.context, 1)])

        def steps() -> list[float]:
            for kv in kvs:
                kv.truncate(args.context)
            times = []
            for i in range(args.steps):
                t0 = time.perf_counter()
                runner.forward([Segment(kv, [100 + i], 1) for kv in kvs])
                times.append(time.perf_counter() - t0)
            return times

        steps()  # warm
        plain = steps()
        print(
            f"{args.sequences} sequence(s), {args.context} positions of context, {args.threads} threads: "
            f"forward pass median {statistics.median(plain) * 1e3:.2f} ms "
            f"({args.sequences / statistics.median(plain):.1f} tok/s)"
        )
        if args.plain:
            return
        if args.ablate:
            ablate(runner, steps, statistics.median(plain))
            return
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            steps()
            wall = time.perf_counter() - t0
    per_step = 1e3 / args.steps
    totals = dict.fromkeys([g for g, _ in GROUPS], 0.0)
    other = 0.0
    for event in prof.key_averages():
        self_ms = event.self_cpu_time_total / 1e3
        group = next((g for g, keys in GROUPS if any(k in event.key for k in keys)), None)
        if group is None:
            other += self_ms
        else:
            totals[group] += self_ms
    ops = sum(totals.values()) + other
    rows = [*totals.items(), ("other torch ops", other), ("Python and dispatch", max(wall * 1e3 - ops, 0.0))]
    print(f"profiled: {wall * per_step:.2f} ms per step")
    print("| where | ms per step | share |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms * per_step / 1e3:.2f} | {ms / (wall * 1e3) * 100:.0f}% |")


def memoized(compute: Callable[..., torch.Tensor], key: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``compute`` run once per ``key(*args)``; later calls return that first result."""
    seen: dict[Any, torch.Tensor] = {}

    def lookup(*args: Any, **kwargs: Any) -> torch.Tensor:
        k = key(*args)
        if k not in seen:
            seen[k] = compute(*args, **kwargs)
        return seen[k]

    return lookup


def ablate(runner: Any, steps: Callable[[], list[float]], full: float) -> None:
    """Print the step time as each kind of work is taken out in turn (cumulative),
    and each one's cost as the difference."""
    rows = [("whole step", full)]
    for layer in runner._layers:
        for name in ("qkv", "o", "gate_up", "down"):
            linear = getattr(layer, name)
            linear.raw = memoized(linear.raw, lambda x: x.shape[0])
    rows.append(("without the layers' matrix products", statistics.median(steps())))
    runner._head = memoized(runner._head, lambda x: x.shape[0])
    rows.append(("... and without the LM head", statistics.median(steps())))
    sdpa, native = F.scaled_dot_product_attention, DecodeAttention.__call__
    F.scaled_dot_product_attention = memoized(sdpa, lambda q, k, v: q.shape)
    # the native decode attention writes its outputs in place: skipping it leaves the last ones
    DecodeAttention.__call__ = lambda self, layer: None  # type: ignore[method-assign]
    try:
        rows.append(("... and without attention", statistics.median(steps())))
    finally:
        F.scaled_dot_product_attention = sdpa
        DecodeAttention.__call__ = native  # type: ignore[method-assign]
    print("| step | ms | the part taken out |")
    print("|---|---|---|")
    previous = None
    for name, ms in rows:
        cost = "" if previous is None else f"{(previous - ms) * 1e3:.2f} ms"
        print(f"| {name} | {ms * 1e3:.2f} | {cost} |")
        previous = ms
    print(f"| (left: norms, RoPE, KV writes, residuals, Python) | {rows[-1][1] * 1e3:.2f} | |")


if __name__ == "__main__":
    main()
