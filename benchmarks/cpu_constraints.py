"""Decode speed of the CPU engine with a JSON-schema grammar and with logprobs.

Greedy decode tok/s for 128 tokens on the embedded SmolLM2-135M-Instruct, the
same chat prompt each time: unconstrained, constrained by a JSON schema (an
array of at least 40 person objects, so the grammar never ends before 128
tokens), constrained with n-gram drafting, and unconstrained with ``logprobs=5``.
Decode tok/s counts the tokens after the first over ``Finished.time_decode``, as
``benchmarks/cpu_engine.py`` does. Also prints what compiling the grammar costs
in ``prepare`` (the first request also builds llguidance's vocabulary).

Usage: python benchmarks/cpu_constraints.py [--dtype float32|bfloat16] [--threads N] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from cpu_engine import run  # this directory: both are run as scripts
from llguidance import LLMatcher

from engine_worker.cpu import CpuBackend
from engine_worker.cpu.model_store import load_embedded
from engine_worker.settings import DraftMode, WorkerSettings
from protocol.messages import ChatMessage, Finished, SamplingParams, Submit

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "minItems": 40,
}
PROMPT = "List forty people as a JSON array of objects with their name, age and city."
TOKENS = 128


def once(backend: CpuBackend, params: SamplingParams, request_id: str) -> tuple[float, str, Finished]:
    text, fin = run(backend, Submit(request_id, params, messages=(ChatMessage("user", PROMPT),)))
    assert fin.completion_tokens == TOKENS, f"finished after {fin.completion_tokens} tokens"
    return (fin.completion_tokens - 1) / fin.time_decode, text, fin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    loaded = load_embedded(dtype=args.dtype)
    grammar = LLMatcher.grammar_from_json_schema(SCHEMA)
    plain = WorkerSettings(prefix_cache_mb=0)
    backend = CpuBackend.from_loaded(loaded, plain)

    base = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=TOKENS, temperature=0.0, grammar=grammar)
    prepare_s = []
    for i in range(args.repeats + 1):  # the first also builds the vocabulary
        t0 = time.perf_counter()
        backend.prepare(Submit(f"p{i}", constrained, messages=(ChatMessage("user", PROMPT),)))
        prepare_s.append(time.perf_counter() - t0)
    print(
        f"prepare with grammar: first {prepare_s[0] * 1000:.0f} ms (vocabulary built), "
        f"then {statistics.median(prepare_s[1:]) * 1000:.1f} ms"
    )

    rows = [
        ("unconstrained", backend, base),
        ("JSON schema", backend, constrained),
        (
            "JSON schema + ngram drafting",
            CpuBackend.from_loaded(loaded, WorkerSettings(prefix_cache_mb=0, draft_mode=DraftMode.NGRAM)),
            constrained,
        ),
        (
            "unconstrained, logprobs=5",
            backend,
            SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=5),
        ),
    ]
    # Rounds take each variant in turn, so a machine busy with something else slows all alike.
    rates: list[list[float]] = [[] for _ in rows]
    last: list[tuple[str, Finished]] = []
    for round_ in range(args.repeats):
        last = []
        for i, (_, engine, params) in enumerate(rows):
            rate, text, fin = once(engine, params, f"r{round_}-{i}")
            rates[i].append(rate)
            last.append((text, fin))
    print(f"{'decode (128 tokens, greedy)':32} {'tok/s':>8} {'vs plain':>9} {'drafts acc/rej':>15}  output")
    plain_rate = statistics.median(rates[0])
    for (name, _, _), variant_rates, (text, fin) in zip(rows, rates, last, strict=True):
        rate = statistics.median(variant_rates)
        drafts = f"{fin.draft_accepted}/{fin.draft_rejected}" if fin.draft_accepted is not None else "-"
        print(f"{name:32} {rate:8.1f} {rate / plain_rate:8.2f}x {drafts:>15}  {text[:40]!r}")


if __name__ == "__main__":
    main()
