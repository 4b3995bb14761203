"""Prefill, decode and batched-decode speed of the CPU engine on the embedded
SmolLM2-135M-Instruct, side by side with llama.cpp on the same GGUF and threads.

Sections (each a median of ``--repeats``; the prefix cache is off throughout):

- prefill: tok/s for a 1,012-token prompt (``Finished.time_prefill``);
- decode: greedy tok/s for 128 tokens (the tokens after the first over
  ``Finished.time_decode``), without and with n-gram drafting, on a repetitive
  prompt (text the model copies, where drafts hit) and an open-ended one, and
  whether drafting left the text unchanged;
- concurrency: 1, 2, 4 and 8 requests at once (8 different open-ended prompts,
  cycled), greedy, 128 tokens each; aggregate tok/s = every output token over
  the wall time from the first step to the last token (prefill included), its
  ratio to 1 request, and whether every request's text equals its text alone.

``--llama-cpp`` adds llama.cpp's row: ``benchmarks/llama_cpp_side.py`` in a
virtual environment of its own (``.cache/bench/llama-venv``, created on first
use with ``llama-cpp-python==0.3.36``, a C++ build of about 7 minutes on 2
cores, ``LLAMA_CMAKE_ARGS``), fed the same token ids. A llama.cpp run that fails
leaves its row out and says why; this engine's rows are still printed.

Usage: python benchmarks/cpu_engine.py [--quantization int4,int8,none] [--dtype float32|bfloat16]
       [--threads N] [--repeats N] [--llama-cpp]

``--quantization`` takes a list: one row per configuration, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import venv
from dataclasses import dataclass
from pathlib import Path

from engine_worker.admission import checked_prepare
from engine_worker.cpu import CpuBackend
from engine_worker.cpu.model_store import LoadedModel, find_embedded_gguf, load_embedded
from engine_worker.settings import DraftMode, WorkerSettings
from protocol.messages import ChatMessage, Finished, SamplingParams, Submit, TokenDelta

ROOT = Path(__file__).resolve().parent.parent
LLAMA_VENV = ROOT / ".cache" / "bench" / "llama-venv"
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
    "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
)
"""How llama.cpp is built unless ``CMAKE_ARGS`` says otherwise: AVX-512 with VNNI
and BF16 (what a native build gives an AVX-512 EPYC), without AMX. A native build
on a Xeon with AMX repacks the Q4_1 weights for AMX, and in this project's
benchmark VM (2026-12-01) the first ``llama_decode`` then dies with SIGSEGV (the
kernel logs a general protection fault in ``libggml-cpu.so``). ``GGML_NATIVE``
must be off for the AMX options to apply."""
MAX_TOKENS = 128
CONCURRENCY = (1, 2, 4, 8)

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
STORIES = (
    "a lighthouse keeper who finds a message in a bottle",
    "a baker who wakes up speaking only in rhymes",
    "two rival chess clubs stranded in a snowstorm",
    "a robot learning to tend a vegetable garden",
    "a train that arrives one day early",
    "a beekeeper and a stubborn queen bee",
    "a cartographer mapping a city that keeps moving",
    "a jazz trumpet found in an attic",
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


def story(i: int) -> str:
    return f"Write a short story about {STORIES[i % len(STORIES)]}."


def run(backend: CpuBackend, submit: Submit) -> tuple[str, Finished]:
    """Admit one request and step until it finishes; its text and ``Finished``."""
    texts, finished = run_many(backend, [submit])
    return texts[0], finished[0]


def run_many(backend: CpuBackend, submits: list[Submit]) -> tuple[list[str], list[Finished]]:
    """Admit ``submits`` together and step until all finish."""
    for submit in submits:
        backend.start(submit.request_id, checked_prepare(backend, submit), submit.params)
    text: dict[str, list[str]] = {s.request_id: [] for s in submits}
    finished: dict[str, Finished] = {}
    while backend.active_ids():
        for event in backend.step():
            if isinstance(event, TokenDelta):
                text[event.request_id].append(event.text)
            elif isinstance(event, Finished):
                finished[event.request_id] = event
    assert len(finished) == len(submits), "a request did not finish"
    return ["".join(text[s.request_id]) for s in submits], [finished[s.request_id] for s in submits]


def chat(request_id: str, prompt: str) -> Submit:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return Submit(request_id, params, messages=(ChatMessage("user", prompt),))


def bench_prefill(backend: CpuBackend, repeats: int) -> tuple[int, float]:
    rates, tokens = [], 0
    for i in range(repeats):
        params = SamplingParams(max_tokens=1, temperature=0.0)
        _, fin = run(backend, Submit(f"p{i}", params, prompt=long_prompt()))
        tokens = fin.prompt_tokens
        rates.append(fin.prompt_tokens / fin.time_prefill)
    return tokens, statistics.median(rates)


def bench_decode(backend: CpuBackend, prompt: str, repeats: int) -> tuple[float, Finished, str]:
    rates: list[float] = []
    text, fin = "", None
    for i in range(repeats):
        text, fin = run(backend, chat(f"d{i}", prompt))
        rates.append((fin.completion_tokens - 1) / fin.time_decode)
    assert fin is not None
    return statistics.median(rates), fin, text


def bench_concurrency(backend: CpuBackend, n: int, repeats: int, alone: list[str]) -> tuple[float, bool]:
    """Aggregate tok/s of ``n`` requests at once, and whether each text equals its text alone."""
    rates, same = [], True
    for r in range(repeats):
        submits = [chat(f"c{r}-{i}", story(i)) for i in range(n)]
        t0 = time.perf_counter()
        texts, finished = run_many(backend, submits)
        rates.append(sum(f.completion_tokens for f in finished) / (time.perf_counter() - t0))
        same = same and texts == [alone[i % len(alone)] for i in range(n)]
    return statistics.median(rates), same


def llama_cpp(job: dict[str, object]) -> dict[str, object]:
    """Run ``llama_cpp_side.py`` in its own environment (created on first use)."""
    python = LLAMA_VENV / "bin" / "python"
    if (
        not python.exists()
        or subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode
    ):
        print(f"creating {LLAMA_VENV} with {LLAMA_CPP_PYTHON} (a C++ build, ~7 min on 2 cores)", flush=True)
        venv.create(LLAMA_VENV, with_pip=True)
        subprocess.run(
            [python, "-m", "pip", "install", "-q", "--no-cache-dir", LLAMA_CPP_PYTHON, "numpy"],
            check=True,
            env={**os.environ, "CMAKE_ARGS": os.environ.get("CMAKE_ARGS", LLAMA_CMAKE_ARGS)},
        )
    out = subprocess.run(
        [python, str(Path(__file__).with_name("llama_cpp_side.py"))],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "LLAMA_LOG_LEVEL": "error"},
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


@dataclass
class Row:
    """One engine configuration's numbers."""

    name: str
    prefill: float
    decode: dict[str, tuple[float, float, Finished, bool]]  # prompt -> plain, drafted, Finished, same text
    concurrency: dict[int, tuple[float, bool]]  # requests at once -> aggregate tok/s, same text as alone


PROMPTS = {"repetitive": "Repeat the following text exactly:\n\n" + PASSAGE, "open-ended": story(0)}


def measure(loaded: LoadedModel, quantization: str, args: argparse.Namespace) -> tuple[Row, CpuBackend, int]:
    common = {
        "prefix_cache_mb": 0,
        "quantization": quantization,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    t0 = time.perf_counter()
    plain = CpuBackend.from_loaded(loaded, WorkerSettings(**common))  # type: ignore[arg-type]
    ngram = CpuBackend.from_loaded(
        loaded,
        WorkerSettings(**common, draft_mode=DraftMode.NGRAM, num_draft_tokens=args.num_draft_tokens),  # type: ignore[arg-type]
    )
    print(
        f"{quantization}: {plain.runner.weight_bytes() / 2**20:.0f} MiB of weights read per decode step, "
        f"backend ready in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    tokens, prefill = bench_prefill(plain, args.repeats)
    decode: dict[str, tuple[float, float, Finished, bool]] = {}
    for name, prompt in PROMPTS.items():
        plain_rate, _, plain_text = bench_decode(plain, prompt, args.repeats)
        draft_rate, fin, draft_text = bench_decode(ngram, prompt, args.repeats)
        decode[name] = (plain_rate, draft_rate, fin, plain_text == draft_text)
    alone = [run(plain, chat(f"a{i}", story(i)))[0] for i in range(max(CONCURRENCY))]
    concurrency = {n: bench_concurrency(plain, n, args.repeats, alone) for n in CONCURRENCY}
    name = "int4 (default)" if quantization == "int4" else quantization
    if quantization == "none":
        name = args.dtype
    return Row(name, prefill, decode, concurrency), plain, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quantization", default="int4", help="comma-separated: int4, int8, none (one row each)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="with none")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both engines")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's row (own venv)")
    defaults = WorkerSettings()
    parser.add_argument("--num-draft-tokens", type=int, default=defaults.num_draft_tokens)
    args = parser.parse_args()
    quantizations = args.quantization.split(",")
    if any(q not in ("int4", "int8", "none") for q in quantizations):
        parser.error(f"--quantization: int4, int8 or none, got {args.quantization}")

    import torch

    torch.set_num_threads(args.threads)
    loaded: LoadedModel = load_embedded(dtype=args.dtype if quantizations == ["none"] else "float32")
    print(f"model {loaded.model_id}, {args.threads} threads, median of {args.repeats}")
    rows: list[Row] = []
    backend: CpuBackend | None = None
    tokens = 0
    for quantization in quantizations:
        row, backend, tokens = measure(loaded, quantization, args)
        rows.append(row)
    assert backend is not None

    theirs: dict[str, object] | None = None
    if args.llama_cpp:
        # the token ids this engine feeds (chat template applied)
        chat_ids = [
            list(backend.prepare(chat("ids", p)).prompt.ids)
            for p in [PROMPTS["repetitive"], PROMPTS["open-ended"], *(story(i) for i in range(8))]
        ]
        job = {"gguf": str(find_embedded_gguf()), "threads": args.threads, "max_tokens": MAX_TOKENS}
        prefill_ids = list(loaded.tokenizer(long_prompt())["input_ids"])
        try:
            theirs = llama_cpp(
                {
                    **job,
                    "prefill_ids": prefill_ids,
                    "decode_ids": chat_ids[:2],
                    "concurrency": [],
                    "repeats": args.repeats,
                }
            )
            concurrency = llama_cpp(
                {
                    **job,
                    "prefill_ids": chat_ids[2],
                    "decode_ids": chat_ids[2:],
                    "concurrency": list(CONCURRENCY),
                    "repeats": args.repeats,
                }
            )
            theirs["concurrency"] = concurrency["concurrency"]
        except subprocess.CalledProcessError as e:
            print(f"llama.cpp's row left out: {e}\n{(e.stderr or '')[-2000:]}", flush=True)
            theirs = None

    print()
    print(
        f"| | prefill, {tokens} tokens | decode, greedy, {MAX_TOKENS} tokens (repetitive / open-ended) "
        "| with n-gram drafts (repetitive / open-ended) | "
        + " | ".join(f"{n} at once" for n in CONCURRENCY)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(CONCURRENCY))
    for row in rows:
        rep, opn = row.decode["repetitive"], row.decode["open-ended"]
        base = row.concurrency[1][0]
        print(
            f"| this engine, {row.name} | {row.prefill:.0f} tok/s | {rep[0]:.1f} / {opn[0]:.1f} tok/s "
            f"| {rep[1]:.1f} / {opn[1]:.1f} tok/s ({rep[2].draft_accepted}/{rep[2].draft_rejected} and "
            f"{opn[2].draft_accepted}/{opn[2].draft_rejected} accepted/rejected) | "
            + " | ".join(
                f"{row.concurrency[n][0]:.0f} tok/s ({row.concurrency[n][0] / base:.2f}x)"
                for n in CONCURRENCY
            )
            + " |"
        )
    if theirs is not None:
        their_decode = theirs["decode_tok_s"]
        their_c = theirs["concurrency"]
        their_prefill = theirs["prefill_tok_s"]
        assert (
            isinstance(their_decode, list) and isinstance(their_c, dict) and isinstance(their_prefill, float)
        )
        their_base = float(their_c["1"])
        print(
            f"| llama.cpp (llama-cpp-python {theirs['version']}) | {their_prefill:.0f} tok/s "
            f"| {their_decode[0]:.1f} / {their_decode[1]:.1f} tok/s | — | "
            + " | ".join(
                f"{float(their_c[str(n)]):.0f} tok/s ({float(their_c[str(n)]) / their_base:.2f}x)"
                for n in CONCURRENCY
            )
            + " |"
        )
        print()
        for row in rows:
            rep, opn = row.decode["repetitive"], row.decode["open-ended"]
            print(
                f"{row.name} / llama.cpp: prefill {row.prefill / their_prefill:.2f}x, "
                f"decode {rep[0] / their_decode[0]:.2f}x / {opn[0] / their_decode[1]:.2f}x, "
                f"8 at once {row.concurrency[8][0] / float(their_c['8']):.2f}x"
            )
    print()
    for row in rows:
        rep, opn = row.decode["repetitive"], row.decode["open-ended"]
        print(
            f"{row.name}: same greedy text with and without drafting: repetitive {rep[3]}, "
            f"open-ended {opn[3]}; batched as alone: "
            + ", ".join(f"{n} at once {row.concurrency[n][1]}" for n in CONCURRENCY)
        )


if __name__ == "__main__":
    main()
