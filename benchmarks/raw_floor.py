"""The floor of ``benchmarks/proxy_load.py``: the same load consumed straight from
a worker's ZeroMQ sockets, with no HTTP and no proxy.

It speaks the protocol as the proxy does (``Hello`` until ``Ready``, one
``Submit`` per stream on the same schedule and prompts as the HTTP load
generator, ``EventBatch`` in) from one blocking thread, and timestamps each
batch when ``recv`` returns, before decoding it. A token's latency is that time
minus its stamp (``engine_worker.synthetic`` stamps), so the floor holds the
worker's own step, encoding and ZeroMQ hop: what any consumer of this worker
pays. It runs against a second worker of the same configuration, because a
worker's PUSH socket round-robins between its readers and cannot feed two.

Modes mirror ``loadgen.py``: ``streams`` and ``ttft``; one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadgen import StreamCheck, expected_words, stream_content, summarize

from engine_worker.synthetic import STAMP, expected_text, strip_stamps
from protocol import (
    PROTOCOL_VERSION,
    ChatMessage,
    EventBatch,
    Finished,
    Hello,
    PrefillProgress,
    Ready,
    RequestError,
    SamplingParams,
    Submit,
    TokenDelta,
    decode_worker_message,
    encode,
)


class Link:
    """The proxy's two sockets, blocking, handshaken."""

    def __init__(self, input_addr: str, output_addr: str) -> None:
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(input_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.connect(output_addr)
        deadline = time.monotonic() + 30
        while True:
            self.push.send_multipart(encode(Hello(PROTOCOL_VERSION, "raw-floor")))
            if self.pull.poll(500) and isinstance(self._recv(), Ready):
                break
            if time.monotonic() > deadline:
                raise SystemExit("raw floor: no Ready from the worker")

    def _recv(self) -> Any:
        return decode_worker_message(self.pull.recv_multipart())

    def send(self, msg: Submit) -> None:
        self.push.send_multipart(encode(msg))

    def close(self) -> None:
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _submit(rid: str, content: str, max_tokens: int) -> Submit:
    return Submit(rid, SamplingParams(max_tokens), messages=(ChatMessage("user", content),))


def run_streams(link: Link, args: argparse.Namespace) -> dict[str, Any]:
    n = args.streams
    run = f"raw-{time.monotonic_ns()}-"
    contents = [stream_content(args.offset + i) for i in range(n)]
    index = {f"{run}{i}": i for i in range(n)}
    texts: list[list[str]] = [[] for _ in range(n)]
    lat: list[list[int]] = [[] for _ in range(n)]
    arrivals: list[list[int]] = [[] for _ in range(n)]
    problems: list[str | None] = [None] * n
    finished = 0
    next_i = 0
    pull = args.link.pull
    while time.monotonic() < args.start_at:
        time.sleep(0.001)
    cpu0, wall0 = _cpu(), time.monotonic()
    while finished < n:
        now = time.monotonic()
        while next_i < n and now >= args.start_at + args.ramp * next_i / n:
            link.send(_submit(f"{run}{next_i}", contents[next_i], args.max_tokens))
            next_i += 1
        wait_s = args.start_at + args.ramp * next_i / n - now if next_i < n else 1.0
        if not pull.poll(max(0, int(wait_s * 1000))):
            continue
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            t_ns = time.monotonic_ns()
            msg = decode_worker_message(frames)
            if not isinstance(msg, EventBatch):
                continue
            us = t_ns // 1000
            for ev in msg.events:
                i = index.get(ev.request_id or "")
                if i is None:
                    continue
                if isinstance(ev, TokenDelta):
                    texts[i].append(ev.text)
                    for m in STAMP.finditer(ev.text):
                        lat[i].append(us - int(m.group(1)))
                        arrivals[i].append(t_ns)
                elif isinstance(ev, Finished):
                    finished += 1
                    if ev.completion_tokens != args.max_tokens:
                        problems[i] = f"completion_tokens {ev.completion_tokens}"
                elif isinstance(ev, RequestError):
                    finished += 1
                    problems[i] = f"error {ev.code}: {ev.message}"
    cpu, wall = _cpu() - cpu0, time.monotonic() - wall0
    checks = []
    for i in range(n):
        problem = problems[i]
        if problem is None and strip_stamps("".join(texts[i])) != expected_text(
            expected_words(contents[i]), args.max_tokens
        ):
            problem = "text differs"
        a = arrivals[i]
        checks.append(
            StreamCheck(
                problem is None, problem, lat[i], a[0] if a else None, a[-1] if a else None, len(a), a, []
            )
        )
    return summarize(checks, cpu, wall)


def run_ttft(link: Link, args: argparse.Namespace) -> dict[str, Any]:
    while time.monotonic() < args.start_at:
        time.sleep(0.001)
    progress_ms: list[float] = []
    first_token_ms: list[float] = []
    for r in range(args.repeat):
        rid = f"raw-ttft-{time.monotonic_ns()}"
        sent = time.monotonic_ns()
        link.send(_submit(rid, stream_content(args.offset + r, args.prompt_words), args.max_tokens))
        first_progress = first_token = None
        done = False
        while not done:
            frames = link.pull.recv_multipart()
            t_ns = time.monotonic_ns()
            msg = decode_worker_message(frames)
            if not isinstance(msg, EventBatch):
                continue
            for ev in msg.events:
                if ev.request_id != rid:
                    continue
                if isinstance(ev, PrefillProgress) and first_progress is None:
                    first_progress = t_ns
                elif isinstance(ev, TokenDelta) and first_token is None and ev.text:
                    first_token = t_ns
                elif isinstance(ev, Finished | RequestError):
                    done = True
        if first_progress is not None:
            progress_ms.append((first_progress - sent) / 1e6)
        if first_token is not None:
            first_token_ms.append((first_token - sent) / 1e6)
        time.sleep(args.gap)
    return {"progress_ms": progress_ms, "first_token_ms": first_token_ms, "failures": []}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["streams", "ttft"])
    parser.add_argument("--input-addr", required=True)
    parser.add_argument("--output-addr", required=True)
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--ramp", type=float, default=1.0)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--prompt-words", type=int, default=4000)
    parser.add_argument("--gap", type=float, default=0.2)
    args = parser.parse_args(argv)
    link = Link(args.input_addr, args.output_addr)
    args.link = link
    try:
        result = run_streams(link, args) if args.mode == "streams" else run_ttft(link, args)
    finally:
        link.close()
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
