"""Cost of the proxy's event -> SSE bytes path for token deltas.

Two measurements, printed as numbers (no pass/fail):

1. ``render``: ``Generation.feed`` with the chat encoder (``ChatFrames``: a
   typed ``StreamChunk``, one msgspec encode by ``sse.event``) + join for
   ``TokenDelta`` events, in-process, no I/O:
   microseconds per chunk and chunks per second,
   with and without ``continuous_usage_stats``, and for text that needs the
   U+2028 escape.
2. ``http``: one streamed chat completion through the real aiohttp app
   (``create_app``) on 127.0.0.1 with a scripted engine client that emits
   ``--tokens`` deltas as fast as the loop allows, read by an aiohttp client:
   events per second end to end, one process, both sides on one loop.

Usage: ``python benchmarks/sse_path.py [--chunks N] [--tokens N] [--repeat R]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

# The flood engine is a fake and lives with the others in tests/fakes.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol import (
    PrefillProgress,
    Started,
    TokenDelta,
)
from proxy.app import create_app
from proxy.core.dialect import Header
from proxy.core.generation import Generation, Options
from proxy.dialects.chat.frames import ChatFrames
from proxy.settings import ProxySettings
from tests.fakes.flood_engine import FloodEngine


def bench_render(n: int, repeat: int, *, text: str, continuous: bool) -> list[float]:
    """Seconds per chunk of each of ``repeat`` runs over ``n`` deltas."""
    deltas = [TokenDelta("r", text, 1) for _ in range(n)]
    per_chunk: list[float] = []
    for _ in range(repeat):
        state = Generation(["r"], Options(progress=True))
        header = Header("chatcmpl-0123456789abcdef0123456789abcdef", 1_700_000_000, "model-name")
        frames = ChatFrames(
            state,
            header,
            "chat.completion.chunk",
            include_usage=continuous,
            continuous_usage=continuous,
            timings=False,
        )
        state.stream_to(frames)
        out: list[bytes] = []
        state.feed(Started("r", 1000, 0), out)
        state.feed(PrefillProgress("r", 1000, 0, 1000, 50), out)
        out.clear()
        t0 = time.perf_counter()
        total = 0
        for ev in deltas:
            state.feed(ev, out)
            total += len(b"".join(out))
            out.clear()
        dt = time.perf_counter() - t0
        assert total > 0
        per_chunk.append(dt / n)
    return per_chunk


async def bench_http(tokens: int, batch: int) -> tuple[float, int, int]:
    """(seconds, data events received, bytes received) for one streamed request."""
    # The addresses are never used: the flood engine replaces the ZeroMQ client.
    config = ProxySettings(input_addr="inproc://unused-in", output_addr="inproc://unused-out")
    app = create_app(config, FloodEngine(tokens, batch))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            t0 = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                raw = await r.read()
            dt = time.perf_counter() - t0
    finally:
        await runner.cleanup()
    return dt, raw.count(b"data: ") - 1, len(raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=50_000, help="token deltas per render run")
    parser.add_argument("--tokens", type=int, default=20_000, help="token deltas in the HTTP run")
    parser.add_argument("--repeat", type=int, default=5, help="render runs per case (median reported)")
    args = parser.parse_args()

    print(f"render: {args.chunks} TokenDelta -> StreamChunk -> SSE bytes, median of {args.repeat}")
    cases = [
        ("plain text, usage off", " token", False),
        ("plain text, continuous usage", " token", True),
        ("text with U+2028 (escaped)", " a\u2028b", False),
    ]
    for name, text, continuous in cases:
        us = statistics.median(bench_render(args.chunks, args.repeat, text=text, continuous=continuous)) * 1e6
        print(f"  {name:32s} {us:7.2f} us/chunk  {1e6 / us:12,.0f} chunks/s")

    print(f"http: one stream of {args.tokens} deltas via aiohttp on 127.0.0.1 (client, server on one loop)")
    for batch in (1, 16):
        dt, events, nbytes = asyncio.run(bench_http(args.tokens, batch))
        print(
            f"  engine yields every {batch:2d} events: {events} data events in {dt:.3f} s = "
            f"{events / dt:12,.0f} events/s, {args.tokens / dt:12,.0f} tokens/s, "
            f"{nbytes / dt / 1e6:6.1f} MB/s"
        )


if __name__ == "__main__":
    main()
