"""Hostile and careless clients against a running server; prints what they cost the others.

Start a server (``exl3-sidecar serve --port 5000``), then::

    python benchmarks/hostile_clients.py --url http://127.0.0.1:5000 --serve-pid PID

- **huge prompt**: a chat request whose prompt is ``--huge-mb`` MB of text, sent while
  two normal streams decode; prints how long until it is answered (and with what), the
  normal streams' inter-token latency meanwhile, and whether they finished.
- **n**: one request with ``n`` choices on a ``--n-prompt-tokens``-token prompt; prints
  the worker's RSS before, at its peak while it runs, and after.
- **gzip bomb**: four concurrent 1 MB gzip bodies that inflate to 1 GiB; prints the
  proxy's peak RSS (``VmHWM``) and its RSS after.

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
import gzip
import itertools
import statistics
import time
from pathlib import Path

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
    parser.add_argument("--serve-pid", type=int, required=True, help="pid of exl3-sidecar serve")
    parser.add_argument("--huge-mb", type=float, default=10.0)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--n-prompt-tokens", type=int, default=2000)
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
    worker = _child(args.serve_pid)
    asyncio.run(huge_prompt(args.url, args.huge_mb))
    asyncio.run(n_choices(args.url, worker, args.n, args.n_prompt_tokens))
    asyncio.run(gzip_bomb(args.url, args.serve_pid))


if __name__ == "__main__":
    main()
