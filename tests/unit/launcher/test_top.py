"""``exl3-sidecar top`` against the real proxy app on a fake worker whose requests
are held at chosen points: plain lines in a pipe, the live view on a
pseudo-terminal (keys included), errors and options. Expected numbers come from
the fake worker's script (``tests.unit.proxy.ops.test_status.Held``)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp.test_utils import TestServer
from click.testing import CliRunner, Result

from launcher.cli import main
from launcher.top.model import Rates, RateWindow, rates, short_id, sort_requests
from launcher.top.terminal import queue_bar
from proxy.app import create_app
from proxy.ops.status_types import ProxyStatus, QueueStatus, RequestStatus, Status, TotalsStatus
from proxy.server.state import STATE
from tests.fakes.engine_client import FakeEngineClient, make_config
from tests.unit.launcher.test_chat import clean_environment  # noqa: F401  (autouse here too)
from tests.unit.launcher.test_chat_terminal import _read_all
from tests.unit.proxy.ops.test_status import PREFILL, Held

KINDS = ("q2", "decode", "q1", "prefill")


class Served:
    def __init__(self, server: TestServer, fake: FakeEngineClient, held: Held) -> None:
        self.server = server
        self.fake = fake
        self.held = held
        self.base_url = str(server.make_url("/v1"))
        self.tasks: list[asyncio.Task[Any]] = []


@pytest.fixture
async def served(aiohttp_server: Any) -> AsyncIterator[Served]:
    """The proxy app with four requests in flight: one decoding, one in prefill, two queued."""
    held = Held()
    fake = FakeEngineClient(script=held)
    app = create_app(make_config(served_model_name="served-model"), fake)
    server: TestServer = await aiohttp_server(app)
    s = Served(server, fake, held)
    async with httpx.AsyncClient(timeout=30) as http:

        async def post(kind: str) -> int:
            body = {"model": "m", "messages": [{"role": "user", "content": kind}]}
            return (await http.post(s.base_url + "/chat/completions", json=body)).status_code

        s.tasks = [asyncio.create_task(post(k)) for k in KINDS]
        async with asyncio.timeout(10):
            while True:
                if len(fake.choices) == len(KINDS) and _all_held(app):
                    break
                await asyncio.sleep(0.01)
        yield s
        held.release.set()
        assert await asyncio.gather(*s.tasks) == [200] * len(KINDS)


def _all_held(app: Any) -> bool:
    from proxy.ops.inflight import INFLIGHT

    stages = sorted(str(t.view().stage) for t in app[INFLIGHT].requests.values())
    return stages == ["decode", "prefill", "queued", "queued"]


async def run_cli(args: list[str], env: dict[str, str | None] | None = None) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, main, args, env=env)


async def test_once_prints_the_worker_and_every_request(served: Served) -> None:
    r = await run_cli(["top", "--once", "--base-url", served.base_url])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("--- ") and lines[0].endswith(" ---")
    assert lines[1].startswith("worker: served-model (fake) up ") and lines[1].endswith(" ago")
    assert lines[2].startswith("load: running ") and lines[2].endswith("queued 0")
    assert lines[3].startswith("in flight 4/256 · rates — · done 0 (0 failed) · cached ")
    del lines[0]
    stages = [line.split("  ")[2] for line in lines[3:]]
    assert stages == ["decode", "prefill", "queued", "queued"]
    prefill = lines[4]
    p = PREFILL
    rate = (p["processed"] - p["cached"]) / (p["time_ms"] / 1000)
    assert f"{p['processed']}/{p['prompt']} tokens (cached {p['cached']}), {rate:.0f} tok/s" in prefill
    assert "position 1 of 2, waited " in lines[5] and "eta 1.50 s" in lines[5]
    assert "position 2 of 2, waited " in lines[6] and "eta" not in lines[6]
    assert "3 tokens" in lines[3] and "ttft " in lines[3]
    assert "\x1b" not in r.output


async def test_a_pipe_gets_a_block_per_snapshot_until_the_server_drains(served: Served) -> None:
    state = served.server.app[STATE]
    task = asyncio.create_task(run_cli(["top", "--base-url", served.base_url, "--interval", "0.25"]))
    await asyncio.sleep(0.9)
    state.draining = True
    r = await asyncio.wait_for(task, 30)
    state.draining = False
    assert r.exit_code == 0, r.output
    blocks = [b for b in r.stdout.split("--- ") if b]
    assert len(blocks) >= 3
    # From the second snapshot on, rates over the snapshots so far (the held
    # requests make no tokens: zero, but measured).
    assert "rates —" in blocks[0] and "0.00 req/s · prefill 0.0 tok/s · decode 0.0 tok/s" in blocks[1]


async def test_the_live_view_on_a_pseudo_terminal(served: Served) -> None:
    primary, secondary = os.openpty()
    screen = b""
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "launcher",
            "top",
            "--base-url",
            served.base_url,
            "--interval",
            "0.25",
            stdin=secondary,
            stdout=secondary,
            stderr=secondary,
            env=os.environ | {"TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"},
        )
        os.close(secondary)
        secondary = -1
        screen = await asyncio.to_thread(_read_until, primary, [b"1 of 2", b"2 of 2", b"sorted by stage"])
        os.write(primary, b"s")
        screen += await asyncio.to_thread(_read_until, primary, [b"sorted by age"])
        os.write(primary, b"q")
        screen += await asyncio.to_thread(_read_all, primary)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, screen
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    text = screen.decode(errors="replace")
    assert "\x1b[?1049h" in text  # the alternate screen, left on exit
    assert "\x1b[?1049l" in text
    for word in ("served-model", "decode", "prefill", "queued", "━", "Traceback"):
        assert (word in text) is (word != "Traceback"), word


def _read_until(fd: int, wanted: list[bytes], timeout_s: float = 30.0) -> bytes:
    """Read the terminal until every one of ``wanted`` was seen."""
    got = b""
    deadline = time.monotonic() + timeout_s
    while not all(w in got for w in wanted):
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen {wanted!r} in {got[-3000:]!r}")
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        got += data
    return got


async def test_a_key_is_sent_and_a_refusal_is_one_line(aiohttp_server: Any) -> None:
    app = create_app(make_config(api_key="sk-top-1"), FakeEngineClient())
    server: TestServer = await aiohttp_server(app)
    url = str(server.make_url("/v1"))
    r = await run_cli(["top", "--once", "--base-url", url])
    assert r.exit_code == 1
    assert r.stderr.startswith("error: ") and "(HTTP 401, invalid_api_key)" in r.stderr
    r = await run_cli(["top", "--once", "--base-url", url], env={"EXL3_SIDECAR_API_KEY": "sk-top-1"})
    assert r.exit_code == 0, r.output


async def test_a_server_without_the_endpoint(aiohttp_server: Any) -> None:
    from aiohttp import web

    server: TestServer = await aiohttp_server(web.Application())
    r = await run_cli(["top", "--once", "--base-url", str(server.make_url("/v1"))])
    assert r.exit_code == 1
    assert r.stderr == "error: this server has no GET /v1/status (is it exl3-sidecar?) (HTTP 404)\n"


async def test_port_is_the_local_server_as_for_chat(served: Served) -> None:
    """``--port N`` is ``--base-url http://127.0.0.1:N/v1`` as for ``chat``; both is a usage error."""
    port = served.server.port
    r = await run_cli(["top", "--once", "--port", str(port)])
    assert r.exit_code == 0, r.stderr
    both = await run_cli(["top", "--once", "--port", str(port), "--base-url", f"http://127.0.0.1:{port}/v1"])
    assert both.exit_code == 2


def _status(t: float, requests: int, prefilled: int, completion: int, reqs: list[RequestStatus]) -> Status:
    return Status(
        time=t,
        proxy=ProxyStatus(uptime_s=1, in_flight=len(reqs), max_in_flight=8, draining=False, status_streams=1),
        worker=None,
        totals=TotalsStatus(
            requests=requests,
            failed=0,
            prompt_tokens=0,
            cached_tokens=0,
            prefilled_tokens=prefilled,
            completion_tokens=completion,
            draft_accepted=0,
            draft_rejected=0,
        ),
        requests=reqs,
    )


def _req(rid: str, stage: str, age: float, tokens: int = 0, rate: float | None = None, pos: int = 0) -> Any:
    queue = QueueStatus(position=pos, queued=3, waited_s=age, eta_s=None) if pos else None
    return RequestStatus(
        id=rid,
        dialect="chat",
        endpoint="/v1/chat/completions",
        stream=True,
        choices=1,
        stage=stage,
        age_s=age,
        queue=queue,
        prefill=None,
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=tokens,
        decode_tok_s=rate,
        ttft_s=None,
        draft_accepted=None,
        draft_rejected=None,
    )


def test_rates_are_differences_over_time() -> None:
    a = _status(100.0, 3, 1000, 50, [])
    b = _status(102.0, 4, 1600, 90, [])
    r = rates(a, b)
    assert r is not None
    assert (r.requests, r.prefill, r.decode) == (0.5, 300.0, 20.0)
    assert rates(None, b) is None and rates(b, b) is None
    assert rates(b, a) is None  # the counters went back: a restarted proxy


def test_the_window_rates_over_its_oldest_snapshot() -> None:
    window = RateWindow(window_s=2.0)
    assert window.add(_status(0.0, 0, 0, 0, [])) is None
    assert window.add(_status(1.0, 0, 0, 10, [])) == Rates(0.0, 0.0, 10.0)
    assert window.add(_status(2.0, 0, 0, 30, [])) == Rates(0.0, 0.0, 15.0)  # 30 tokens over 2 s
    # The first snapshot leaves the window: the rate is over 1 s to 3 s.
    assert window.add(_status(3.0, 1, 100, 70, [])) == Rates(0.5, 50.0, 30.0)


def test_sort_orders() -> None:
    reqs = [
        _req("q2", "queued", 6.0, pos=2),
        _req("d-slow", "decode", 5.0, tokens=10, rate=5.0),
        _req("q1", "queued", 2.0, pos=1),
        _req("p", "prefill", 3.0),
        _req("d-fast", "decode", 4.0, tokens=40, rate=20.0),
    ]
    ids = lambda by: [r.id for r in sort_requests(reqs, by)]  # noqa: E731
    assert ids("stage") == ["d-slow", "d-fast", "p", "q1", "q2"]
    assert ids("age") == ["q2", "d-slow", "d-fast", "p", "q1"]
    assert ids("tokens")[:2] == ["d-fast", "d-slow"]
    assert ids("rate")[:2] == ["d-fast", "d-slow"]


def test_short_ids_and_the_queue_bar() -> None:
    assert short_id("chatcmpl-0123456789abcdef") == "chatcmpl-01234567"
    assert short_id("msg_0123456789abcdef") == "msg_01234567"
    # Position 1 of 2 is at the front: a full bar; position 2 of 2 half of one.
    assert _cells(queue_bar(1, 2, 10)) == [(10, "yellow")]
    assert _cells(queue_bar(2, 2, 10)) == [(5, "yellow"), (5, "grey37")]
    assert _cells(queue_bar(3, 3, 9)) == [(3, "yellow"), (6, "grey37")]


def _cells(bar: Any) -> list[tuple[int, str]]:
    return [(s.end - s.start, str(s.style)) for s in bar.spans]
