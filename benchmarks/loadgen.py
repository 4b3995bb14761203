"""The HTTP side of ``benchmarks/proxy_load.py``: a load generator that costs less
CPU than the proxy it measures, and checks every stream it reads.

Each stream is one ``asyncio.Protocol`` connection (uvloop's loop when it is
installed) that writes one prebuilt ``POST`` with ``Connection: close`` and, while
the load runs, only appends ``(time.monotonic_ns(), bytes)`` per read: no HTTP,
chunk or SSE parsing and no JSON on the measured path. Once every stream has
ended, each response is parsed (status, chunked framing, SSE events, JSON) and
every event gets the arrival time of the read that completed it.

Prompts carry ``engine_worker.synthetic.STAMP_WORD``, so each output token names
the engine step it left in (``word@<us> ``, microseconds of ``CLOCK_MONOTONIC``):
a token's latency is its arrival time minus its stamp. Every stream's text, with
its stamps removed, must equal ``expected_text`` of its prompt, and its usage
chunk must count every token; anything else is reported as a failure.

``--api`` picks the dialect of ``streams``: ``chat`` (``POST
/v1/chat/completions``, the default), ``responses`` (``POST /v1/responses``) or
``messages`` (``POST /v1/messages``); each is checked in its own events (the
text of ``response.output_text.delta`` / ``content_block_delta`` events, the
usage of ``response.completed`` or ``.incomplete`` / ``message_delta``, and
those / ``message_stop`` last instead of ``[DONE]``).

Modes (``python benchmarks/loadgen.py MODE --help``): ``streams`` (N concurrent
streams started over a ramp), ``ttft`` (one long-prompt request at a time:
first progress chunk and first token), ``hold`` (N streams held open for a
while, then dropped), ``sendfloor`` (no HTTP: the CPU of one ``send()`` per
stream per step, the floor under any proxy that writes each stream once per
step). Results are one JSON object on stdout.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import bisect
import contextlib
import json
import os
import resource
import selectors
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_worker.synthetic import STAMP, STAMP_WORD, expected_text, prompt_words, strip_stamps
from protocol import ChatMessage, SamplingParams, Submit

Reads = list[tuple[int, bytes]]

RETRIES = [0]
"""Connections retried because the server's accept queue refused them."""


def stream_content(i: int, prompt_words_extra: int = 0) -> str:
    """The user message of stream ``i``: its own words (a stream that got
    another's tokens shows it), the stamp word, and ``prompt_words_extra`` filler
    words for a long prefill."""
    filler = " ".join(f"f{k}" for k in range(prompt_words_extra))
    return f"{STAMP_WORD} s{i} w{i % 7} t{i} {filler}".rstrip()


def expected_words(content: str) -> list[str]:
    """The synthetic engine's tokens of a one-message chat prompt."""
    return prompt_words(Submit("x", SamplingParams(1), messages=(ChatMessage("user", content),)))


def chat_body(content: str, max_tokens: int, *, model: str = "synthetic", progress: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if progress:
        body["return_progress"] = True
    return orjson.dumps(body)


def responses_body(content: str, max_tokens: int, *, model: str = "synthetic") -> bytes:
    body = {
        "model": model,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": max_tokens,
        "stream": True,
    }
    return orjson.dumps(body)


def messages_body(content: str, max_tokens: int, *, model: str = "synthetic") -> bytes:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
    }
    return orjson.dumps(body)


@dataclass(frozen=True)
class Api(abc.ABC):
    """One dialect: its path, extra headers, request body, and how its events carry
    the text, the usage (prompt tokens, completion tokens) and the end of the stream."""

    path: str
    headers: tuple[str, ...]
    body: Callable[..., bytes]  # (content, max_tokens, *, model) -> the request's body

    @abc.abstractmethod
    def text(self, ev: dict[str, Any]) -> str | None:
        """From one event of the stream."""

    @abc.abstractmethod
    def usage(self, ev: dict[str, Any]) -> tuple[int, int] | None:
        """From one event of the stream."""

    @abc.abstractmethod
    def end(self, ev: dict[str, Any]) -> bool:
        """From one event of the stream."""

    @abc.abstractmethod
    def error(self, ev: dict[str, Any]) -> object:
        """From one event of the stream."""


class ChatApi(Api):
    def text(self, ev: dict[str, Any]) -> str | None:
        choices = ev.get("choices") or []
        if not choices:
            return None
        c0 = choices[0]
        delta = c0.get("delta")
        return delta.get("content") if delta is not None else c0.get("text")

    def usage(self, ev: dict[str, Any]) -> tuple[int, int] | None:
        u = ev.get("usage")
        return (u.get("prompt_tokens"), u.get("completion_tokens")) if u else None

    def end(self, ev: dict[str, Any]) -> bool:
        return False  # data: [DONE], not an event

    def error(self, ev: dict[str, Any]) -> object:
        return ev.get("error")


class ResponsesApi(Api):
    def text(self, ev: dict[str, Any]) -> str | None:
        return ev.get("delta") if ev.get("type") == "response.output_text.delta" else None

    # The synthetic engine stops every stream at max_tokens: response.incomplete
    # (max_output_tokens) is its normal end, as response.completed is a model's stop.
    ENDS = ("response.completed", "response.incomplete")

    def usage(self, ev: dict[str, Any]) -> tuple[int, int] | None:
        if ev.get("type") not in self.ENDS:
            return None
        u = ev["response"]["usage"]
        return (u["input_tokens"], u["output_tokens"])

    def end(self, ev: dict[str, Any]) -> bool:
        return ev.get("type") in self.ENDS

    def error(self, ev: dict[str, Any]) -> object:
        kind = ev.get("type")
        if kind == "response.failed":
            return ev["response"].get("error")
        return ev if kind == "error" else None


class MessagesApi(Api):
    def text(self, ev: dict[str, Any]) -> str | None:
        if ev.get("type") != "content_block_delta":
            return None
        delta = ev["delta"]
        return delta.get("text") if delta.get("type") == "text_delta" else None

    def usage(self, ev: dict[str, Any]) -> tuple[int, int] | None:
        if ev.get("type") != "message_delta":
            return None
        u = ev["usage"]
        prompt = (
            u["input_tokens"] + u.get("cache_creation_input_tokens", 0) + u.get("cache_read_input_tokens", 0)
        )
        return (prompt, u["output_tokens"])

    def end(self, ev: dict[str, Any]) -> bool:
        return ev.get("type") == "message_stop"

    def error(self, ev: dict[str, Any]) -> object:
        return ev.get("error") if ev.get("type") == "error" else None


APIS: dict[str, Api] = {
    "chat": ChatApi("/v1/chat/completions", (), chat_body),
    "responses": ResponsesApi("/v1/responses", (), responses_body),
    "messages": MessagesApi("/v1/messages", ("anthropic-version: 2023-06-01",), messages_body),
}


def http_request(host: str, port: int, path: str, body: bytes, extra_headers: Sequence[str] = ()) -> bytes:
    head = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        # The server closes when the response ends: connection_lost marks the end
        # without parsing anything while the load runs.
        "Connection: close",
        *extra_headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Conn(asyncio.Protocol):
    """One request on its own connection; records reads and nothing else."""

    __slots__ = ("closed", "reads", "request", "sent_ns", "transport")

    def __init__(self, request: bytes, closed: asyncio.Future[None]) -> None:
        self.request = request
        self.closed = closed
        self.reads: Reads = []
        self.sent_ns = 0
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.sent_ns = time.monotonic_ns()
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.reads.append((time.monotonic_ns(), data))

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def _open(host: str, port: int, request: bytes, at: float, attempts: int = 5) -> _Conn:
    """Connect at loop time ``at`` and send ``request``; retries a connection the
    kernel refused before any byte (a full accept queue)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, at - loop.time()))
    for attempt in range(attempts):
        closed: asyncio.Future[None] = loop.create_future()
        conn = _Conn(request, closed)
        try:
            await loop.create_connection(lambda c=conn: c, host, port)  # type: ignore[misc]
            return conn
        except OSError:
            if attempt == attempts - 1:
                raise
            RETRIES[0] += 1
            await asyncio.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- parsing


@dataclass
class Event:
    arrived_ns: int
    data: bytes
    name: bytes = b""  # the ``event:`` line, when the event has one


@dataclass
class Response:
    status: int
    events: list[Event] = field(default_factory=list)
    error: str | None = None


def parse_response(reads: Reads) -> Response:
    """Status and SSE events (``data:`` payloads and ``event:`` names, comments
    dropped) of one HTTP/1.1 response recorded as ``reads``; each event carries
    the arrival time of the read that brought its last byte."""
    raw = b"".join(d for _, d in reads)
    ends: list[int] = []
    total = 0
    for _, d in reads:
        total += len(d)
        ends.append(total)
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0 or not raw.startswith(b"HTTP/1."):
        return Response(0, error=f"no HTTP response head ({len(raw)} bytes)")
    status = int(raw[9:12])
    head = raw[:head_end].lower()
    pos = head_end + 4
    segments: list[tuple[int, int]] = []  # raw (start, end) of each body piece
    if b"\r\ntransfer-encoding: chunked" in head:
        while True:
            nl = raw.find(b"\r\n", pos)
            if nl < 0:
                return Response(status, error="chunked body cut short")
            size = int(raw[pos:nl].split(b";", 1)[0], 16)
            pos = nl + 2
            if size == 0:
                break
            segments.append((pos, pos + size))
            pos += size + 2
    else:
        segments.append((pos, len(raw)))
    body = b"".join(raw[a:b] for a, b in segments)
    seg_body_ends: list[int] = []
    acc = 0
    for a, b in segments:
        acc += b - a
        seg_body_ends.append(acc)

    def arrival(body_offset: int) -> int:
        k = bisect.bisect_right(seg_body_ends, body_offset)
        start_body = seg_body_ends[k - 1] if k else 0
        raw_offset = segments[k][0] + (body_offset - start_body)
        return reads[bisect.bisect_right(ends, raw_offset)][0]

    out = Response(status)
    if status != 200:
        out.error = f"HTTP {status}: {body[:200]!r}"
        return out
    i = 0
    while True:
        j = body.find(b"\n\n", i)
        if j < 0:
            break
        block = body[i:j]
        if block.startswith(b"data: "):
            out.events.append(Event(arrival(j + 1), block[6:]))
        elif block.startswith(b"event: "):
            nl = block.find(b"\n")
            if nl > 0 and block.startswith(b"data: ", nl + 1):
                out.events.append(Event(arrival(j + 1), block[nl + 7 :], block[7:nl]))
        i = j + 2
    return out


@dataclass
class StreamCheck:
    """One stream's verdict and its per-token latencies (us)."""

    ok: bool
    problem: str | None
    latencies_us: list[int]
    first_token_ns: int | None
    last_token_ns: int | None
    tokens: int
    arrivals_ns: list[int]
    stamps_us: list[int]


def check_stream(
    reads: Reads, content: str, max_tokens: int, *, usage: bool = True, api: str = "chat"
) -> StreamCheck:
    """Parse one stream and check it against the synthetic engine's output for
    ``content``: text exact (stamps removed), usage exact, the dialect's end of
    stream last (``[DONE]``, ``response.completed``, ``message_stop``)."""
    shape = APIS[api]
    resp = parse_response(reads)
    lat: list[int] = []
    arrivals: list[int] = []
    stamps: list[int] = []
    pieces: list[str] = []
    got_usage: tuple[int, int] | None = None
    done = False
    problem = resp.error
    for ev in resp.events:
        if done:
            problem = problem or "an event after the end of the stream"
        if ev.data == b"[DONE]":
            done = api == "chat"
            continue
        chunk = orjson.loads(ev.data)
        error = shape.error(chunk)
        if error is not None:
            problem = f"error event: {str(error)[:300]}"
            continue
        text = shape.text(chunk)
        if text:
            pieces.append(text)
            us = ev.arrived_ns // 1000
            for m in STAMP.finditer(text):
                stamp = int(m.group(1))
                stamps.append(stamp)
                lat.append(us - stamp)
                arrivals.append(ev.arrived_ns)
        got_usage = shape.usage(chunk) or got_usage
        done = done or shape.end(chunk)
    words = expected_words(content)
    if problem is None:
        text = "".join(pieces)
        if strip_stamps(text) != expected_text(words, max_tokens):
            problem = f"text differs: {strip_stamps(text)[:80]!r}..."
        elif not done:
            problem = "no [DONE]" if api == "chat" else "no end of stream"
        elif usage and got_usage != (len(words), max_tokens):
            problem = f"usage differs: {got_usage}"
    return StreamCheck(
        problem is None,
        problem,
        lat,
        arrivals[0] if arrivals else None,
        arrivals[-1] if arrivals else None,
        len(lat),
        arrivals,
        stamps,
    )


def percentiles(values: list[int]) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean of ``values`` (microseconds in, milliseconds out)."""
    if not values:
        return {}
    v = sorted(values)
    n = len(v)

    def p(q: float) -> float:
        return v[min(n - 1, int(q * n))] / 1000

    return {
        "p50": p(0.50),
        "p90": p(0.90),
        "p99": p(0.99),
        "p999": p(0.999),
        "max": v[-1] / 1000,
        "mean": sum(v) / n / 1000,
        "count": n,
    }


def summarize(checks: list[StreamCheck], cpu_s: float, wall_s: float) -> dict[str, Any]:
    """The JSON both load sides report: latency percentiles, verification, and
    the steady window (every stream started, none finished) with its tokens."""
    lat = [x for c in checks for x in c.latencies_us]
    firsts = [c.first_token_ns for c in checks if c.first_token_ns is not None]
    lasts = [c.last_token_ns for c in checks if c.last_token_ns is not None]
    # Steady window: 95% of the streams have had their first token and 95% not
    # yet their last (a few late connections do not shrink it to nothing).
    firsts.sort()
    lasts.sort()
    w0 = firsts[int(0.95 * (len(firsts) - 1))] if firsts else 0
    w1 = lasts[int(0.05 * (len(lasts) - 1))] if lasts else 0
    if w1 <= w0 and firsts and lasts:  # the streams never overlapped that much
        w0, w1 = firsts[0], lasts[-1]
    in_window = sum(1 for c in checks for t in c.arrivals_ns if w0 <= t <= w1)
    # The worker's pace: distinct step stamps in the window (a worker that
    # cannot keep its step period caps what any proxy can deliver).
    steps = len({s for c in checks for s in c.stamps_us if w0 // 1000 <= s <= w1 // 1000})
    failures = [c.problem for c in checks if not c.ok]
    return {
        "streams": len(checks),
        "verified": sum(1 for c in checks if c.ok),
        "failures": failures[:5],
        "tokens": len(lat),
        "latency_ms": percentiles(lat),
        "window_ns": [w0, w1],
        "window_tokens": in_window,
        "steps_per_s": steps / max(1e-9, (w1 - w0) / 1e9),
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "connect_retries": RETRIES[0],
    }


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------- modes


async def run_streams(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    n = args.streams
    contents = [stream_content(args.offset + i) for i in range(n)]
    api = APIS[args.api]
    path = args.path or api.path
    headers = [*api.headers, *args.header]
    requests = [
        http_request(args.host, args.port, path, api.body(c, args.max_tokens, model=args.model), headers)
        for c in contents
    ]
    # Same schedule as the raw floor: stream i starts at start_at + ramp * i / n.
    t0 = args.start_at - time.monotonic() + loop.time()
    cpu0, wall0 = _cpu(), time.monotonic()
    conns = await asyncio.gather(
        *(_open(args.host, args.port, r, t0 + args.ramp * i / n) for i, r in enumerate(requests))
    )
    await asyncio.gather(*(c.closed for c in conns))
    cpu, wall = _cpu() - cpu0, time.monotonic() - wall0
    checks = [
        check_stream(c.reads, content, args.max_tokens, api=args.api)
        for c, content in zip(conns, contents, strict=True)
    ]
    return summarize(checks, cpu, wall)


async def run_ttft(args: argparse.Namespace) -> dict[str, Any]:
    """One long-prompt request at a time: ms from the request's first byte to
    the first ``prompt_progress`` chunk and to the first content token."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, args.start_at - time.monotonic()))
    progress_ms: list[float] = []
    first_token_ms: list[float] = []
    failures: list[str] = []
    for r in range(args.repeat):
        content = stream_content(args.offset + r, args.prompt_words)
        req = http_request(
            args.host,
            args.port,
            args.path or APIS["chat"].path,
            chat_body(content, args.max_tokens, model=args.model, progress=True),
        )
        at = loop.time()
        conn = await _open(args.host, args.port, req, at)
        await conn.closed
        resp = parse_response(conn.reads)
        first_progress = first_token = None
        for ev in resp.events:
            if ev.data == b"[DONE]":
                continue
            chunk = orjson.loads(ev.data)
            if first_progress is None and "prompt_progress" in chunk:
                first_progress = ev.arrived_ns
            choices = chunk.get("choices") or []
            if first_token is None and choices and (choices[0].get("delta") or {}).get("content"):
                first_token = ev.arrived_ns
        if resp.error or first_token is None:
            failures.append(resp.error or "no token")
            continue
        if first_progress is not None:
            progress_ms.append((first_progress - conn.sent_ns) / 1e6)
        first_token_ms.append((first_token - conn.sent_ns) / 1e6)
        await asyncio.sleep(args.gap)
    return {"progress_ms": progress_ms, "first_token_ms": first_token_ms, "failures": failures[:5]}


async def run_hold(args: argparse.Namespace) -> dict[str, Any]:
    """Open ``streams`` requests, keep them open ``hold`` seconds, then drop them
    (the proxy must abort their engine work)."""
    loop = asyncio.get_running_loop()
    n = args.streams
    requests = [
        http_request(args.host, args.port, APIS["chat"].path, chat_body(stream_content(i), args.max_tokens))
        for i in range(n)
    ]
    t0 = args.start_at - time.monotonic() + loop.time()
    conns = await asyncio.gather(
        *(_open(args.host, args.port, r, t0 + args.ramp * i / n) for i, r in enumerate(requests))
    )
    await asyncio.sleep(args.hold)
    open_ = sum(1 for c in conns if not c.closed.done())
    for c in conns:
        if c.transport is not None:
            c.transport.close()
    return {"opened": len(conns), "still_open": open_}


def send_floor(args: argparse.Namespace) -> dict[str, Any]:
    """CPU of the writes alone: one ``send()`` of an event-sized payload to each of
    ``streams`` loopback TCP connections per step, from a plain loop, a child
    process reading and discarding. Any design that writes each stream once per
    engine step pays at least this per stream and step."""
    payload = b"x" * args.payload
    steps = args.max_tokens
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4096)
    port = ls.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the reader
        sel = selectors.DefaultSelector()
        for _ in range(args.streams):
            c, _ = ls.accept()
            c.setblocking(False)
            sel.register(c, selectors.EVENT_READ)
        left = args.streams * steps * len(payload)
        while left > 0:
            for key, _ in sel.select():
                with contextlib.suppress(BlockingIOError):
                    left -= len(key.fileobj.recv(1 << 16))  # type: ignore[union-attr]
        os._exit(0)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(args.streams)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as aiohttp sets it
    time.sleep(0.3)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        for s in socks:
            s.send(payload)
        time.sleep(args.step_ms / 1000)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.waitpid(pid, 0)
    n = args.streams * steps
    return {
        "us_per_send": 1e6 * ((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)) / n,
        "sys_us_per_send": 1e6 * (r1.ru_stime - r0.ru_stime) / n,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["streams", "ttft", "hold", "sendfloor"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--api", choices=list(APIS), default="chat", help="streams: the dialect to speak and check"
    )
    parser.add_argument("--path", help="streams, ttft: another path than the dialect's own")
    parser.add_argument("--model", default="synthetic")
    parser.add_argument("--header", action="append", default=[], help="extra request header, 'Name: value'")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--offset", type=int, default=0, help="first stream index (distinct prompts per run)")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds over which streams start")
    parser.add_argument("--start-at", type=float, default=0.0, help="time.monotonic() of the first start")
    parser.add_argument("--repeat", type=int, default=10, help="ttft: requests, one at a time")
    parser.add_argument("--prompt-words", type=int, default=4000, help="ttft: filler words of the prompt")
    parser.add_argument("--gap", type=float, default=0.2, help="ttft: seconds between requests")
    parser.add_argument("--hold", type=float, default=5.0, help="hold: seconds the streams stay open")
    parser.add_argument("--payload", type=int, default=330, help="sendfloor: bytes per send")
    parser.add_argument("--step-ms", type=float, default=20.0, help="sendfloor: ms between steps")
    args = parser.parse_args(argv)
    if args.mode == "sendfloor":
        sys.stdout.write(json.dumps(send_floor(args)) + "\n")
        return
    run = {"streams": run_streams, "ttft": run_ttft, "hold": run_hold}[args.mode]
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    result["loop"] = "uvloop" if "uvloop" in sys.modules else "asyncio"
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
