"""One linear layer's product on the CPU engine's int4 kernels, alone: torch's
``_weight_int4pack_mm_for_cpu`` and the VNNI kernel (``engine_worker.cpu.vnni``,
where this CPU runs it), for the embedded model's shapes, 2 threads.

Each figure is µs per product, with the weight in cache (the same one again and
again) and with 120 distinct weights of the shape cycled (out of cache, as a
decode pass meets them: its 30 layers and LM head read about 90 MiB). Then torch's
kernel for 1 to 8 rows of one weight, in cache: it unpacks the weight once per
block of 4 rows.

Usage: python benchmarks/cpu_kernels.py [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from unittest import mock

import torch

from engine_worker.cpu.kernels import int4
from engine_worker.cpu.quant import Quantization, QuantizedLinear

SHAPES = (
    ("3,072 x 576 (gate/up)", 3072, 576),
    ("960 x 576 (q/k/v)", 960, 576),
    ("576 x 1,536 (down)", 576, 1536),
)
CYCLED = 120


def per_call(f: Callable[[], object], calls: int) -> float:
    """µs per call of ``f`` after one warm-up call."""
    f()
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e6


def each(products: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> None:
    for product in products:
        product(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = ["torch int4"] + (["VNNI"] if int4.available() else [])
    print(f"{args.threads} threads; µs per product, weight in cache / {CYCLED} weights cycled")
    print("| product | " + " | ".join(f"{k}, {m} row{'s' * (m > 1)}" for m in (1, 8) for k in kernels) + " |")
    print("|---|" + "---|" * (2 * len(kernels)))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, n, k in SHAPES:
            weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(CYCLED)]
            built = {}
            with mock.patch.object(int4, "available", return_value=False):
                built["torch int4"] = [QuantizedLinear(w, None, Quantization.INT4).raw for w in weights]
            if "VNNI" in kernels:
                built["VNNI"] = [QuantizedLinear(w, None, Quantization.INT4).raw for w in weights]
            cells = []
            for rows in (1, 8):
                x = torch.randn(rows, k, generator=gen)
                for kernel in kernels:
                    fs = built[kernel]
                    xk = x.bfloat16() if kernel == "torch int4" else x
                    alone = per_call(functools.partial(fs[0], xk), 500)
                    cycled = per_call(functools.partial(each, fs, xk), 5) / CYCLED
                    cells.append(f"{alone:.0f} / {cycled:.0f}")
            print(f"| {name} | " + " | ".join(cells) + " |")
        name, n, k = SHAPES[0]
        with mock.patch.object(int4, "available", return_value=False):
            product = QuantizedLinear(torch.randn(n, k, generator=gen) * 0.02, None, Quantization.INT4).raw
        times = [
            per_call(functools.partial(product, torch.ones(rows, k, dtype=torch.bfloat16)), 300)
            for rows in range(1, 9)
        ]
        print(f"\ntorch int4, {name}, 1..8 rows in cache: " + ", ".join(f"{t:.0f}" for t in times) + " µs")


if __name__ == "__main__":
    main()
