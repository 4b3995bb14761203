"""``run_proxy``'s shutdown state machine: stop admitting, drain, abort the rest."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import orjson

from protocol import Submit
from proxy.app import run_proxy
from tests.fakes.engine_client import FakeEngineClient, Gate, Step, completion_events, make_config

GUARD_S = 10.0
BODY = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_ready(http: httpx.AsyncClient, base: str) -> None:
    async with asyncio.timeout(GUARD_S):
        while True:
            try:
                if (await http.get(f"{base}/ready")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.02)


async def read_stream(http: httpx.AsyncClient, url: str, started: asyncio.Event) -> list[Any]:
    out: list[Any] = []
    async with http.stream("POST", url, json=BODY) as r:
        assert r.status_code == 200
        started.set()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line == "data: [DONE]" else orjson.loads(line[6:]))
    return out


async def test_drain_lets_in_flight_requests_finish() -> None:
    gate = asyncio.Event()

    def script(s: Submit) -> list[Step]:
        events = completion_events(s.request_id, ["bye"])
        return [*events[:2], Gate(gate), *events[2:]]

    fake = FakeEngineClient(script=script)
    port = free_port()
    stop = asyncio.Event()
    server = asyncio.create_task(run_proxy(make_config(host="127.0.0.1", port=port), fake, stop=stop))
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=GUARD_S) as http:
        await wait_ready(http, base)
        started = asyncio.Event()
        reader = asyncio.create_task(read_stream(http, f"{base}/v1/chat/completions", started))
        async with asyncio.timeout(GUARD_S):
            await started.wait()
        stop.set()
        async with asyncio.timeout(GUARD_S):
            # stop.set() takes effect on the server's next loop turn
            for _ in range(1000):
                r = await http.get(f"{base}/ready")
                if r.status_code != 200:
                    break
                await asyncio.sleep(0.01)
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        refused = await http.post(f"{base}/v1/chat/completions", json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutting_down"
        gate.set()
        items = await reader
    async with asyncio.timeout(GUARD_S):
        await server
    assert items[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in items[:-1]) == "bye"
    assert fake.aborted == []
    assert fake.started and fake.closed


async def test_drain_deadline_aborts_the_rest() -> None:
    never = asyncio.Event()

    def script(s: Submit) -> list[Step]:
        return [*completion_events(s.request_id, [])[:2], Gate(never)]

    fake = FakeEngineClient(script=script)
    port = free_port()
    stop = asyncio.Event()
    cfg = make_config(host="127.0.0.1", port=port, shutdown_drain=0.2)
    server = asyncio.create_task(run_proxy(cfg, fake, stop=stop))
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=GUARD_S) as http:
        await wait_ready(http, base)
        started = asyncio.Event()
        reader = asyncio.create_task(read_stream(http, f"{base}/v1/chat/completions", started))
        async with asyncio.timeout(GUARD_S):
            await started.wait()
        stop.set()
        items = await reader
    async with asyncio.timeout(GUARD_S):
        await server
    assert items[-1] == "[DONE]"
    assert items[-2]["error"]["code"] == "shutting_down"
    assert "shutdown_drain" in items[-2]["error"]["message"]
    assert fake.aborted == [fake.submits[0].request_id]
