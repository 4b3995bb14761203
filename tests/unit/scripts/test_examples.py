"""The example scripts against a server that refuses: the server's message is
what they print, not a client library's traceback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[3]
MESSAGE = "n=2 choices can never run together: this worker runs at most 1 sequences at once (max_batch_size)"
ENVELOPE = {"error": {"message": MESSAGE, "type": "invalid_request_error", "param": "n", "code": None}}


async def _refusing_server(aiohttp_server: Any) -> Any:
    async def refuse(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            await stream.write(b'data: {"error": {"message": "engine died", "code": "engine_dead"}}\n\n')
            await stream.write(b"data: [DONE]\n\n")
            return stream
        return web.json_response(ENVELOPE, status=400)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    app.router.add_post("/v1/completions", refuse)
    return await aiohttp_server(app)


async def test_metrics_vs_usage_reports_the_servers_refusal(aiohttp_server: Any) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import httpx
        import metrics_vs_usage as script
    finally:
        sys.path.pop(0)
    server = await _refusing_server(aiohttp_server)
    base = str(server.make_url("")).rstrip("/")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
    with httpx.Client(timeout=10) as client:
        with pytest.raises(
            script.Refused, match=r"400 n=2 choices can never run together.*invalid_request_error"
        ):
            await asyncio.to_thread(script.usage_of, client, base, body, False)
        with pytest.raises(script.Refused, match=r"engine died \(engine_dead\)"):
            await asyncio.to_thread(script.usage_of, client, base, {**body, "n": 1}, True)


def test_the_repeated_prompt_is_longer_than_two_cache_chunks() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import metrics_vs_usage as script
    finally:
        sys.path.pop(0)
    # ~1.1 tokens per word for SmolLM2's tokenizer on this text; 2 chunks of 256 need 512+
    assert len(script.REPEAT.split()) > 2 * 256 + 64
    repeats = [b for b, _ in script.MIX if b.get("messages", [{}])[0].get("content") == script.REPEAT]
    assert sum(1 for b in repeats if b.get("n", 1) == 1) >= 2  # a hit even under --max-batch-size 1


async def test_agent_round_trip_prints_the_servers_message(aiohttp_server: Any) -> None:
    server = await _refusing_server(aiohttp_server)
    url = str(server.make_url("/v1"))
    r = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(ROOT / "scripts" / "agent_round_trip.py"), url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"the server refused: 400 invalid_request_error: {MESSAGE}"
