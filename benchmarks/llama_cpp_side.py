"""The llama.cpp row of ``benchmarks/cpu_engine.py``: the same measurements on the
same GGUF, through llama-cpp-python's low-level API, one at a time on request, so
that the two engines can take turns (a measurement of one, then the same of the
other) and a drift in the machine's speed lands on both.

Runs in its own virtual environment (``cpu_engine.py --llama-cpp`` creates it),
so it imports nothing of this project. Reads JSON objects, one per line, on stdin
and answers each with one JSON line on stdout:

- first ``{"gguf": PATH, "threads": N, "n_seq_max": N}``: loads the model,
  answers ``{"version": ...}``;
- ``{"prefill": [ids]}``: the whole prompt in one ``llama_decode`` (llama.cpp's
  own batching into ``n_ubatch``), answers ``{"tok_s": ...}``;
- ``{"decode": [ids], "max_tokens": N}``: greedy, one sequence; tok/s of the
  tokens after the first over their time, and ``tokens``;
- ``{"concurrency": [[ids], ...], "max_tokens": N}``: those sequences decoded
  in one batch per step; aggregate tok/s = every output token over the wall
  time from the first prefill to the last token, and each one's ``tokens``.

Greedy is the argmax of the logits, as the engine's greedy sampler;
end-of-sequence is ignored, as ``ignore_eos`` is on the other side. The process
ends at the end of its input.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from typing import Any

import llama_cpp as llama
import numpy as np


class Engine:
    """One llama.cpp context over the GGUF; every measurement starts from an empty KV cache."""

    def __init__(self, gguf: str, threads: int, n_seq_max: int) -> None:
        self._quiet = llama.llama_log_callback(lambda level, text, user_data: None)
        llama.llama_log_set(self._quiet, ctypes.c_void_p())  # llama.cpp logs every tensor it loads
        llama.llama_backend_init()
        self.model = llama.llama_model_load_from_file(gguf.encode(), llama.llama_model_default_params())
        self.vocab_size = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.model))
        params = llama.llama_context_default_params()
        params.n_ctx = 8192
        params.n_seq_max = n_seq_max
        params.n_threads = threads
        params.n_threads_batch = threads
        self.ctx = llama.llama_init_from_model(self.model, params)
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(4096, 0, n_seq_max)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants logits) items."""
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if llama.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(self, index: int) -> int:
        row = np.ctypeslib.as_array(llama.llama_get_logits_ith(self.ctx, index), shape=(self.vocab_size,))
        return int(row.argmax())

    def prefill(self, ids: list[int]) -> dict[str, Any]:
        llama.llama_memory_clear(self.memory, True)
        t0 = time.perf_counter()
        self.decode([(t, p, 0, p == len(ids) - 1) for p, t in enumerate(ids)])
        self.argmax(len(ids) - 1)
        return {"tok_s": len(ids) / (time.perf_counter() - t0)}

    def greedy(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        llama.llama_memory_clear(self.memory, True)
        self.decode([(t, pos, 0, pos == len(ids) - 1) for pos, t in enumerate(ids)])
        tokens = [self.argmax(len(ids) - 1)]
        t0 = time.perf_counter()
        for step in range(1, max_tokens):
            self.decode([(tokens[-1], len(ids) + step - 1, 0, True)])
            tokens.append(self.argmax(0))
        return {"tok_s": (max_tokens - 1) / (time.perf_counter() - t0), "tokens": tokens}

    def concurrency(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        llama.llama_memory_clear(self.memory, True)
        t0 = time.perf_counter()
        out: list[list[int]] = []
        for s, p in enumerate(prompts):  # prefill one by one (the engine also feeds prompts in chunks)
            self.decode([(t, pos, s, pos == len(p) - 1) for pos, t in enumerate(p)])
            out.append([self.argmax(len(p) - 1)])
        for step in range(1, max_tokens):
            self.decode([(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(self.argmax(s))
        wall = time.perf_counter() - t0
        return {"tok_s": len(prompts) * max_tokens / wall, "tokens": out}


def main() -> None:
    first = json.loads(sys.stdin.readline())
    engine = Engine(first["gguf"], int(first["threads"]), int(first["n_seq_max"]))
    print(json.dumps({"version": llama.__version__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if "prefill" in job:
            answer = engine.prefill(job["prefill"])
        elif "decode" in job:
            answer = engine.greedy(job["decode"], int(job["max_tokens"]))
        else:
            answer = engine.concurrency(job["concurrency"], int(job["max_tokens"]))
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
