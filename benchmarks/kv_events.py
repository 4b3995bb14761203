"""What publishing KV-cache events (``--kv-events-endpoint``) costs the worker's engine thread.

Everything here is engine-thread time: the hooks the prefix cache calls, ``flush`` (the
batch built and handed to the publisher's queue) and, for ExLlamaV3, the page-table walk
after ``iterate()``. Encoding and sending happen on the publisher's own thread.

Sections:

- ``blocks``: ``store_tokens`` + ``flush`` of one entry per step (distinct 1,024-token
  sequences) and its eviction, over a real ``KvEventPublisher`` (a PUB on ``ipc://``),
  with no subscriber and with one draining it: microseconds per stored block, for
  blocks of 16 and 256 tokens.
- ``cpu``: the CPU engine on the embedded model, prefix cache on, events on: distinct
  prompts of about 600 tokens, one at a time, 4 tokens each (2 per ``--repeats``); the
  time spent in the event hooks and flushes against the time of the steps
  (``CpuBackend.step``), per stored block and as a share.
- ``pages``: ``PageTableEvents.sync`` over a page table of 256 and 4,096 complete pages
  (64k and 1M tokens of cache), unchanged and with one new page: the per-step walk.

Usage: python benchmarks/kv_events.py [--sections blocks,cpu,pages] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import zmq

from engine_worker.exllamav3.kv_pages import PageTableEvents
from engine_worker.kv_events import MEDIUM_CPU, MEDIUM_GPU, KvEventPublisher, KvEvents, chained_hash

SEQ_TOKENS = 1024


class Drain:
    """A SUB on ``addr`` that receives and discards every message, in a thread."""

    def __init__(self, addr: str) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(addr)
        self._stop = threading.Event()
        self.received = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(20):
                self._sub.recv_multipart()
                self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)
        self._ctx.term()


def bench_blocks(block_size: int, subscriber: bool, steps: int) -> tuple[float, float, int]:
    """(µs per stored block, µs per evicted block, batches dropped) over ``steps`` entries."""
    with tempfile.TemporaryDirectory() as tmp:
        addr = f"ipc://{tmp}/kv.sock"
        pub = KvEventPublisher(addr, "kv@bench@model")
        drain = Drain(addr) if subscriber else None
        time.sleep(0.2)
        try:
            events = KvEvents(pub, block_size=block_size, medium=MEDIUM_CPU)
            events.flush()
            seqs = [[(i * 7919 + j) % 49152 for j in range(SEQ_TOKENS)] for i in range(steps)]
            t_store = t_evict = 0.0
            for seq in seqs:
                t0 = time.perf_counter()
                events.store_tokens(seq, None)
                events.flush()
                t_store += time.perf_counter() - t0
            for seq in seqs:
                t0 = time.perf_counter()
                events.evict_tokens(seq, None)
                events.flush()
                t_evict += time.perf_counter() - t0
            blocks = steps * (SEQ_TOKENS // block_size)
            return t_store / blocks * 1e6, t_evict / blocks * 1e6, pub.dropped
        finally:
            if drain is not None:
                drain.close()
            pub.close()


@dataclass
class Timed:
    seconds: float = 0.0
    calls: int = 0


def _timed(fn: Callable[..., Any], acc: Timed) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc.seconds += time.perf_counter() - t0
            acc.calls += 1

    return wrapper


def bench_cpu(repeats: int) -> dict[str, float]:
    from engine_worker.admission import checked_prepare
    from engine_worker.cpu import CpuBackend
    from engine_worker.cpu.model_store import load_embedded
    from engine_worker.settings import WorkerSettings
    from protocol.messages import ChatMessage, SamplingParams, Submit

    loaded = load_embedded()
    settings = WorkerSettings(backend="cpu", prefix_cache_mb=64, max_batch_size=1)
    backend = CpuBackend.from_loaded(loaded, settings)
    with tempfile.TemporaryDirectory() as tmp:
        pub = KvEventPublisher(f"ipc://{tmp}/kv.sock", "kv@bench@model")
        try:
            events = backend.attach_kv_events(pub)
            hooks = Timed()
            flushes = Timed()
            # The prefix cache's callbacks go through these methods: time them where they run.
            events.store_tokens = _timed(events.store_tokens, hooks)  # type: ignore[method-assign]
            events.evict_tokens = _timed(events.evict_tokens, hooks)  # type: ignore[method-assign]
            flush = _timed(events.flush, flushes)
            flush()
            stored_blocks = 0
            step_s = 0.0
            steps = 0
            words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india"]
            for i in range(repeats * 2):
                text = " ".join(words[(i + j) % len(words)] + str(j % 97) for j in range(200))
                submit = Submit(
                    f"r{i}",
                    SamplingParams(max_tokens=4, temperature=0.0),
                    messages=(ChatMessage("user", text),),
                )
                backend.start(submit.request_id, checked_prepare(backend, submit), submit.params)
                before = len(events)
                while backend.active_ids():
                    t0 = time.perf_counter()
                    backend.step()
                    step_s += time.perf_counter() - t0
                    steps += 1
                    flush()
                stored_blocks += max(0, len(events) - before)
            publish_s = hooks.seconds + flushes.seconds
            return {
                "steps": steps,
                "step_ms": step_s / steps * 1e3,
                "stored_blocks": stored_blocks,
                "block_size": events.block_size,
                "publish_us_per_block": publish_s / max(1, stored_blocks) * 1e6,
                "publish_share": publish_s / (step_s + flushes.seconds),
            }
        finally:
            pub.close()
            backend.close()


class _Sink:
    dropped = 0

    def publish(self, batch: Any) -> bool:
        return True


def bench_pages(pages: int, repeats: int) -> tuple[float, float]:
    """(µs per sync with nothing new, µs per sync with one new page)."""
    table = SimpleNamespace(all_pages=[])
    parent = None
    for i in range(pages):
        tokens = list(range(i * 256, (i + 1) * 256))
        h = chained_hash(parent, tokens)
        table.all_pages.append(
            SimpleNamespace(
                phash=h,
                prev_hash=parent,
                kv_position=256,
                sequence=SimpleNamespace(tolist=lambda t=tokens: [t]),
            )
        )
        parent = h
    events = KvEvents(_Sink(), block_size=256, medium=MEDIUM_GPU)
    sync = PageTableEvents(events)
    sync.sync(table)
    events.flush()
    idle = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync.sync(table)
        events.flush()
        idle.append(time.perf_counter() - t0)
    one_new = []
    last = table.all_pages[-1]
    for r in range(repeats):
        # One page changes content: one removal and one store in the step.
        tokens = [r] * 256
        last.phash = chained_hash(last.prev_hash, tokens)
        last.sequence = SimpleNamespace(tolist=lambda t=tokens: [t])
        t0 = time.perf_counter()
        sync.sync(table)
        events.flush()
        one_new.append(time.perf_counter() - t0)
    return statistics.median(idle) * 1e6, statistics.median(one_new) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", default="blocks,cpu,pages")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if "blocks" in sections:
        print("blocks: engine-thread cost of store_tokens/evict_tokens + flush, 1,024-token entries")
        print(
            f"  {'block':>6} {'subscriber':>10} {'store µs/block':>15} {'evict µs/block':>15} {'dropped':>8}"
        )
        for block_size in (16, 256):
            for subscriber in (False, True):
                runs = [bench_blocks(block_size, subscriber, 200) for _ in range(args.repeats)]
                store = statistics.median(r[0] for r in runs)
                evict = statistics.median(r[1] for r in runs)
                dropped = max(r[2] for r in runs)
                sub = "yes" if subscriber else "no"
                print(f"  {block_size:>6} {sub:>10} {store:>15.1f} {evict:>15.1f} {dropped:>8}")
    if "cpu" in sections:
        r = bench_cpu(args.repeats)
        print(
            f"cpu: {r['steps']:.0f} steps of {r['step_ms']:.1f} ms on average, "
            f"{r['stored_blocks']:.0f} blocks of {r['block_size']:.0f} tokens stored: publishing "
            f"{r['publish_us_per_block']:.1f} µs per stored block, {r['publish_share'] * 100:.5f}% of the "
            "engine thread's step time"
        )
    if "pages" in sections:
        print("pages: PageTableEvents.sync + flush after each iterate()")
        for pages in (256, 4096):
            idle, one = bench_pages(pages, 50 * args.repeats)
            print(
                f"  {pages:>5} pages: {idle:8.1f} µs with nothing new, {one:8.1f} µs with one page replaced"
            )


if __name__ == "__main__":
    main()
