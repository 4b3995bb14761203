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
virtual environment of its own (``.cache/bench/llama-venv-<build>``, created on
first use with ``llama-cpp-python==0.3.36``, a C++ build of about 7 minutes on 2
cores, ``llama_cmake_args``: the ISA extensions this CPU has), fed the same token
ids. It stays running and the two engines take turns: each round of a measurement runs it on this engine, then
on llama.cpp, so a change in the machine's speed (this project's benchmark VM
moves 10-20% within minutes, with its neighbours) falls on both sides of a ratio
rather than on one. With several ``--quantization`` rows, llama.cpp takes its
turns beside the first. A llama.cpp process that fails leaves its row out and
says why; this engine's rows are still printed.

How long, measuring (the model's load and llama.cpp's first build aside), on 2
cores of an AMD EPYC (Zen 4), 2026-12-04: about 50 s for the int4 row at
``--repeats 3``, 95 s with ``--llama-cpp``; 393 s for ``--quantization
int4,int8,none --llama-cpp`` (the float32 row alone about 200 s). On the Intel
Xeon with AMX 375 s for the three rows with ``--llama-cpp`` (2026-12-05).
``--budget-s`` bounds the measuring (default ``budget_s``: 3 minutes a row at
``--repeats 3``, scaled by the repeats, twice with ``--llama-cpp``): an engine step
or a llama.cpp answer that comes past it stops the run, which says where it was
and prints no table. The time taken is printed at the end.

Usage: python benchmarks/cpu_engine.py [--quantization int4,int8,none] [--dtype float32|bfloat16]
       [--threads N] [--repeats N] [--llama-cpp] [--budget-s S]

``--quantization`` takes a list: one row per configuration, in one run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import statistics
import subprocess
import tempfile
import time
import venv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from engine_worker.admission import checked_prepare
from engine_worker.cpu import CpuBackend
from engine_worker.cpu.model_store import LoadedModel, find_embedded_gguf, load_embedded
from engine_worker.settings import DraftMode, WorkerSettings
from protocol.messages import ChatMessage, Finished, SamplingParams, Submit, TokenDelta

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_ISA = {
    "AVX": "avx",
    "AVX2": "avx2",
    "FMA": "fma",
    "F16C": "f16c",
    "BMI2": "bmi2",
    "AVX_VNNI": "avx_vnni",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
}
"""llama.cpp's ``GGML_*`` build options for x86 and the ``/proc/cpuinfo`` flag each needs."""


def llama_cmake_args() -> str:
    """How llama.cpp is built unless ``CMAKE_ARGS`` says otherwise: each ``LLAMA_ISA``
    extension this CPU has, AMX off. Not ``GGML_NATIVE``: a native build on a Xeon
    with AMX repacks the Q4_1 weights for AMX, and in this project's benchmark VM
    (2026-12-01) the first ``llama_decode`` then died with SIGSEGV (a general
    protection fault in ``libggml-cpu.so``); ``GGML_NATIVE`` must be off for the AMX
    options to apply. Not a fixed list either: the one this replaced turned on
    AVX-VNNI (the VEX encoding), which an AMD EPYC (Zen 4) lacks, and llama.cpp
    died there with SIGILL on its first product."""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    isa = " ".join(f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for name, flag in LLAMA_ISA.items())
    return f"-DGGML_NATIVE=OFF {isa} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"


def llama_venv(cmake_args: str) -> Path:
    """The virtual environment of llama.cpp built with ``cmake_args`` (one per build:
    a checkout moved to another CPU builds again rather than running the wrong ISA)."""
    digest = hashlib.sha256(f"{LLAMA_CPP_PYTHON}\0{cmake_args}".encode()).hexdigest()[:10]
    return ROOT / ".cache" / "bench" / f"llama-venv-{digest}"


MAX_TOKENS = 128
ROW_BUDGET_S = 180.0
"""``--budget-s``' default per ``--quantization`` row at ``--repeats 3`` (``budget_s``)."""


class OverBudget(Exception):
    """The run went past ``--budget-s``; where it was."""


DEADLINE = float("inf")
"""``time.perf_counter()`` past which the run stops (``main`` sets it)."""


def budget_s(rows: int, repeats: int, llama_cpp: bool) -> float:
    """The default ``--budget-s``: ``ROW_BUDGET_S`` per row, scaled by ``repeats / 3``,
    twice that with llama.cpp's turns."""
    return ROW_BUDGET_S * rows * max(repeats, 1) / 3 * (2 if llama_cpp else 1)


def check_budget(where: str) -> None:
    """Raise ``OverBudget`` once the run is past ``DEADLINE``."""
    if time.perf_counter() > DEADLINE:
        raise OverBudget(where)


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
        check_budget(f"this engine, request {submits[0].request_id}")
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


def prefill_once(backend: CpuBackend, i: int) -> tuple[int, float]:
    """The long prompt's token count and prefill tok/s."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    _, fin = run(backend, Submit(f"p{i}", params, prompt=long_prompt()))
    return fin.prompt_tokens, fin.prompt_tokens / fin.time_prefill


def decode_once(backend: CpuBackend, prompt: str, i: int) -> tuple[float, Finished, str]:
    """Greedy decode tok/s (the tokens after the first), ``Finished`` and text."""
    text, fin = run(backend, chat(f"d{i}", prompt))
    return (fin.completion_tokens - 1) / fin.time_decode, fin, text


def concurrency_once(backend: CpuBackend, n: int, r: int, alone: list[str]) -> tuple[float, bool]:
    """Aggregate tok/s of ``n`` requests at once, and whether each text equals its text alone."""
    submits = [chat(f"c{r}-{i}", story(i)) for i in range(n)]
    t0 = time.perf_counter()
    texts, finished = run_many(backend, submits)
    rate = sum(f.completion_tokens for f in finished) / (time.perf_counter() - t0)
    return rate, texts == [alone[i % len(alone)] for i in range(n)]


class LlamaCppFailed(Exception):
    """The llama.cpp process died or answered nothing; its stderr's tail."""


class LlamaCpp:
    """``llama_cpp_side.py`` in its own environment (created on first use), kept
    running so that its measurements can alternate with this engine's."""

    def __init__(self, gguf: Path, threads: int, n_seq_max: int) -> None:
        cmake_args = os.environ.get("CMAKE_ARGS", llama_cmake_args())
        env_dir = llama_venv(cmake_args)
        python = env_dir / "bin" / "python"
        if (
            not python.exists()
            or subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode
        ):
            print(f"creating {env_dir} with {LLAMA_CPP_PYTHON} (a C++ build, ~7 min)", flush=True)
            venv.create(env_dir, with_pip=True)
            subprocess.run(
                [python, "-m", "pip", "install", "-q", "--no-cache-dir", LLAMA_CPP_PYTHON, "numpy"],
                check=True,
                env={**os.environ, "CMAKE_ARGS": cmake_args},
            )
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115 (lives as long as the process: close())
        self._process = subprocess.Popen(
            [python, str(Path(__file__).with_name("llama_cpp_side.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "LLAMA_LOG_LEVEL": "error"},
        )
        loaded = self.ask({"gguf": str(gguf), "threads": threads, "n_seq_max": n_seq_max})
        self.version = str(loaded["version"])

    def ask(self, job: dict[str, object]) -> dict[str, object]:
        """One measurement (``llama_cpp_side.py`` lists them). Raises ``LlamaCppFailed``."""
        assert self._process.stdin is not None and self._process.stdout is not None
        try:
            self._process.stdin.write(json.dumps(job) + "\n")
            self._process.stdin.flush()
            wait = max(DEADLINE - time.perf_counter(), 0.0) if float("inf") != DEADLINE else None
            if not select.select([self._process.stdout], [], [], wait)[0]:
                self._process.kill()
                raise OverBudget(f"llama.cpp, {next(iter(job))}")
            line = self._process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._process.wait()
            self._stderr.seek(0)
            raise LlamaCppFailed(f"exit status {self._process.returncode}\n{self._stderr.read()[-2000:]}")
        answer: dict[str, object] = json.loads(line)
        return answer

    def rate(self, job: dict[str, object]) -> float:
        return float(self.ask(job)["tok_s"])  # type: ignore[arg-type]

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait()
        self._stderr.close()


@dataclass
class Row:
    """One engine configuration's numbers."""

    name: str
    prefill: float
    decode: dict[str, tuple[float, float, Finished, bool]]  # prompt -> plain, drafted, Finished, same text
    concurrency: dict[int, tuple[float, bool]]  # requests at once -> aggregate tok/s, same text as alone


@dataclass
class TheirRow:
    """llama.cpp's numbers, each measured in turn with this engine's."""

    version: str
    prefill: float = 0.0
    decode: dict[str, float] = field(default_factory=dict)  # prompt -> tok/s
    concurrency: dict[int, float] = field(default_factory=dict)  # sequences at once -> aggregate tok/s


PROMPTS = {"repetitive": "Repeat the following text exactly:\n\n" + PASSAGE, "open-ended": story(0)}


def measure(
    loaded: LoadedModel, quantization: str, args: argparse.Namespace, theirs: LlamaCpp | None
) -> tuple[Row, int, TheirRow | None]:
    """This engine's row for ``quantization``; with ``theirs``, llama.cpp's row too,
    each of its measurements taken right after the same one of this engine's
    (a round per repeat), on the token ids this engine feeds (chat template
    applied). A llama.cpp failure leaves its row out (``None``) and says why."""
    common = {
        "prefix_cache_mb": 0,
        "quantization": quantization,
        "dtype": args.dtype,
        "threads": args.threads,
    }
    t0 = time.perf_counter()
    plain = CpuBackend.from_loaded(loaded, WorkerSettings(**common))
    ngram = CpuBackend.from_loaded(
        loaded,
        WorkerSettings(**common, draft_mode=DraftMode.NGRAM, num_draft_tokens=args.num_draft_tokens),
    )
    print(
        f"{quantization}: {plain.runner.weight_bytes() / 2**20:.0f} MiB of weights read per decode step, "
        f"backend ready in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    print(f"{quantization}: {plain.kernel_choice.line()}", flush=True)
    ids = {name: list(plain.prepare(chat("ids", p)).prompt.ids) for name, p in PROMPTS.items()}
    story_ids = [list(plain.prepare(chat("ids", story(i))).prompt.ids) for i in range(max(CONCURRENCY))]
    row_theirs = None if theirs is None else TheirRow(theirs.version)

    def their_rate(job: dict[str, object]) -> float | None:
        nonlocal row_theirs
        if theirs is None or row_theirs is None:
            return None
        try:
            return theirs.rate(job)
        except LlamaCppFailed as e:
            print(f"llama.cpp's row left out: {e}", flush=True)
            row_theirs = None
            return None

    def rounds(ours: Callable[[int], T], job: dict[str, object]) -> tuple[list[T], list[float]]:
        mine, others = [], []
        for i in range(args.repeats):
            mine.append(ours(i))
            rate = their_rate(job)
            if rate is not None:
                others.append(rate)
        return mine, others

    long_ids = ids_of_long_prompt(loaded)
    prefills, their_prefills = rounds(lambda i: prefill_once(plain, i), {"prefill": long_ids})
    tokens = prefills[0][0]
    prefill = statistics.median(rate for _, rate in prefills)
    decode: dict[str, tuple[float, float, Finished, bool]] = {}
    their_decode: dict[str, float] = {}
    for name, prompt in PROMPTS.items():
        plains, theirs_decode = rounds(
            lambda i, prompt=prompt: decode_once(plain, prompt, i),  # type: ignore[misc]
            {"decode": ids[name], "max_tokens": MAX_TOKENS},
        )
        drafts = [decode_once(ngram, prompt, i) for i in range(args.repeats)]
        decode[name] = (
            statistics.median(r for r, _, _ in plains),
            statistics.median(r for r, _, _ in drafts),
            drafts[-1][1],
            plains[-1][2] == drafts[-1][2],
        )
        if theirs_decode:
            their_decode[name] = statistics.median(theirs_decode)
    alone = [run(plain, chat(f"a{i}", story(i)))[0] for i in range(max(CONCURRENCY))]
    concurrency: dict[int, tuple[float, bool]] = {}
    their_concurrency: dict[int, float] = {}
    for n in CONCURRENCY:
        results, theirs_c = rounds(
            lambda r, n=n: concurrency_once(plain, n, r, alone),  # type: ignore[misc]
            {"concurrency": [story_ids[i % len(story_ids)] for i in range(n)], "max_tokens": MAX_TOKENS},
        )
        concurrency[n] = (statistics.median(r for r, _ in results), all(same for _, same in results))
        if theirs_c:
            their_concurrency[n] = statistics.median(theirs_c)
    name = "int4 (default)" if quantization == "int4" else quantization
    if quantization == "none":
        name = args.dtype
    if row_theirs is not None:
        row_theirs.prefill = statistics.median(their_prefills)
        row_theirs.decode = their_decode
        row_theirs.concurrency = their_concurrency
    return Row(name, prefill, decode, concurrency), tokens, row_theirs


def ids_of_long_prompt(loaded: LoadedModel) -> list[int]:
    ids: list[int] = list(loaded.tokenizer(long_prompt())["input_ids"])
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quantization", default="int4", help="comma-separated: int4, int8, none (one row each)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="with none")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both engines")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per measurement (median)")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's row (own venv)")
    defaults = WorkerSettings()
    parser.add_argument("--num-draft-tokens", type=int, default=defaults.num_draft_tokens)
    parser.add_argument("--budget-s", type=float, default=None, help="stop past this (default: budget_s)")
    args = parser.parse_args()
    quantizations = args.quantization.split(",")
    if any(q not in ("int4", "int8", "none") for q in quantizations):
        parser.error(f"--quantization: int4, int8 or none, got {args.quantization}")

    import torch

    global DEADLINE
    torch.set_num_threads(args.threads)
    loaded: LoadedModel = load_embedded(dtype=args.dtype if quantizations == ["none"] else "float32")
    budget = args.budget_s or budget_s(len(quantizations), args.repeats, args.llama_cpp)
    print(f"model {loaded.model_id}, {args.threads} threads, median of {args.repeats}, budget {budget:.0f} s")
    llama_cpp: LlamaCpp | None = None
    if args.llama_cpp:
        try:
            llama_cpp = LlamaCpp(find_embedded_gguf(), args.threads, max(CONCURRENCY))
        except (LlamaCppFailed, subprocess.CalledProcessError) as e:
            print(f"llama.cpp's row left out: {e}", flush=True)
    rows: list[Row] = []
    theirs: TheirRow | None = None
    tokens = 0
    started = time.perf_counter()  # llama.cpp's build and load are not measuring
    DEADLINE = started + budget
    try:
        for k, quantization in enumerate(quantizations):
            # llama.cpp takes its turns beside the first configuration only
            row, tokens, measured = measure(loaded, quantization, args, llama_cpp if k == 0 else None)
            rows.append(row)
            theirs = measured if k == 0 else theirs
    except OverBudget as e:
        raise SystemExit(
            f"stopped: past the budget of {budget:.0f} s ({e}; rows done: "
            f"{', '.join(r.name for r in rows) or 'none'}). A machine this slow is a finding: "
            "see docs/performance.md for the figures to expect"
        ) from None
    if llama_cpp is not None:
        llama_cpp.close()

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
        their_c, their_base = theirs.concurrency, theirs.concurrency[1]
        print(
            f"| llama.cpp (llama-cpp-python {theirs.version}) | {theirs.prefill:.0f} tok/s "
            f"| {theirs.decode['repetitive']:.1f} / {theirs.decode['open-ended']:.1f} tok/s | — | "
            + " | ".join(f"{their_c[n]:.0f} tok/s ({their_c[n] / their_base:.2f}x)" for n in CONCURRENCY)
            + " |"
        )
        print()
        for k, row in enumerate(rows):
            rep, opn = row.decode["repetitive"], row.decode["open-ended"]
            turns = "in turns" if k == 0 else "llama.cpp measured beside the first row"
            print(
                f"{row.name} / llama.cpp ({turns}): prefill {row.prefill / theirs.prefill:.2f}x, "
                f"decode {rep[0] / theirs.decode['repetitive']:.2f}x / "
                f"{opn[0] / theirs.decode['open-ended']:.2f}x, "
                f"8 at once {row.concurrency[8][0] / their_c[8]:.2f}x"
            )
    print()
    for row in rows:
        rep, opn = row.decode["repetitive"], row.decode["open-ended"]
        print(
            f"{row.name}: same greedy text with and without drafting: repetitive {rep[3]}, "
            f"open-ended {opn[3]}; batched as alone: "
            + ", ".join(f"{n} at once {row.concurrency[n][1]}" for n in CONCURRENCY)
        )
    print(f"\nmeasured in {time.perf_counter() - started:.0f} s (budget {budget:.0f} s)")


if __name__ == "__main__":
    main()
