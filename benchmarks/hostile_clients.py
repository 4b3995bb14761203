"""Hostile and careless clients against a running server; prints what they cost the others.

Start a server (``exl3-sidecar serve --port 5000``), then::

    python benchmarks/hostile_clients.py --url http://127.0.0.1:5000 --serve-pid PID

``--cases`` picks cases (comma-separated; default: all). The connection-level
cases need no model (``exl3-sidecar serve --backend synthetic``); to see the
file-descriptor limit reached in a short run, start the server with a small one
and its log in a file, e.g.::

    bash -c 'ulimit -n 1024; exec exl3-sidecar serve --backend synthetic' 2> serve.log &
    python benchmarks/hostile_clients.py --cases idle,slowloris,inject,host --log-file serve.log \
        --idle-sockets 1100

Only ``127.0.0.1`` URLs are accepted for those four cases.

- **huge prompt**: a chat request whose prompt is ``--huge-mb`` MB of text, sent while
  two normal streams decode; prints how long until it is answered (and with what), the
  normal streams' inter-token latency meanwhile, and whether they finished.
- **n**: one request with ``n`` choices on a ``--n-prompt-tokens``-token prompt; prints
  the worker's RSS before, at its peak while it runs, and after.
- **gzip bomb**: four concurrent 1 MB gzip bodies that inflate to 1 GiB; prints the
  proxy's peak RSS (``VmHWM``) and its RSS after.

- **idle**: ``--idle-sockets`` connections opened and left silent; prints what they got
  (503s, closes, still open), how a fresh ``/health`` and a fresh ``/v1/models`` fare
  meanwhile, and the log lines written during the case (accept errors among them).
- **slowloris**: ``--slowloris`` connections each sending one header line a second and never
  the blank line; prints how many the server closed within ``--slowloris-s`` seconds, when,
  and with what.
- **inject**: ``GET /v1/x%0A2099-01-01 00:00:00,000 INFO proxy.request_log: FORGED LINE%1b[2J``;
  prints the forged lines and raw ESC bytes it left in ``--log-file``.
- **host**: ``/v1/models`` with ``Host: evil.example`` and ``Origin: http://evil.example``
  (DNS rebinding); prints the statuses.
- **grammar bomb** (``--grammar-bomb N ...``): a ``json_schema`` whose string has
  ``allOf`` of N regex patterns (``^(.*a.*){i}$``, i = 1..N; issue 20), sent while
  one normal stream decodes; prints the answer and how long it took, the normal
  stream's largest inter-token gap while the bomb was out and before it
  (``--no-bomb`` baseline), how long ``/health`` took meanwhile, and the proxy's
  RSS. ``--contains-bomb N``: the same with N unanchored patterns ``a.{i}b``.

RSS figures read ``/proc`` (Linux); the worker is the child process of ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import itertools
import statistics
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import orjson
from httpx_sse import aconnect_sse


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    raise KeyError(key)


def _child(pid: int) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            return int(stat.parent.name)
    raise LookupError("no worker child")


async def _normal_stream(client: httpx.AsyncClient, url: str, times: list[float]) -> str:
    body = {
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "max_tokens": 150,
        "ignore_eos": True,  # decode the whole time the hostile request runs
        "temperature": 0,
        "stream": True,
    }
    async with aconnect_sse(client, "POST", url + "/v1/chat/completions", json=body) as source:
        async for ev in source.aiter_sse():
            if ev.data == "[DONE]":
                return "done"
            chunk = orjson.loads(ev.data)
            if "error" in chunk:
                return f"error {chunk['error']['code']}"
            times.append(time.monotonic())
    return "cut"


async def huge_prompt(url: str, mb: float) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        times: list[list[float]] = [[], []]
        normal = [asyncio.create_task(_normal_stream(client, url, t)) for t in times]
        await asyncio.sleep(2.0)  # both streams decoding
        text = ("lorem ipsum dolor sit amet " * (int(mb * 2**20) // 27 + 1))[: int(mb * 2**20)]
        t0 = time.monotonic()
        r = await client.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        )
        took = time.monotonic() - t0
        code = r.json().get("error", {}).get("code") if r.status_code != 200 else "ok"
        results = await asyncio.gather(*normal)
        during = [b - a for t in times for a, b in itertools.pairwise(t) if t0 <= b <= t0 + took + 1]
        itl = (
            f"ITL p50 {statistics.median(during) * 1000:.0f} ms, max {max(during) * 1000:.0f} ms"
            if during
            else "no tokens"
        )
        print(
            f"huge prompt ({mb:g} MB): HTTP {r.status_code} {code} after {took:.2f} s; "
            f"other streams meanwhile: {itl}; they ended: {', '.join(results)}"
        )


async def n_choices(url: str, worker: int, n: int, prompt_tokens: int) -> None:
    before = _status(worker, "VmRSS")
    peak = before
    text = "word " * prompt_tokens
    async with httpx.AsyncClient(timeout=600) as client:
        body = {"messages": [{"role": "user", "content": text}], "n": n, "max_tokens": 32}
        task = asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))
        while not task.done():
            peak = max(peak, _status(worker, "VmRSS"))
            await asyncio.sleep(0.05)
        r = task.result()
    await asyncio.sleep(1.0)
    after = _status(worker, "VmRSS")
    code = r.json().get("error", {}).get("code") if r.status_code != 200 else "ok"
    print(
        f"n={n} on a {prompt_tokens}-token prompt: HTTP {r.status_code} {code}; worker RSS "
        f"{before} MiB before, {peak} MiB peak, {after} MiB after"
    )


async def gzip_bomb(url: str, proxy: int) -> None:
    bomb = gzip.compress(b"\0" * 2**30, compresslevel=9)
    before = _status(proxy, "VmRSS")
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.monotonic()
        rs = await asyncio.gather(
            *(client.post(url + "/v1/chat/completions", content=bomb, headers=headers) for _ in range(4)),
            return_exceptions=True,
        )
        took = time.monotonic() - t0
    statuses = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in rs]
    print(
        f"gzip bomb x4 ({len(bomb) / 2**20:.1f} MB each, 1 GiB inflated): {statuses} in {took:.2f} s; "
        f"proxy RSS {before} MiB before, peak (VmHWM) {_status(proxy, 'VmHWM')} MiB, "
        f"{_status(proxy, 'VmRSS')} MiB after"
    )


def _hostport(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname != "127.0.0.1":
        raise SystemExit("the connection cases run against 127.0.0.1 only")
    return parts.hostname, parts.port or 80


async def _raw(host: str, port: int, request: bytes, limit_s: float) -> tuple[str, float]:
    """Send ``request`` on a fresh connection; the status line's code (or what
    went wrong) and the seconds it took."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(limit_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(request)
                line = await reader.readline()
            finally:
                writer.close()
        status = line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
    except TimeoutError:
        status = "timeout"
    except OSError as e:
        status = type(e).__name__
    return status, time.monotonic() - t0


class _Log:
    """Lines appended to the server's log file since ``mark()``."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.start = 0

    def mark(self) -> None:
        self.start = self.path.stat().st_size if self.path else 0

    def new(self) -> bytes:
        if self.path is None:
            return b""
        with self.path.open("rb") as f:
            f.seek(self.start)
            return f.read()


def _log_summary(text: bytes) -> str:
    lines = text.splitlines()
    accept = sum(b"socket.accept() out of system resource" in line for line in lines)
    throttled = sum(b"cannot accept connections" in line for line in lines)
    return (
        f"{len(lines)} log lines ({len(text) / 1024:.0f} KiB), {accept} 'socket.accept() out of system "
        f"resource', {throttled} throttled accept warnings"
    )


async def idle_sockets(url: str, count: int, log: _Log) -> None:
    host, port = _hostport(url)
    log.mark()
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    failed = 0
    t0 = time.monotonic()
    for _ in range(count):
        try:
            conns.append(await asyncio.wait_for(asyncio.open_connection(host, port), 5))
        except (OSError, TimeoutError):
            failed += 1
    opened = time.monotonic() - t0
    await asyncio.sleep(2.0)  # over-cap connections get their 503 after 1 s
    get = b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    health = await _raw(host, port, get % b"/health", 10.0)
    models = await _raw(host, port, get % b"/v1/models", 10.0)

    async def state(reader: asyncio.StreamReader) -> str:
        data = b""
        with contextlib.suppress(TimeoutError, OSError):
            data = await asyncio.wait_for(reader.read(12), 0.5)
        if data.startswith(b"HTTP/1.1 503"):
            return "503"
        return "closed" if reader.at_eof() else "open"

    states = await asyncio.gather(*(state(reader) for reader, _ in conns))  # at once: deadlines run
    answered, closed, still_open = (states.count(k) for k in ("503", "closed", "open"))
    for _, writer in conns:
        writer.close()
    print(
        f"idle sockets ({count}, opened in {opened:.1f} s, {failed} failed to connect): {answered} got 503, "
        f"{closed} closed without an answer, {still_open} still open; meanwhile a fresh /health: "
        f"{health[0]} in {health[1] * 1000:.0f} ms, /v1/models: {models[0]} in {models[1] * 1000:.0f} ms; "
        f"{_log_summary(log.new())}"
    )


async def slowloris(url: str, count: int, window: float) -> None:
    host, port = _hostport(url)
    closed_at: list[float] = []
    answers: dict[str, int] = {}
    t0 = time.monotonic()

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            answers["connect failed"] = answers.get("connect failed", 0) + 1
            return
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            for i in itertools.count():
                if time.monotonic() - t0 > window:
                    return
                writer.write(b"X-Slow-%d: 1\r\n" % i)
                with contextlib.suppress(TimeoutError):
                    line = await asyncio.wait_for(reader.readline(), 1.0)
                    status = line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
                    answers[status] = answers.get(status, 0) + 1
                    closed_at.append(time.monotonic() - t0)
                    return
        except OSError:
            answers["reset"] = answers.get("reset", 0) + 1
            closed_at.append(time.monotonic() - t0)
        finally:
            writer.close()

    await asyncio.gather(*(one() for _ in range(count)))
    when = (
        f"after {min(closed_at):.1f}-{max(closed_at):.1f} s (median {statistics.median(closed_at):.1f} s)"
        if closed_at
        else ""
    )
    print(
        f"slowloris ({count} connections, a header line a second): {len(closed_at)} closed by the server "
        f"within {window:g} s {when}; answers {answers or 'none'}"
    )


INJECTED_PATH = b"/v1/x%0A2099-01-01%2000:00:00,000%20INFO%20proxy.request_log:%20FORGED%20LINE%1b[2J"


async def log_injection(url: str, log: _Log) -> None:
    host, port = _hostport(url)
    log.mark()
    status, _ = await _raw(
        host,
        port,
        b"GET " + INJECTED_PATH + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        10.0,
    )
    await asyncio.sleep(0.5)  # the log line is written as the request ends
    text = log.new()
    forged = sum(line.startswith(b"2099-01-01") for line in text.splitlines())
    esc = text.count(b"\x1b")
    print(
        f"log injection: HTTP {status}; {forged} forged log line(s), {esc} raw ESC byte(s) "
        f"in {len(text.splitlines())} new log line(s)"
    )


async def host_rebinding(url: str) -> None:
    host, port = _hostport(url)
    base = b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n"
    cases = {
        "Host: evil.example": base + b"Host: evil.example:%d\r\n\r\n" % port,
        "Origin: http://evil.example": base + b"Host: 127.0.0.1\r\nOrigin: http://evil.example\r\n\r\n",
        "Host: localhost": base + b"Host: localhost:%d\r\n\r\n" % port,
    }
    results = [f"{name} -> {(await _raw(host, port, req, 10.0))[0]}" for name, req in cases.items()]
    print(f"host rebinding (no API key): {'; '.join(results)}")


CASES = ("huge", "n", "gzip", "idle", "slowloris", "inject", "host")


def bomb_schema(n: int, contains: bool = False) -> dict[str, object]:
    """Issue 20's schema: llguidance's check of it costs time and memory exponential in ``n``."""
    pattern = (lambda i: "a" + "." * i + "b") if contains else (lambda i: f"^(.*a.*){{{i}}}$")
    return {"type": "string", "allOf": [{"pattern": pattern(i)} for i in range(1, n + 1)]}


async def grammar_bomb(url: str, proxy: int, n: int, contains: bool = False) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        times: list[float] = []
        normal = asyncio.create_task(_normal_stream(client, url, times))
        while len(times) < 10:  # noqa: ASYNC110 (the stream is decoding; polled, not signalled)
            await asyncio.sleep(0.05)
        rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": bomb_schema(n, contains)}}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": rf}
        before = _status(proxy, "VmRSS")
        t0 = time.monotonic()
        bomb = asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))
        health: list[float] = []
        while not bomb.done():
            h0 = time.monotonic()
            await client.get(url + "/health")
            health.append(time.monotonic() - h0)
            await asyncio.sleep(0.1)
        took = time.monotonic() - t0
        r = bomb.result()
        result = await normal
        gaps_during = [b - a for a, b in itertools.pairwise(times) if t0 <= b <= t0 + took + 0.5]
        gaps_before = [b - a for a, b in itertools.pairwise(times) if b < t0]
        what = r.json().get("error", {}) if r.status_code != 200 else {"code": "ok"}
        during = f"max {max(gaps_during) * 1000:.0f} ms" if gaps_during else "no tokens"
        print(
            f"grammar bomb ({'contains' if contains else 'anchored'}, {n} patterns): HTTP {r.status_code} "
            f"{what.get('param')} {what.get('message', what.get('code'))!r:.90} after {took:.2f} s; other "
            f"stream's inter-token gap before: max {max(gaps_before, default=0) * 1000:.0f} ms, "
            f"during: {during} "
            f"(it ended: {result}); /health max {max(health) * 1000:.0f} ms; proxy RSS {before} MiB before, "
            f"{_status(proxy, 'VmRSS')} MiB after, peak (VmHWM) {_status(proxy, 'VmHWM')} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:5000")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--serve-pid", type=int, help="pid of exl3-sidecar serve (cases huge, n, gzip)")
    parser.add_argument("--huge-mb", type=float, default=10.0)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--n-prompt-tokens", type=int, default=2000)
    parser.add_argument("--log-file", type=Path, help="the server's stderr (cases idle, inject)")
    parser.add_argument("--idle-sockets", type=int, default=1100)
    parser.add_argument("--slowloris", type=int, default=300)
    parser.add_argument("--slowloris-s", type=float, default=15.0)
    parser.add_argument("--grammar-bomb", type=int, nargs="*", default=[], metavar="N")
    parser.add_argument("--contains-bomb", type=int, nargs="*", default=[], metavar="N")
    parser.add_argument("--only-grammar-bombs", action="store_true", help="skip the other cases")
    args = parser.parse_args()
    for n in args.grammar_bomb:
        asyncio.run(grammar_bomb(args.url, args.serve_pid, n))
    for n in args.contains_bomb:
        asyncio.run(grammar_bomb(args.url, args.serve_pid, n, contains=True))
    if args.only_grammar_bombs:
        return
    cases = set(args.cases.split(","))
    if cases - set(CASES):
        parser.error(f"unknown case(s): {', '.join(sorted(cases - set(CASES)))}")
    if cases & {"huge", "n", "gzip"} and args.serve_pid is None:
        parser.error("--serve-pid is required for the cases huge, n and gzip")
    log = _Log(args.log_file)
    if "huge" in cases:
        asyncio.run(huge_prompt(args.url, args.huge_mb))
    if "n" in cases:
        asyncio.run(n_choices(args.url, _child(args.serve_pid), args.n, args.n_prompt_tokens))
    if "gzip" in cases:
        asyncio.run(gzip_bomb(args.url, args.serve_pid))
    if "host" in cases:
        asyncio.run(host_rebinding(args.url))
    if "inject" in cases:
        asyncio.run(log_injection(args.url, log))
    if "slowloris" in cases:
        asyncio.run(slowloris(args.url, args.slowloris, args.slowloris_s))
    if "idle" in cases:
        asyncio.run(idle_sockets(args.url, args.idle_sockets, log))


if __name__ == "__main__":
    main()
