"""Prefill and decode speed of the CPU engine on the embedded SmolLM2-135M-Instruct.

Prints prefill tok/s for a ~1000-token prompt (prefix cache off) and greedy decode
tok/s for 128 tokens, without and with n-gram drafting, on a repetitive prompt
(text the model copies, where drafts hit) and on an open-ended one (where they
mostly miss). Decode tok/s counts the tokens after the first (which prefill
produces) over ``Finished.time_decode``.

Usage: python benchmarks/cpu_engine.py [--dtype float32|bfloat16] [--threads N] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine_worker.cpu import CpuBackend
from engine_worker.cpu.model_store import LoadedModel, load_embedded
from engine_worker.settings import DraftMode, WorkerSettings
from protocol.messages import ChatMessage, Finished, SamplingParams, Submit, TokenDelta

PASSAGE = (
    "The committee met on Tuesday to review the quarterly budget. Revenue rose by four percent, "
    "while operating costs fell slightly after the new suppliers were contracted. The chair asked "
    "each department to submit revised forecasts before the end of the month, and the treasurer "
    "noted that the reserve fund remains above its target level. After a short break, the members "
    "discussed the plan to renovate the library on the east side of town. The architect presented "
    "three designs, each with a larger reading room, a cafe near the entrance and solar panels on "
    "the roof. Most members preferred the second design because it keeps the old stone facade."
)
TOPICS = (
    "astronomy",
    "gardening",
    "railways",
    "medieval history",
    "cooking",
    "chess",
    "volcanoes",
    "jazz",
    "bridges",
    "honeybees",
)


def long_prompt() -> str:
    """About 1000 tokens of varied English text."""
    sentences = [
        f"Paragraph {i}: a short note on {topic}, written for readers who enjoy "
        f"{TOPICS[(i + 3) % len(TOPICS)]} and who visited {i * 7 % 31 + 2} museums last year "
        f"while reading about {topic} in the evening."
        for i, topic in enumerate(TOPICS * 3)
    ]
    return " ".join(sentences)


def run(backend: CpuBackend, submit: Submit) -> tuple[str, Finished]:
    backend.add(submit)
    text: list[str] = []
    finished: Finished | None = None
    while backend.active_ids():
        for event in backend.step():
            if isinstance(event, TokenDelta):
                text.append(event.text)
            elif isinstance(event, Finished):
                finished = event
    assert finished is not None, "request did not finish"
    return "".join(text), finished


def bench_prefill(loaded: LoadedModel, repeats: int) -> tuple[int, float]:
    backend = CpuBackend.from_loaded(loaded, WorkerSettings(prefix_cache_mb=0))
    rates, tokens = [], 0
    for i in range(repeats):
        _, fin = run(
            backend, Submit(f"p{i}", SamplingParams(max_tokens=1, temperature=0.0), prompt=long_prompt())
        )
        tokens = fin.prompt_tokens
        rates.append(fin.prompt_tokens / fin.time_prefill)
    return tokens, statistics.median(rates)


def bench_decode(
    loaded: LoadedModel, prompt: str, config: WorkerSettings, repeats: int
) -> tuple[float, Finished, str]:
    backend = CpuBackend.from_loaded(loaded, config)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    rates: list[float] = []
    text, fin = "", None
    for i in range(repeats):
        text, fin = run(backend, Submit(f"d{i}", params, messages=(ChatMessage("user", prompt),)))
        rates.append((fin.completion_tokens - 1) / fin.time_decode)
    assert fin is not None
    return statistics.median(rates), fin, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=2)
    defaults = WorkerSettings()
    parser.add_argument("--num-draft-tokens", type=int, default=defaults.num_draft_tokens)
    parser.add_argument("--ngram-min", type=int, default=defaults.ngram_match_min)
    parser.add_argument("--ngram-max", type=int, default=defaults.ngram_match_max)
    args = parser.parse_args()

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_embedded(dtype=args.dtype)
    print(f"model {loaded.model_id} ({args.dtype}) loaded in {time.perf_counter() - t0:.1f} s")

    tokens, rate = bench_prefill(loaded, args.repeats)
    print(f"prefill: {tokens} tokens, {rate:.0f} tok/s (chunk 256, median of {args.repeats})")

    prompts = {
        "repetitive": "Repeat the following text exactly:\n\n" + PASSAGE,
        "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }
    print(
        f"{'decode (128 tokens, greedy)':30} {'plain tok/s':>12} {'ngram tok/s':>12} {'speedup':>8} "
        f"{'accepted':>9} {'rejected':>9} {'same text':>10}"
    )
    for name, prompt in prompts.items():
        plain = WorkerSettings(prefix_cache_mb=0)
        ngram = WorkerSettings(
            prefix_cache_mb=0,
            draft_mode=DraftMode.NGRAM,
            num_draft_tokens=args.num_draft_tokens,
            ngram_match_min=args.ngram_min,
            ngram_match_max=args.ngram_max,
        )
        plain_rate, _, plain_text = bench_decode(loaded, prompt, plain, args.repeats)
        draft_rate, fin, draft_text = bench_decode(loaded, prompt, ngram, args.repeats)
        print(
            f"{name:30} {plain_rate:12.1f} {draft_rate:12.1f} {draft_rate / plain_rate:7.2f}x "
            f"{fin.draft_accepted:9d} {fin.draft_rejected:9d} {plain_text == draft_text!s:>10}"
        )


if __name__ == "__main__":
    main()
