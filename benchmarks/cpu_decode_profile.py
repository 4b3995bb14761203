"""Where one decode step of the CPU engine spends its time: torch's profiler over
greedy decode steps of the embedded model (int4, the default), one sequence or
several at once, grouped by kind of work.

Groups (by the profiled op's name): ``int4 matmuls`` (the decoder's linear
layers), ``LM head`` (oneDNN's int8 product, or ``torch._int_mm``),
``attention`` (the fused kernel), ``RMSNorm`` (``F.rms_norm``: the final norm;
the layers' norms are generic kernels, ``llama._rms_norm``, counted with the
rest), ``other torch ops`` (RoPE, KV
writes, casts, residual adds, the head's activation quantization), and
``Python and dispatch`` (the wall time of the forward passes not inside any op:
the interpreter running ``LlamaRunner.forward``). The engine's own work around
a pass (sampling, detokenizing, events) is not in it.

The profiler adds a little to each op; ``--plain`` prints the step times
without it.

Usage: python benchmarks/cpu_decode_profile.py [--sequences N] [--steps N] [--context N] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine_worker.cpu import CpuBackend
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend = CpuBackend.from_loaded(load_embedded(), WorkerSettings(prefix_cache_mb=0, threads=args.threads))
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


if __name__ == "__main__":
    main()
