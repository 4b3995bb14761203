#!/usr/bin/env python3
"""GPU smoke test of the ExLlamaV3 backend, end to end, offline, in under 8 minutes.

Needs a CUDA machine with ``exllamav3==1.6.5``, ``torch`` (CUDA build),
``transformers`` and ``tokenizers`` installed, and this repository's dependencies
(``pip install -e '.[exllamav3]'``). No network access is used.

Steps, each with its own timeout inside one overall budget (``--budget``, 480 s):

1. ``import exllamav3`` in a child process (the py3-none-any wheel compiles its
   CUDA extension on first import; a warm ``~/.cache/torch_extensions`` makes it
   seconds).
2. Build a tiny random-weight Llama in the Hugging Face format: 2 layers, hidden
   512, 4 query / 2 KV heads of 128, vocabulary 512, with a byte-level BPE
   tokenizer and a ChatML chat template made in code with ``tokenizers``. The
   output head is a scaled copy of the embedding table, so the model tends to
   repeat its input: n-gram drafting then has something to accept.
3. Convert it to EXL3 with ExLlamaV3's own converter
   (``python -m exllamav3.conversion.convert_model -i -o -w -b``, see
   ``exllamav3/conversion/convert_model.py``), with a small calibration set.
4. Start ``exl3-sidecar worker --backend exllamav3 --draft-mode ngram`` and
   ``exl3-sidecar proxy`` as two processes on private ipc sockets, wait for
   ``/ready``.
5. Send one streamed chat request with ``return_progress`` and
   ``stream_options.include_usage``, then the same prompt again, and print:
   progress chunk count, ``cached_tokens`` of the repeated prompt, accepted and
   rejected draft tokens, time to first token and decode tokens/s.

Exit status 0 when every check passed, 1 otherwise; the last line printed is a
JSON summary. Logs of the converter, worker and proxy stay in ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512  # model rows; the tokenizer uses 256 bytes + 3 specials
EMBED_SCALE = 50.0  # embedding std 0.02 -> 1.0
CHUNK = 256  # prefill chunk size, tokens: a ~1500-token prompt gives several progress chunks
PROMPT = "Summarise the following notes. " + " ".join(
    f"Note {i}: the sidecar streams prefill progress and reports cache reuse." for i in range(22)
)


class Budget:
    """Seconds left of the overall budget; ``step(limit)`` is the timeout of one phase."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def step(self, limit_s: float) -> float:
        left = self.left()
        if left <= 1:
            raise TimeoutError("the smoke test ran out of its time budget")
        return min(limit_s, left)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_child(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None) -> float:
    """Run ``cmd`` to completion with its output in ``log_path``; returns seconds taken.
    Raises ``RuntimeError`` with the log's tail on failure or timeout."""
    t0 = time.monotonic()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        what = "timed out" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"{cmd[:4]} {what} after {time.monotonic() - t0:.0f} s:\n{tail}")
    return time.monotonic() - t0


def check_converted(exl3_dir: Path, log_path: Path) -> None:
    """Raise ``RuntimeError`` with the converter log's tail unless ``exl3_dir/config.json``
    exists: ``convert_model.py`` (1.6.5, lines 1791-1797) prints ``" !! Error: ..."`` for a
    bad argument and still exits 0."""
    if (exl3_dir / "config.json").is_file():
        return
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else "(no log)"
    raise RuntimeError(f"the converter wrote no {exl3_dir / 'config.json'} (exit status 0):\n{tail}")


def build_hf_model(out: Path) -> int:
    """Write a random-weight Llama with a byte-level tokenizer to ``out``; returns the
    id of ``<|im_end|>`` (the EOS)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    assert eos is not None and pad is not None

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Large embeddings dominate the residual stream, and a head equal to the embedding
        # table scores the current token highest: the model repeats itself, a looping output
        # that n-gram drafting can predict. (At the default init the layers' random output
        # dominates and greedy decoding wanders.)
        emb = model.model.embed_tokens.weight
        emb.mul_(EMBED_SCALE)
        model.lm_head.weight.copy_(emb)
    model.half().save_pretrained(out, safe_serialization=True)  # type: ignore[no-untyped-call]
    return eos


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    base: str, procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path], timeout_s: float
) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for name, p in procs.items():
            if p.poll() is not None:
                tail = logs[name].read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {p.returncode} before ready:\n{tail}")
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    tails = "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-2000:]}" for n, p in logs.items())
    raise TimeoutError(f"not ready after {timeout_s:.0f} s:\n{tails}")


def sse_events(resp: Any) -> Iterator[tuple[float, Any]]:
    """``(arrival time, parsed data)`` per SSE event; ``"[DONE]"`` as the string."""
    data: list[str] = []
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\n")
        if line.startswith("data: "):
            data.append(line[len("data: ") :])
        elif line == "" and data:
            payload = "\n".join(data)
            data = []
            yield time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)


def stream_chat(base: str, prompt: str, max_tokens: int, timeout_s: float) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_progress": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    progress: list[dict[str, Any]] = []
    content_times: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] | None = None
    finish: str | None = None
    done = False
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for t, ev in sse_events(resp):
            if ev == "[DONE]":
                done = True
                break
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error']}")
            if "prompt_progress" in ev:
                progress.append(ev["prompt_progress"])
            if ev.get("usage") and not ev["choices"]:
                usage = ev["usage"]
            for c in ev["choices"]:
                piece = c["delta"].get("content")
                if piece:
                    content_times.append(t)
                    text.append(piece)
                finish = c.get("finish_reason") or finish
    if not done or usage is None:
        raise RuntimeError("stream ended without a usage chunk and [DONE]")
    completion = int(usage["completion_tokens"])
    span = content_times[-1] - content_times[0] if len(content_times) > 1 else 0.0
    details = usage.get("completion_tokens_details") or {}
    return {
        "progress_chunks": len(progress),
        "progress_first": progress[0] if progress else None,
        "progress_last": progress[-1] if progress else None,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "completion_tokens": completion,
        "accepted_draft_tokens": details.get("accepted_prediction_tokens"),
        "rejected_draft_tokens": details.get("rejected_prediction_tokens"),
        "ttft_s": round(content_times[0] - t0, 3) if content_times else None,
        # the first token ends prefill; the rest are decode steps (several per pass when drafts hit)
        "decode_tokens_per_s": round((completion - 1) / span, 1) if span > 0 else None,
        "finish_reason": finish,
        "text_head": "".join(text)[:60],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work-dir", type=Path, default=None, help="Keep models and logs here (default: a temp dir)."
    )
    ap.add_argument("--budget", type=float, default=480.0, help="Overall time limit, seconds.")
    ap.add_argument("--bits", type=float, default=4.0, help="EXL3 bits per weight for the conversion.")
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()

    budget = Budget(args.budget)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="exl3-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    summary: dict[str, Any] = {"work_dir": str(work), "ok": False}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    t_start = time.monotonic()
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch")
        summary["gpu"] = torch.cuda.get_device_name(0)
        log(f"GPU: {summary['gpu']}; work dir {work}")

        took = run_child(
            [
                sys.executable,
                "-c",
                "import exllamav3; from exllamav3.version import __version__; print(__version__)",
            ],
            work / "import.log",
            budget.step(300),
            env,
        )
        summary["import_exllamav3_s"] = round(took, 1)
        log(f"import exllamav3: {took:.1f} s (includes the extension build on a cold cache)")

        hf_dir, exl3_dir, conv_dir = work / "hf", work / "exl3", work / "convert-work"
        for d in (hf_dir, exl3_dir, conv_dir):
            shutil.rmtree(d, ignore_errors=True)
        t0 = time.monotonic()
        build_hf_model(hf_dir)
        log(f"built the random-weight HF model in {time.monotonic() - t0:.1f} s")

        took = run_child(
            [
                sys.executable, "-m", "exllamav3.conversion.convert_model",
                "-i", str(hf_dir), "-o", str(exl3_dir), "-w", str(conv_dir),
                "-b", str(args.bits), "-cr", "16", "-cc", "512",
            ],
            work / "convert.log",
            budget.step(240),
            env,
        )  # fmt: skip
        check_converted(exl3_dir, work / "convert.log")
        summary["convert_s"] = round(took, 1)
        log(f"converted to EXL3 in {took:.1f} s")

        rundir = Path(tempfile.mkdtemp(prefix="exl3-smoke-ipc-"))
        os.chmod(rundir, 0o700)
        addr = ["--input-addr", f"ipc://{rundir / 'in'}", "--output-addr", f"ipc://{rundir / 'out'}"]
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cli = [sys.executable, "-m", "launcher"]
        logs = {"worker": work / "worker.log", "proxy": work / "proxy.log"}
        worker_cmd = [
            *cli, "worker", *addr, "--backend", "exllamav3", "--model-dir", str(exl3_dir),
            "--draft-mode", "ngram", "--num-draft-tokens", "4", "--ngram-match-min", "2",
            "--max-seq-len", "4096", "--cache-size", "8192", "--chunk-size", str(CHUNK),
        ]  # fmt: skip
        proxy_cmd = [*cli, "proxy", *addr, "--host", "127.0.0.1", "--port", str(port)]
        for name, cmd in (("worker", worker_cmd), ("proxy", proxy_cmd)):
            procs[name] = subprocess.Popen(
                cmd, stdout=logs[name].open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        t0 = time.monotonic()
        wait_ready(base, procs, logs, budget.step(180))
        summary["worker_ready_s"] = round(time.monotonic() - t0, 1)
        log(f"worker loaded and proxy ready in {summary['worker_ready_s']} s")

        first = stream_chat(base, PROMPT, args.max_tokens, budget.step(90))
        log(f"first request: {json.dumps(first)}")
        again = stream_chat(base, PROMPT, args.max_tokens, budget.step(90))
        log(f"repeated prompt: {json.dumps(again)}")

        n = first["prompt_tokens"]
        checks = {
            "progress_chunks>=3": first["progress_chunks"] >= 3,
            "progress_starts_at_cache": bool(first["progress_first"])
            and first["progress_first"]["processed"] == first["progress_first"]["cache"],
            "progress_ends_at_total": bool(first["progress_last"])
            and first["progress_last"]["processed"] == n,
            "first_uncached": first["cached_tokens"] == 0,
            "repeat_cached": again["cached_tokens"] >= n - 256,
            "draft_counters_present": first["accepted_draft_tokens"] is not None
            and first["rejected_draft_tokens"] is not None,
            "completion_tokens>0": first["completion_tokens"] > 0,
        }
        summary.update(
            {
                "progress_chunks": first["progress_chunks"],
                "prompt_tokens": n,
                "cached_tokens_repeat": again["cached_tokens"],
                "accepted_draft_tokens": first["accepted_draft_tokens"],
                "rejected_draft_tokens": first["rejected_draft_tokens"],
                "ttft_s": first["ttft_s"],
                "ttft_repeat_s": again["ttft_s"],
                "decode_tokens_per_s": first["decode_tokens_per_s"],
                "checks": checks,
                "ok": all(checks.values()),
            }
        )
        for k in (
            "progress_chunks",
            "cached_tokens_repeat",
            "accepted_draft_tokens",
            "rejected_draft_tokens",
        ):
            print(f"{k}: {summary[k]}")
        print(f"decode tokens/s: {summary['decode_tokens_per_s']}")
        failed = [k for k, v in checks.items() if not v]
        if failed:
            log(f"FAILED checks: {failed}")
    except Exception as e:
        summary["error"] = f"{type(e).__name__}: {e}"
        log(f"ERROR {summary['error']}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        summary["total_s"] = round(time.monotonic() - t_start, 1)
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
