"""When a tool call's arguments reach the client: streamed as the model writes them.

Through the real aiohttp app (``create_app``) on 127.0.0.1 with a scripted engine
client that writes a ``write_file`` call (``path`` and a ``content`` of Python-looking
source) one piece of ``--piece`` characters per engine step of ``--step-ms``, as a
model writes tokens, read by an aiohttp client that stamps each SSE line on arrival.
Per format (``--tool-call-format``: the generic tools prompt in that format) and
dialect (chat, Responses, Messages), it prints:

- ``first ms``: from the engine writing the first piece that holds argument text
  to the client receiving the first argument fragment (before streamed arguments
  this was about the whole call's duration: every step after that piece);
- ``gap p50/p99 ms``: between argument fragments at the client, beside the step;
- ``frags``: argument fragments received; ``bytes``: the raw SSE body, beside
  ``whole bytes``: the same response when the engine writes the call as one piece
  (the proxy then sends the arguments in one fragment, as the whole-call path did).

Usage: ``python benchmarks/tool_call_stream.py [--tokens 1500] [--step-ms 20] [--quick]``
The figure names the CPU (``/proc/cpuinfo``) and Python it came from.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

# The scripted engine is a fake and lives with the others in tests/fakes.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol import Finished, FinishReason, Started, Submit, TokenDelta
from proxy.app import create_app
from proxy.engine.stream import RequestStream
from tests.fakes.engine_client import FakeEngineClient, make_config

PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"],
}
SOURCE_LINE = "def handler_{i}(request):\n    return {{'status': {i}, 'ok': True}}  # line {i}\n"


def call_text(fmt: str, arguments: dict[str, str]) -> str:
    """The model's text of one ``write_file`` call in ``fmt``."""
    args = json.dumps(arguments)
    if fmt == "hermes":
        return '<tool_call>\n{"name": "write_file", "arguments": ' + args + "}\n</tool_call>"
    if fmt == "llama3_json":
        return '<|python_tag|>{"name": "write_file", "parameters": ' + args + "}"
    if fmt == "mistral":
        return '[TOOL_CALLS][{"name": "write_file", "arguments": ' + args + "}]"
    raise ValueError(fmt)


FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass
class Scripted(FakeEngineClient):
    """Plays ``pieces`` one per step and stamps when each went to the proxy."""

    pieces: Sequence[str] = ()
    step_s: float = 0.02
    emitted: list[float] = field(default_factory=list)

    async def _play(self, submit: Submit, stream: RequestStream) -> None:
        rid = submit.request_id
        stream.put(Started(rid, 10, 0))
        for piece in self.pieces:
            await asyncio.sleep(self.step_s)
            self.emitted.append(time.perf_counter())
            stream.put(TokenDelta(rid, piece, 1))
        stream.put(Finished(rid, FinishReason.STOP, 10, 0, len(self.pieces), None, None, 0.0, 0.0, 0.0))


def _body(dialect: str) -> tuple[str, dict[str, Any]]:
    user = [{"role": "user", "content": "write it"}]
    if dialect == "chat":
        tool = {"type": "function", "function": {"name": "write_file", "parameters": PARAMETERS}}
        return "/v1/chat/completions", {"model": "m", "messages": user, "tools": [tool], "stream": True}
    if dialect == "responses":
        tool = {"type": "function", "name": "write_file", "parameters": PARAMETERS}
        return "/v1/responses", {"model": "m", "input": "write it", "tools": [tool], "stream": True}
    tool = {"name": "write_file", "input_schema": PARAMETERS}
    body = {"model": "m", "max_tokens": 8192, "messages": user, "tools": [tool], "stream": True}
    return "/v1/messages", body


def _fragment(dialect: str, data: Any) -> str | None:
    """The argument text an SSE event's data carries, if any."""
    if dialect == "chat":
        for choice in data.get("choices") or []:
            for call in choice["delta"].get("tool_calls") or []:
                if "name" not in call["function"] and call["function"].get("arguments"):
                    return str(call["function"]["arguments"])
        return None
    if dialect == "responses":
        return data["delta"] if data.get("type") == "response.function_call_arguments.delta" else None
    delta = data.get("delta") if data.get("type") == "content_block_delta" else None
    return delta["partial_json"] if delta and delta.get("type") == "input_json_delta" else None


@dataclass
class Run:
    first_ms: float
    gaps_ms: list[float]
    fragments: int
    bytes: int
    arguments: str


async def run(fmt: str, dialect: str, pieces: Sequence[str], first_arg_piece: int, step_s: float) -> Run:
    engine = Scripted(pieces=pieces, step_s=step_s)
    app = create_app(make_config(tool_call_format=fmt), engine)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    path, body = _body(dialect)
    arrivals: list[float] = []
    fragments: list[str] = []
    size = 0
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"http://127.0.0.1:{port}{path}", json=body) as r,
        ):
            assert r.status == 200, await r.text()
            async for line in r.content:
                now = time.perf_counter()
                size += len(line)
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                text = _fragment(dialect, json.loads(line[6:]))
                if text:
                    arrivals.append(now)
                    fragments.append(text)
    finally:
        await runner.cleanup()
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(arrivals)]
    first = (arrivals[0] - engine.emitted[first_arg_piece]) * 1e3
    return Run(first, gaps, len(fragments), size, "".join(fragments))


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main_async(tokens: int, step_ms: float, piece: int) -> None:
    lines = []
    i = 0
    while sum(map(len, lines)) < tokens * piece:
        lines.append(SOURCE_LINE.format(i=i))
        i += 1
    arguments = {"path": "src/app.py", "content": "".join(lines)}
    print(f"{_cpu()}, Python {platform.python_version()}")
    print(f"{tokens} pieces of {piece} characters, one per {step_ms} ms step")
    print(
        f"{'format':<12} {'dialect':<10} {'first ms':>9} {'gap p50':>8} {'gap p99':>8} "
        f"{'frags':>6} {'bytes':>9} {'whole bytes':>12} {'call ms':>8}"
    )
    for fmt in FORMATS:
        text = call_text(fmt, arguments)
        pieces = [text[k : k + piece] for k in range(0, len(text), piece)]
        opened = text.index('{"path"')  # the arguments' "{": the first argument byte
        first_piece = opened // piece
        for dialect in ("chat", "responses", "messages"):
            streamed = await run(fmt, dialect, pieces, first_piece, step_ms / 1e3)
            whole = await run(fmt, dialect, [text], 0, step_ms / 1e3)
            assert json.loads(streamed.arguments) == json.loads(whole.arguments) == arguments
            call_ms = (len(pieces) - first_piece) * step_ms
            print(
                f"{fmt:<12} {dialect:<10} {streamed.first_ms:>9.2f} "
                f"{statistics.median(streamed.gaps_ms):>8.2f} "
                f"{_pct(streamed.gaps_ms, 0.99):>8.2f} {streamed.fragments:>6} {streamed.bytes:>9} "
                f"{whole.bytes:>12} {call_ms:>8.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500, help="pieces the call is written in")
    parser.add_argument("--step-ms", type=float, default=20.0, help="engine step")
    parser.add_argument("--piece", type=int, default=4, help="characters per piece (a token)")
    parser.add_argument("--quick", action="store_true", help="300 pieces, 2 ms steps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.step_ms = 300, 2.0
    asyncio.run(main_async(args.tokens, args.step_ms, args.piece))


if __name__ == "__main__":
    main()
