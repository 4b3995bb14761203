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
- **inject**: ``GET /v1/x%0A2099-01-01 00:00:00,000 INFO proxy.ops.request_log: FORGED LINE%1b[2J``;
  prints the forged lines and raw ESC bytes it left in ``--log-file``.
- **host**: ``/v1/models`` with ``Host: evil.example`` and ``Origin: http://evil.example``
  (DNS rebinding); prints the statuses.
- **grammar bomb** (``--grammar-bomb N ...``): a ``json_schema`` whose string has
  ``allOf`` of N regex patterns (``^(.*a.*){i}$``, i = 1..N; issue 20), sent while
  one normal stream decodes; prints the answer and how long it took, the normal
  stream's largest inter-token gap while the bomb was out and before it
  (``--no-bomb`` baseline), how long ``/health`` took meanwhile, and the proxy's
  RSS. ``--contains-bomb N``: the same with N unanchored patterns ``a.{i}b``.
- **stalled** (``--stalled-readers K``, default 2: start the server with ``--max-in-flight K``):
  K sockets with a 4 KiB receive buffer each ask for a stream with ``n`` 8,
  ``top_logprobs`` 20, ``max_tokens`` 1500 (``ignore_eos``), read 2 KiB and stop
  reading; prints when the server closed each socket (the state of the server's
  side in ``/proc/net/tcp``; the bytes its kernel still holds unsent, at most and
  then), the worker's running sequences meanwhile, the proxy's RSS, what
  a small request from another client got (429 while the slots are held), and the
  log lines that name the cut. Bounded by ``--stalled-s`` seconds.
- **starve**: ``--starve-long`` (16) streams with ``max_tokens`` 8000 and ``ignore_eos``
  fill the KV budget (some run, the rest wait); once they are queued, a 3-token
  request is sent: prints the running / waiting counts and KV use, and its time to
  first token and to the end (at most ``--starve-wait`` seconds).
- **cache** (``--api-keys k1,k2``; start the server with ``--api-key k1,k2`` and, for
  the isolation, ``--cache-isolation key``): the first key sends a document of
  ``--cache-doc-chars`` characters; the second key probes a wrong guess and then
  the right guess of its first 2,400 characters, and the first key the right guess;
  prints each probe's ``cached_tokens`` and ``prompt_time`` (with a shared prefix
  cache the right guess is found, and prefills faster than the wrong one).

Issue 33's cases: one client stalling the worker. The first four run while a victim
stream decodes and send a newcomer's 3-token chat 0.3 s in; each prints how long the
attack took and what it got, the victim's median gap before and its median and
largest gap during, and the newcomer's time to first token:

- **stops-none**, **stops**, **stops-allowed**: ``--stop-requests`` (8) Messages requests
  with no stops (the baseline of the same requests), with ``--stop-count`` (50,000)
  ``stop_sequences`` each, and with 64 of 256 characters (the limit);
- **lookup**: ``--lookup-requests`` (4) ``count_tokens`` of ``--lookup-mb`` (4.7) MB;
- **turns**: ``--turns-requests`` (4) Messages requests of ``--turns`` (100,000)
  one-character messages;
- **status-streams**: 8 ``/v1/status?stream=true`` sockets that never read: whether a
  follower is served within ``--stalled-client-timeout`` (the server's) + 30 s and how
  the 8 sockets ended; then 8 ``HEAD`` with a ``GET`` pipelined: how many got answers
  and the body bytes that came where none should;
- **grammar-fault** (``--serve-pid``): a valid schema (an enum of 30,000) whose checker
  child is SIGKILLed mid-check: the status and code it gets.

RSS figures read ``/proc`` (Linux); the worker is the child process of ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import itertools
import os
import random
import signal
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
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


async def _normal_stream(
    client: httpx.AsyncClient, url: str, times: list[float], max_tokens: int = 150
) -> str:
    body = {
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "max_tokens": max_tokens,
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


_TCP_STATES = {1: "open", 7: "reset", 8: "closed (FIN)"}


def _tcp_state(sock: socket.socket) -> str:
    """The socket's TCP state (Linux ``TCP_INFO``), read without taking a byte of what waits in it."""
    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    return _TCP_STATES.get(state, f"state {state}")


_PROC_TCP_STATES = {
    1: "ESTABLISHED",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    11: "CLOSING",
}


def _server_side(sock: socket.socket) -> tuple[str, int]:
    """The server's side of the loopback connection of ``sock``, from
    ``/proc/net/tcp``: its TCP state (``gone`` when it has none left) and the
    bytes its kernel holds unsent (``tx_queue``). A server that closes while
    bytes wait unsent leaves an orphan in ``FIN_WAIT1`` holding them."""
    client = f"0100007F:{sock.getsockname()[1]:04X}"  # 127.0.0.1 as a little-endian host writes it
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[2] == client:
            state = int(fields[3], 16)
            return _PROC_TCP_STATES.get(state, f"state {state}"), int(fields[4].split(":")[0], 16)
    return "gone", 0


async def _ready(client: httpx.AsyncClient, url: str) -> dict[str, object]:
    r = await client.get(url + "/ready")
    return dict(r.json())


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _stalled_socket(host: str, port: int, body: bytes, key: str | None) -> socket.socket:
    """A connection with a 4 KiB receive buffer that sends ``body`` as a POST and
    reads 2 KiB of the answer, then nothing more."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, port))
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + auth
        + b"Content-Length: %d\r\n\r\n" % len(body)
    )
    await loop.sock_sendall(sock, head + body)
    got = 0
    while got < 2048:
        data = await loop.sock_recv(sock, 2048 - got)
        if not data:
            break
        got += len(data)
    return sock


async def stalled_readers(
    url: str, proxy: int, count: int, window: float, log: _Log, key: str | None
) -> None:
    host, port = _hostport(url)
    body = orjson.dumps(
        {
            "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "n": 8,
            "logprobs": True,
            "top_logprobs": 20,
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
    )
    log.mark()
    before = _status(proxy, "VmRSS")
    peak = before
    async with httpx.AsyncClient(timeout=60, headers=_auth(key)) as client:
        t0 = time.monotonic()
        socks = await asyncio.gather(*(_stalled_socket(host, port, body, key) for _ in range(count)))
        stopped = time.monotonic() - t0  # every socket has its 2 KiB and reads no more
        ended: list[tuple[float, str] | None] = [None] * count
        running: list[tuple[float, int]] = []
        probes: list[tuple[float, str]] = []
        kernel = 0
        next_probe = 0.0
        small = {"messages": [{"role": "user", "content": "Say OK"}], "max_tokens": 1}
        while time.monotonic() - t0 < window:
            now = time.monotonic() - t0
            peak = max(peak, _status(proxy, "VmRSS"))
            for i, sock in enumerate(socks):
                server_state, queued = _server_side(sock)
                kernel = max(kernel, queued)
                if ended[i] is None and server_state != "ESTABLISHED":
                    ended[i] = (
                        now,
                        f"server side {server_state} ({queued / 2**20:.2f} MiB unsent), "
                        f"client side {_tcp_state(sock)},",
                    )
            active = (await _ready(client, url)).get("worker_active_requests")
            running.append((now, active if isinstance(active, int) else -1))
            if now >= next_probe and not any(code == "200" for _, code in probes):
                try:
                    r = await client.post(url + "/v1/chat/completions", json=small, timeout=30)
                    probes.append((now, str(r.status_code)))
                except httpx.HTTPError as e:
                    probes.append((now, type(e).__name__))
                next_probe = now + 2.0
            done = all(e is not None for e in ended) and running[-1][1] == 0
            if done and any(code == "200" for _, code in probes):
                break
            await asyncio.sleep(0.5)
        for sock in socks:
            sock.close()
    await asyncio.sleep(1.0)
    after = _status(proxy, "VmRSS")
    cuts = [
        line for line in log.new().splitlines() if b"cut the stream" in line or b"cut the response" in line
    ]
    when = ", ".join(f"{e[1]} after {e[0] - stopped:.1f} s" if e else "still open" for e in ended)
    most = max((n for _, n in running), default=-1)
    zero = next((t for t, n in running if n == 0 and t > stopped + 1), None)
    refused = sum(code == "429" for _, code in probes)
    ok = next((t for t, code in probes if code == "200"), None)
    print(
        f"stalled readers ({count}, 4 KiB receive buffer, stopped reading {stopped:.1f} s after sending): "
        f"the server ended them: {when} (counted from when they stopped); worker's running sequences: "
        f"at most {most}, "
        + (f"0 after {zero - stopped:.1f} s" if zero is not None else "never 0 within the window")
        + f"; another client's small request: {refused} x 429, then "
        + (f"200 after {ok - stopped:.1f} s" if ok is not None else f"no 200 within {window:g} s")
        + f"; proxy RSS {before} MiB before, {peak} MiB peak (sampled), {after} MiB after; "
        f"unsent in the server's kernel for one socket: at most {kernel / 2**20:.2f} MiB; "
        f"{len(cuts)} log line(s) naming the cut"
        + (f", e.g. {cuts[0].decode(errors='replace')[:200]!r}" if cuts else "")
    )


async def _first_token(
    client: httpx.AsyncClient, url: str, body: dict[str, object]
) -> tuple[float | None, float, int]:
    """Seconds to the first content token (``None``: none came) and to the end, and the tokens seen."""
    t0 = time.monotonic()
    first = None
    tokens = 0
    async with aconnect_sse(client, "POST", url + "/v1/chat/completions", json=body) as source:
        async for ev in source.aiter_sse():
            if ev.data == "[DONE]":
                break
            chunk = orjson.loads(ev.data)
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                tokens += 1
                if first is None:
                    first = time.monotonic() - t0
    return first, time.monotonic() - t0, tokens


async def starvation(url: str, long: int, wait_s: float, key: str | None) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), headers=_auth(key)) as client:
        counts: list[int] = [0] * long

        async def long_stream(i: int) -> None:
            body = {
                "messages": [{"role": "user", "content": f"Write a very long story, number {i}."}],
                "max_tokens": 8000,
                "ignore_eos": True,
                "stream": True,
            }
            async with aconnect_sse(client, "POST", url + "/v1/chat/completions", json=body) as source:
                async for _ in source.aiter_sse():
                    counts[i] += 1

        t0 = time.monotonic()
        tasks = [asyncio.create_task(long_stream(i)) for i in range(long)]
        try:
            ready: dict[str, object] = {}
            while time.monotonic() - t0 < 120:  # until every long one runs or waits
                ready = await _ready(client, url)
                running, waiting = ready.get("worker_active_requests"), ready.get("worker_waiting_requests")
                if (
                    isinstance(running, int)
                    and isinstance(waiting, int)
                    and waiting > 0
                    and running + waiting >= long
                ):
                    break
                await asyncio.sleep(0.2)
            sent = time.monotonic() - t0
            short = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "stream": True}
            try:
                async with asyncio.timeout(wait_s):
                    first, total, tokens = await _first_token(client, url, short)
                answer = (
                    f"first token after {first:.2f} s, all {tokens} after {total:.2f} s"
                    if first is not None
                    else f"no token, ended after {total:.2f} s"
                )
            except TimeoutError:
                answer = f"no token in {wait_s:g} s"
            kv = ready.get("worker_kv_cache_usage")
            print(
                f"starvation ({long} streams, max_tokens 8000, ignore_eos): "
                f"{ready.get('worker_active_requests')} running, {ready.get('worker_waiting_requests')} "
                "waiting, KV use "
                + (f"{kv * 100:.1f}%" if isinstance(kv, float) else str(kv))
                + f"; a 3-token request sent {sent:.1f} s after them: {answer}"
            )
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _words(rng: random.Random, chars: int) -> str:
    vocab = ("harbor", "ledger", "quarterly", "invoice", "merger", "tender", "clause", "audit", "cargo")
    text = ""
    while len(text) < chars:
        text += rng.choice(vocab) + " " + str(rng.randrange(10_000)) + " "
    return text[:chars]


async def cache_probe(url: str, keys: list[str], doc_chars: int, guess_chars: int) -> None:
    victim: str | None = keys[0] if keys else None
    attacker = keys[1] if len(keys) > 1 else victim
    rng = random.Random()  # a document no earlier run left in the cache
    document = _words(rng, doc_chars)
    wrong = _words(rng, guess_chars)

    async def ask(key: str | None, text: str) -> tuple[int, float]:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
        r = await client.post(url + "/v1/chat/completions", json=body, headers=_auth(key))
        r.raise_for_status()
        usage = r.json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_time"]

    async with httpx.AsyncClient(timeout=300) as client:
        await ask(victim, document)
        probes = {
            "another key, wrong guess": await ask(attacker, wrong),
            "another key, right guess": await ask(attacker, document[:guess_chars]),
            "the same key, right guess": await ask(victim, document[:guess_chars]),
        }
    who = "two keys" if victim != attacker else "no key" if victim is None else "one key"
    print(
        f"prefix-cache probe ({who}; a {doc_chars}-character document, {guess_chars}-character guesses): "
        + "; ".join(f"{name}: cached_tokens {c}, prompt_time {t:.2f} s" for name, (c, t) in probes.items())
    )


# ---------------------------------------------------------------- issue 33: one client stalling the worker

SHORT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "stream": True}


def _gaps(times: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times) if start <= b <= end]


async def _disturbed(url: str, name: str, attack: Callable[[httpx.AsyncClient], Awaitable[str]]) -> None:
    """Run ``attack`` while a victim stream decodes, and send a newcomer's 3-token
    request 0.3 s into it; print the victim's median gap before, its largest gap
    while the attack ran, the newcomer's time to first token, and what the attack
    got. Bounded: the attack and the newcomer at 180 s each."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=10)) as client:
        times: list[float] = []
        victim = asyncio.create_task(_normal_stream(client, url, times, max_tokens=1500))
        async with asyncio.timeout(60):
            while len(times) < 20:  # noqa: ASYNC110 (polled: the stream is decoding)
                await asyncio.sleep(0.05)
        t0 = time.monotonic()
        hostile = asyncio.ensure_future(attack(client))
        await asyncio.sleep(0.3)
        try:
            async with asyncio.timeout(180):
                first, _, _ = await _first_token(client, url, SHORT)
            ttft = f"{first:.2f} s" if first is not None else "no token"
        except TimeoutError:
            ttft = "no token in 180 s"
        try:
            async with asyncio.timeout(180):
                outcome = await hostile
        except TimeoutError:
            hostile.cancel()
            outcome = "still running after 180 s (cancelled)"
        t1 = time.monotonic()
        victim.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await victim
    before = _gaps(times, 0, t0)
    during = _gaps(times, t0, t1 + 0.5)
    median = statistics.median(before) if before else float("nan")
    largest = max(during, default=float("nan"))
    typical = statistics.median(during) if during else float("nan")
    print(
        f"{name}: attack {t1 - t0:.2f} s ({outcome}); victim stream median gap before "
        f"{median * 1000:.0f} ms, during: median {typical * 1000:.0f} ms, largest {largest * 1000:.0f} ms "
        f"({largest / median:.1f}x); newcomer TTFT {ttft}"
    )


async def _statuses(posts: list[Awaitable[httpx.Response]]) -> str:
    got = await asyncio.gather(*posts, return_exceptions=True)
    counts: dict[str, int] = {}
    for r in got:
        key = str(r.status_code) if isinstance(r, httpx.Response) else type(r).__name__
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in sorted(counts.items()))


def _posts(path: str, body: bytes, requests: int) -> Callable[[httpx.AsyncClient], Awaitable[str]]:
    """An attack of ``requests`` concurrent POSTs of ``body`` (built before it starts,
    so that building it costs the measured streams nothing)."""
    headers = {"content-type": "application/json"}

    async def attack(client: httpx.AsyncClient) -> str:
        return await _statuses([client.post(path, content=body, headers=headers) for _ in range(requests)])

    return attack


def stop_attack(count: int, chars: int, requests: int) -> Callable[[httpx.AsyncClient], Awaitable[str]]:
    """``requests`` Messages requests with ``count`` stop sequences of ``chars`` characters each
    (0: none, the baseline of the same requests)."""
    body: dict[str, object] = {
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "Write a long story."}],
    }
    if count:
        body["stop_sequences"] = [f"zq{i:07d}".ljust(chars, "q") for i in range(count)]
    return _posts("/v1/messages", orjson.dumps(body), requests)


def lookup_attack(mb: float, requests: int) -> Callable[[httpx.AsyncClient], Awaitable[str]]:
    """``requests`` ``count_tokens`` of ``mb`` MB of text each."""
    text = ("lorem ipsum dolor sit amet " * int(mb * 2**20 / 27 + 1))[: int(mb * 2**20)]
    body = orjson.dumps({"messages": [{"role": "user", "content": text}]})
    return _posts("/v1/messages/count_tokens", body, requests)


def turns_attack(turns: int, requests: int) -> Callable[[httpx.AsyncClient], Awaitable[str]]:
    """``requests`` Messages requests of ``turns`` one-character messages each."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(turns)]
    messages[-1]["role"] = "user"
    return _posts("/v1/messages", orjson.dumps({"max_tokens": 4, "messages": messages}), requests)


async def status_streams(url: str, stalled_s: float, wait_s: float) -> None:
    """8 ``/v1/status?stream=true`` sockets that never read, then 8 HEAD requests
    with a GET pipelined after them: whether a follower is served after
    ``wait_s`` seconds (the server's ``--stalled-client-timeout`` is ``stalled_s``),
    and whether the GET after the HEADs is answered."""
    host, port = _hostport(url)
    loop = asyncio.get_running_loop()
    socks = []
    request = b"GET /v1/status?stream=true&interval=0.25 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for _ in range(8):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, request)
        socks.append(sock)
    try:
        t0 = time.monotonic()
        follower = "no answer"
        async with httpx.AsyncClient(timeout=10) as client:
            while time.monotonic() - t0 < wait_s:
                async with client.stream("GET", url + "/v1/status?stream=true") as r:
                    follower = str(r.status_code)
                if follower == "200":
                    break
                await asyncio.sleep(1.0)
        took = time.monotonic() - t0
        states = [_tcp_state(s) for s in socks]
    finally:
        for sock in socks:
            sock.close()
    head = b"HEAD /v1/status?stream=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    get = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    reader, writer = await asyncio.open_connection(host, port)
    answered = 0
    body_bytes = 0
    try:
        writer.write(head * 8 + get)
        with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError):
            async with asyncio.timeout(5):
                for _ in range(9):
                    line = await reader.readline()
                    if not line.startswith(b"HTTP/1.1"):
                        body_bytes += len(line)
                        break
                    answered += 1
                    await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()
    print(
        f"status streams (8 that never read, --stalled-client-timeout {stalled_s:g}): a follower got "
        f"{follower} after {took:.1f} s; the 8 sockets: {', '.join(sorted(set(states)))}; "
        f"8 HEAD + 1 GET pipelined: {answered} of 9 answered, {body_bytes} stray body bytes"
    )


async def grammar_fault(url: str, serve_pid: int) -> None:
    """A valid schema (an enum of 30,000) whose checker child is killed mid-check:
    the status and error code it gets. Two checks first start both children, so
    the one killed is checking (running), not starting."""
    schema = {"type": "string", "enum": [f"value-{i}" for i in range(30_000)]}
    rf = {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": rf}
    async with httpx.AsyncClient(timeout=60) as client:
        warm = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=body) for _ in range(2)))
        started = set(_children_running(serve_pid, "proxy.grammar.child", running=False))
        task = asyncio.create_task(client.post(url + "/v1/chat/completions", json=body))
        killed = 0
        deadline = time.monotonic() + 10
        while not task.done() and not killed and time.monotonic() < deadline:
            for pid in set(_children_running(serve_pid, "proxy.grammar.child")) & started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            await asyncio.sleep(0.005)
        r = await task
    err = r.json().get("error", {}) if r.status_code != 200 else {}
    print(
        f"grammar child killed mid-check (enum of 30,000; alone: HTTP {[w.status_code for w in warm]}): "
        f"{killed} killed, HTTP {r.status_code} {err.get('code')} {err.get('message', '')[:60]!r} "
        f"Retry-After {r.headers.get('retry-after')}"
    )


def _children_running(pid: int, needle: str, running: bool = True) -> list[int]:
    """Children of ``pid`` whose command line holds ``needle`` (and, with ``running``,
    that are using the CPU: state R)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and (fields[0] == "R" or not running) and needle.encode() in cmdline:
            out.append(int(stat.parent.name))
    return out


STALL_CASES = ("stops-none", "stops", "stops-allowed", "lookup", "turns")
CASES = (
    "huge",
    "n",
    "gzip",
    "idle",
    "slowloris",
    "inject",
    "host",
    "stalled",
    "starve",
    "cache",
    *STALL_CASES,
    "status-streams",
    "grammar-fault",
)


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
    parser.add_argument(
        "--api-keys", default="", help="comma-separated; cases stalled, starve (the first), cache"
    )
    parser.add_argument("--stalled-readers", type=int, default=2, help="the server's --max-in-flight")
    parser.add_argument("--stalled-s", type=float, default=90.0)
    parser.add_argument("--starve-long", type=int, default=16)
    parser.add_argument("--starve-wait", type=float, default=40.0)
    parser.add_argument("--cache-doc-chars", type=int, default=3000)
    parser.add_argument("--cache-guess-chars", type=int, default=2400)
    parser.add_argument("--stop-count", type=int, default=50_000, help="case stops: stop sequences each")
    parser.add_argument("--stop-requests", type=int, default=8)
    parser.add_argument("--lookup-mb", type=float, default=4.7)
    parser.add_argument("--lookup-requests", type=int, default=4)
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--turns-requests", type=int, default=4)
    parser.add_argument(
        "--stalled-client-timeout", type=float, default=30.0, help="the server's (status-streams)"
    )
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
    if cases & {"huge", "n", "gzip", "stalled", "grammar-fault"} and args.serve_pid is None:
        parser.error("--serve-pid is required for the cases huge, n, gzip, stalled and grammar-fault")
    keys = [k for k in args.api_keys.split(",") if k]
    key = keys[0] if keys else None
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
    if "stalled" in cases:
        asyncio.run(stalled_readers(args.url, args.serve_pid, args.stalled_readers, args.stalled_s, log, key))
    if "starve" in cases:
        asyncio.run(starvation(args.url, args.starve_long, args.starve_wait, key))
    if "cache" in cases:
        asyncio.run(cache_probe(args.url, keys, args.cache_doc_chars, args.cache_guess_chars))
    attacks = {
        "stops-none": (
            f"the same requests without stops ({args.stop_requests} Messages requests)",
            stop_attack(0, 0, args.stop_requests),
        ),
        "stops": (
            f"stop sequences ({args.stop_requests} Messages requests, {args.stop_count} stops each)",
            stop_attack(args.stop_count, 8, args.stop_requests),
        ),
        "stops-allowed": (
            f"stop sequences at the limit ({args.stop_requests} Messages requests, 64 of 256 characters)",
            stop_attack(64, 256, args.stop_requests),
        ),
        "lookup": (
            f"count_tokens ({args.lookup_requests} of {args.lookup_mb:g} MB)",
            lookup_attack(args.lookup_mb, args.lookup_requests),
        ),
        "turns": (
            f"one-character turns ({args.turns_requests} Messages requests of {args.turns} messages)",
            turns_attack(args.turns, args.turns_requests),
        ),
    }
    for case in STALL_CASES:
        if case in cases:
            name, attack = attacks[case]
            asyncio.run(_disturbed(args.url, name, _based(args.url, attack)))
    if "status-streams" in cases:
        asyncio.run(status_streams(args.url, args.stalled_client_timeout, args.stalled_client_timeout + 30))
    if "grammar-fault" in cases:
        asyncio.run(grammar_fault(args.url, args.serve_pid))


def _based(
    url: str, attack: Callable[[httpx.AsyncClient], Awaitable[str]]
) -> Callable[[httpx.AsyncClient], Awaitable[str]]:
    """``attack`` with its relative paths against ``url``, on a client of its own."""

    async def run(_: httpx.AsyncClient) -> str:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=10)) as own:
            return await attack(own)

    return run


if __name__ == "__main__":
    main()
