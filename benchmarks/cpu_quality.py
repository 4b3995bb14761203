"""How close the CPU engine's quantized forward passes stay to float32 on the
embedded SmolLM2-135M-Instruct: teacher-forced over a fixed English text, every
position's next-token logits against float32's.

Rows: float32 (the reference, its perplexity), int4 through torch's kernel
(``_weight_int4pack_mm_for_cpu``: bfloat16 activations), int4 through the VNNI
kernel where this CPU runs it (``engine_worker.cpu.vnni``: int8 activations in
groups of 32, llama.cpp's Q4_1 x Q8_1 scheme), int8. Columns: the share of
positions whose greedy token is float32's, the mean KL divergence from float32's
distribution (nats), and the perplexity of the text. Every row goes through the
quantized kernels (``dense_prefill`` off: prompt chunks of 32+ tokens would
otherwise run through bfloat16 copies of the weights).

Usage: python benchmarks/cpu_quality.py [--tokens N]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from engine_worker.cpu.kernels import int4
from engine_worker.cpu.llama import LlamaRunner, Segment
from engine_worker.cpu.model_store import load_embedded
from engine_worker.cpu.quant import Quantization

TEXT = (
    "The committee met on Tuesday to review the quarterly budget. Revenue rose by four percent, while "
    "operating costs fell slightly after the new suppliers were contracted. The chair asked each department "
    "to submit revised forecasts before the end of the month, and the treasurer noted that the reserve fund "
    "remains above its target level. After a short break, the members discussed the plan to renovate the "
    "library on the east side of town. The architect presented three designs, each with a larger reading "
    "room, a cafe near the entrance and solar panels on the roof. Most members preferred the second design "
    "because it keeps the old stone facade. Rivers shape the land they cross. Over thousands of years a "
    "river cuts a valley, carries sand and gravel downstream and builds wide plains where it slows near the "
    "sea. Floods, which people fear, also bring the fine silt that makes those plains fertile, and many of "
    "the oldest cities grew up beside rivers for that reason. Today engineers build dams and levees to "
    "control the water, but each change upstream alters what happens below: a dam holds back the sediment "
    "that once renewed the delta, and the coast begins to shrink. Understanding a river means following it "
    "from its source to its mouth. The first railways carried coal from the mines to the nearest canal. "
    "Within a few decades they linked the great cities, and a journey that had taken days by coach took "
    "hours. Towns that the line passed by often declined, while villages with a station grew quickly. The "
    "railway also changed how people thought about time: before it, each town kept its own local hour, set "
    "by the sun, but trains needed one timetable, and so the country adopted a single standard time. "
    "Honeybees live in colonies of tens of thousands. A single queen lays the eggs, worker bees gather "
    "nectar and pollen, build the comb and tend the young, and drones exist only to mate. When a scout finds "
    "a rich patch of flowers, she returns to the hive and performs a dance whose angle and length tell the "
    "others where to fly and how far to go."
)


def passes(runner: LlamaRunner, ids: list[int]) -> torch.Tensor:
    """Next-token logits ``[len(ids) - 1, vocab]`` for every position but the last."""
    kv = runner.new_kv(len(ids))
    with torch.inference_mode():
        logits = runner.forward([Segment(kv, ids, len(ids))])[0]
    assert logits is not None
    return logits[:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=0, help="the first N tokens of the text (0: all)")
    args = parser.parse_args()
    loaded = load_embedded()
    ids = list(loaded.tokenizer(TEXT)["input_ids"])[: args.tokens or None]
    targets = torch.tensor(ids[1:])
    reference = passes(LlamaRunner(loaded.model, Quantization.NONE, len(ids) + 8, False), ids)
    ref_logp = reference.log_softmax(-1)
    rows = [("float32", reference)]
    with mock.patch.object(int4, "available", return_value=False):
        rows.append(
            (
                "int4, torch's kernel",
                passes(LlamaRunner(loaded.model, Quantization.INT4, len(ids) + 8, False), ids),
            )
        )
    if int4.available():
        rows.append(
            (
                "int4, VNNI kernel",
                passes(LlamaRunner(loaded.model, Quantization.INT4, len(ids) + 8, False), ids),
            )
        )
    rows.append(("int8", passes(LlamaRunner(loaded.model, Quantization.INT8, len(ids) + 8, False), ids)))
    print(f"{len(ids)} tokens, teacher-forced; against float32")
    print("| weights | greedy token as float32's | KL from float32 (nats) | perplexity |")
    print("|---|---|---|---|")
    for name, logits in rows:
        logp = logits.log_softmax(-1)
        agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        ppl = torch.exp(-logp.gather(1, targets[:, None]).mean()).item()
        print(f"| {name} | {agree * 100:.1f}% | {kl:.4f} | {ppl:.3f} |")


if __name__ == "__main__":
    main()
