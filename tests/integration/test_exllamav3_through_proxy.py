"""End to end on the fake generator: the real worker loop (``EngineLoop`` on ipc
sockets, in a thread) runs ``ExLlamaV3Backend``; the real proxy app
(``create_app`` + ``ZmqEngineClient``) serves HTTP. Asserts what a client reads,
also when a step faults (the engine recovers) or the GPU is lost (the worker
exits with status 3 and the proxy turns not ready)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from engine_worker.backend import ENGINE_FAILED_EXIT_STATUS
from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.loop import EngineLoop
from engine_worker.settings import WorkerSettings
from engine_worker.sockets import WorkerSockets
from proxy.app import create_app
from proxy.engine_client import ZmqEngineClient
from proxy.settings import ProxySettings
from tests.fakes import exllamav3 as fx

CHUNK = 256
LONG = "The quick brown fox jumps over the lazy dog. " * 30  # 1350 bytes of content
REPLY = "Paris is the capital of France. " * 3
CONTEXT = 4000

MODEL: list[fx.Model] = []  # the fixture's model, for scripts that break its GPU


def _fault_at(n: int, error: Exception, sticky: bool = False) -> fx.Script:
    """Raise ``error`` out of the batched decode at the ``n``-th token, as a CUDA fault in
    a forward pass would; ``sticky`` also poisons the GPU for every later call."""

    def script(prompt: Sequence[int], generated: Sequence[int]) -> int:
        if len(generated) == n:
            if sticky:
                MODEL[0].device_error = error
            raise error
        return fx.reply(REPLY)(prompt, generated)

    return script


SCRIPT = fx.by_prompt(
    fx.reply(REPLY),
    holdback=fx.reply("It ends with EN"),  # "EN" is held for the stop string "END"
    oom_fault=_fault_at(5, RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")),
    lost_gpu=_fault_at(5, RuntimeError("CUDA error: an illegal memory access was encountered"), True),
)


@dataclass
class Worker:
    backend: ExLlamaV3Backend
    sockets: WorkerSockets
    thread: threading.Thread
    exits: list[BaseException] = field(default_factory=list)
    sockets_open: bool = True

    def close_sockets(self) -> None:
        if self.sockets_open:
            self.sockets_open = False
            self.sockets.close()


@pytest.fixture
def addrs(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path / 'in'}", f"ipc://{tmp_path / 'out'}"


@pytest.fixture
def worker(addrs: tuple[str, str]) -> Iterator[Worker]:
    handle = fx.make_handle(script=SCRIPT, drafting="ngram", max_chunk_size=CHUNK, cache_tokens=8192)
    MODEL[:] = [handle.generator.model]
    backend = ExLlamaV3Backend(
        handle,
        WorkerSettings(
            backend="exllamav3", model_dir=Path("/models/tiny-exl3"), max_seq_len=CONTEXT, max_rq_tokens=256
        ),
    )
    sockets = WorkerSockets(*addrs)
    stop = threading.Event()
    loop = EngineLoop(backend, sockets, heartbeat_interval=0.2, max_queue=64)
    exits: list[BaseException] = []

    def run() -> None:
        try:
            loop.run(stop)
        except BaseException as e:  # SystemExit ends a thread silently: keep it for the test
            exits.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    w = Worker(backend, sockets, thread, exits)
    try:
        yield w
    finally:
        stop.set()
        thread.join(10)
        w.close_sockets()
        backend.close()


@pytest.fixture
async def client(
    aiohttp_client: Any, worker: Worker, addrs: tuple[str, str]
) -> AsyncIterator[TestClient[Any, Any]]:
    config = ProxySettings(
        input_addr=addrs[0], output_addr=addrs[1], heartbeat_timeout=5.0, sse_ping_interval=5.0
    )
    c: TestClient[Any, Any] = await aiohttp_client(create_app(config, ZmqEngineClient(config)))
    for _ in range(200):  # the worker handshake, polled as a Kubernetes probe would
        if (await c.get("/ready")).status == 200:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("proxy never became ready")
    yield c


async def _sse(c: TestClient[Any, Any], path: str, body: dict[str, Any]) -> list[Any]:
    resp = await c.post(path, json=body)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.text()
    assert raw.endswith("data: [DONE]\n\n")
    out: list[Any] = []
    for frame in raw.split("\n\n"):
        if frame.startswith("data: "):
            data = frame[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def _prompt_tokens(text: str) -> int:
    tok = fx.Tokenizer()
    ids = tok.hf_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return int(ids.shape[1])


async def test_streamed_chat_with_progress_usage_and_drafting(client: TestClient[Any, Any]) -> None:
    body = {
        "model": "tiny-exl3",
        "messages": [{"role": "user", "content": LONG}],
        "stream": True,
        "return_progress": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    chunks = await _sse(client, "/v1/chat/completions", body)
    n = _prompt_tokens(LONG)
    progress = [c["prompt_progress"] for c in chunks[:-1] if "prompt_progress" in c]
    # first at the cached count, one per prefill chunk (the engine stops at n - 1), the last at n
    expected = [0, *range(CHUNK, n - 1, CHUNK), n - 1, n]
    assert [p["processed"] for p in progress] == expected
    assert all(p["total"] == n and p["cache"] == 0 for p in progress)
    first_content = next(
        i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content")
    )
    assert all("prompt_progress" not in c for c in chunks[first_content:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-2] if c["choices"])
    assert text == REPLY
    finish = [c["choices"][0]["finish_reason"] for c in chunks[:-2] if c["choices"]]
    assert finish[-1] == "stop" and set(finish[:-1]) == {None}
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] == n and usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["completion_tokens"] == len(REPLY) + 1  # the text's bytes and the stop token
    details = usage["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0  # the reply repeats itself: n-gram hits
    assert isinstance(details["rejected_prediction_tokens"], int)


async def test_repeated_prompt_reports_cached_tokens(client: TestClient[Any, Any]) -> None:
    body = {"messages": [{"role": "user", "content": LONG + " again"}], "temperature": 0}
    first = await (await client.post("/v1/chat/completions", json=body)).json()
    second = await (await client.post("/v1/chat/completions", json=body)).json()
    n = first["usage"]["prompt_tokens"]
    assert n == _prompt_tokens(LONG + " again")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    assert second["choices"][0]["message"]["content"] == REPLY


async def test_text_held_at_a_stop_token_reaches_the_client(client: TestClient[Any, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "holdback please"}], "stop": ["END"]}
    resp = await (await client.post("/v1/chat/completions", json=body)).json()
    assert resp["choices"][0]["message"]["content"] == "It ends with EN"
    assert resp["choices"][0]["finish_reason"] == "stop"
    chunks = await _sse(client, "/v1/chat/completions", {**body, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c["choices"])
    assert text == "It ends with EN"


async def test_max_tokens_gives_length_and_n_shares_the_prompt(client: TestClient[Any, Any]) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 5, "n": 2}
    resp = await (await client.post("/v1/completions", json=body)).json()
    assert [c["text"] for c in resp["choices"]] == [REPLY[:5], REPLY[:5]]
    assert [c["finish_reason"] for c in resp["choices"]] == ["length", "length"]
    prompt_tokens = 1 + len(b"Once upon a time")  # BOS + bytes
    assert resp["usage"]["prompt_tokens"] == prompt_tokens
    assert resp["usage"]["completion_tokens"] == 10


async def test_prompt_longer_than_the_context_is_a_400(client: TestClient[Any, Any]) -> None:
    body = {"prompt": "x" * CONTEXT, "max_tokens": 5}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]


def _stream_body(content: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 50}


async def _failed_stream(c: TestClient[Any, Any], content: str) -> dict[str, Any]:
    """The error of a stream that fails: an error event after the SSE headers, or the
    error response itself when the proxy had not started the stream yet (the fake's
    steps are fast enough for either)."""
    resp = await c.post("/v1/chat/completions", json=_stream_body(content))
    if resp.status != 200:
        err: dict[str, Any] = (await resp.json())["error"]
        return err
    raw = await resp.text()
    events = [orjson.loads(f[6:]) for f in raw.split("\n\n") if f.startswith("data: {")]
    assert raw.endswith("data: [DONE]\n\n") and "error" in events[-1], raw
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices"))
    assert REPLY[:5].startswith(text)
    last: dict[str, Any] = events[-1]["error"]
    return last


async def test_a_fault_in_a_step_fails_that_stream_and_the_worker_serves_on(
    client: TestClient[Any, Any], worker: Worker
) -> None:
    err = await _failed_stream(client, "oom_fault")
    assert "out of memory" in err["message"] and "engine was reset" in err["message"]
    assert err["code"] == "overloaded"  # a 503: the OpenAI SDKs retry it
    assert (await client.get("/ready")).status == 200
    resp = await client.post("/v1/chat/completions", json={**_stream_body("hi"), "stream": False})
    after = await resp.json()
    assert resp.status == 200, after
    assert after["choices"][0]["message"]["content"] == REPLY[:50]
    assert not worker.exits


async def test_a_lost_gpu_fails_the_stream_and_the_worker_exits_not_ready(
    client: TestClient[Any, Any], worker: Worker
) -> None:
    err = await _failed_stream(client, "lost_gpu")
    assert "no longer runs work" in err["message"]
    worker.thread.join(5)
    assert [type(e) for e in worker.exits] == [SystemExit]
    assert worker.exits[0].args == (ENGINE_FAILED_EXIT_STATUS,)
    worker.close_sockets()  # what the process exit does
    for _ in range(100):
        if (await client.get("/ready")).status == 503:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("/ready stayed 200 after the worker exited")
