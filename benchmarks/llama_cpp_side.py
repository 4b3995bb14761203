"""The llama.cpp row of ``benchmarks/cpu_engine.py``: the same measurements on the
same GGUF, through llama-cpp-python's low-level API.

Runs in its own virtual environment (``cpu_engine.py --llama-cpp`` creates it),
so it imports nothing of this project. Reads one JSON object on stdin:

    {"gguf": PATH, "threads": N, "prefill_ids": [...], "decode_ids": [[...], ...],
     "max_tokens": N, "concurrency": [1, 2, 4, 8], "repeats": N}

and prints one JSON object: ``prefill_tok_s`` (the whole prompt in one
``llama_decode``, llama.cpp's own batching into ``n_ubatch``), ``decode_tok_s``
per prompt of ``decode_ids`` (greedy, one sequence, tokens after the first
over their time), and ``concurrency`` (level -> aggregate tok/s: that many
sequences, each its own ``decode_ids`` prompt cycled, decoded in one batch per
step, every output token over the wall time from the first prefill to the
last token). Greedy is the argmax of the logits, as the engine's greedy
sampler; end-of-sequence is ignored, as ``ignore_eos`` is on the other side.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from typing import Any

import llama_cpp as llama
import numpy as np


def main() -> None:
    job = json.load(sys.stdin)
    threads = int(job["threads"])
    max_tokens = int(job["max_tokens"])
    levels = [int(n) for n in job["concurrency"]]
    prompts: list[list[int]] = job["decode_ids"]
    quiet = llama.llama_log_callback(lambda level, text, user_data: None)
    llama.llama_log_set(quiet, ctypes.c_void_p())  # llama.cpp logs every tensor it loads
    llama.llama_backend_init()
    model = llama.llama_model_load_from_file(job["gguf"].encode(), llama.llama_model_default_params())
    vocab_size = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    params = llama.llama_context_default_params()
    params.n_ctx = 8192
    params.n_seq_max = max(levels, default=1)
    params.n_threads = threads
    params.n_threads_batch = threads
    ctx = llama.llama_init_from_model(model, params)
    memory = llama.llama_get_memory(ctx)
    batch = llama.llama_batch_init(max(2048, len(job["prefill_ids"])), 0, params.n_seq_max)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if llama.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(index: int) -> int:
        row = np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, index), shape=(vocab_size,))
        return int(row.argmax())

    def clear() -> None:
        llama.llama_memory_clear(memory, True)

    result: dict[str, Any] = {"version": llama.__version__}
    ids = job["prefill_ids"]
    rates = []
    for _ in range(job["repeats"]):
        clear()
        t0 = time.perf_counter()
        decode([(t, p, 0, p == len(ids) - 1) for p, t in enumerate(ids)])
        argmax(len(ids) - 1)
        rates.append(len(ids) / (time.perf_counter() - t0))
    result["prefill_tok_s"] = statistics.median(rates)

    def run(n: int) -> tuple[float, list[list[int]]]:
        """``n`` sequences at once; aggregate tok/s and each one's tokens."""
        clear()
        seqs = [prompts[i % len(prompts)] for i in range(n)]
        t0 = time.perf_counter()
        out: list[list[int]] = []
        for s, p in enumerate(seqs):  # prefill one by one (the engine also feeds prompts in chunks)
            decode([(t, pos, s, pos == len(p) - 1) for pos, t in enumerate(p)])
            out.append([argmax(len(p) - 1)])
        for step in range(1, max_tokens):
            decode([(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(seqs)])
            for s in range(n):
                out[s].append(argmax(s))
        t_end = time.perf_counter()
        return n * max_tokens / (t_end - t0), out

    decode_rates = []
    for p in prompts:
        rs = []
        for _ in range(job["repeats"]):
            clear()
            decode([(t, pos, 0, pos == len(p) - 1) for pos, t in enumerate(p)])
            token = argmax(len(p) - 1)
            t0 = time.perf_counter()
            for step in range(1, max_tokens):
                decode([(token, len(p) + step - 1, 0, True)])
                token = argmax(0)
            rs.append((max_tokens - 1) / (time.perf_counter() - t0))
        decode_rates.append(statistics.median(rs))
    result["decode_tok_s"] = decode_rates
    result["concurrency"] = {
        str(n): statistics.median(run(n)[0] for _ in range(job["repeats"])) for n in levels
    }
    llama.llama_batch_free(batch)
    llama.llama_free(ctx)
    llama.llama_model_free(model)
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
