"""End to end on the fake generator: the real worker loop (``EngineLoop`` on ipc
sockets, in a thread) runs ``ExLlamaV3Backend``; the real proxy app
(``create_app`` + ``ZmqEngineClient``) serves HTTP. Asserts what a client reads,
also when a step faults (the engine recovers) or the GPU is lost (the worker
exits with status 3 and the proxy turns not ready), and what reached the engine:
grammars as 1.6.5 filters, tools in the prompt the chat template rendered. The
model's template is Qwen-style (``fx.QWEN_TOOLS_TEMPLATE``): it renders tools, so
the proxy sends them to the worker (``Submit.tools_json``)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

import proxy.serving.serve
from engine_worker.backend import ENGINE_FAILED_EXIT_STATUS
from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.loop import EngineLoop
from engine_worker.settings import WorkerSettings
from engine_worker.sockets import WorkerSockets
from proxy.app import create_app
from proxy.engine.client import ZmqEngineClient
from proxy.grammar.check import json_schema_grammar
from proxy.settings import ProxySettings
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import RecordingGenerator, make_backend

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


TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

SCRIPT = fx.by_prompt(
    fx.reply(REPLY),
    holdback=fx.reply("It ends with EN"),  # "EN" is held for the stop string "END"
    oom_fault=_fault_at(5, RuntimeError("CUDA out of memory. Tried to allocate 8.00 GiB")),
    lost_gpu=_fault_at(5, RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    json_city=fx.reply('{"city": "Paris"}'),
    yes_or_no=fx.reply("maybe"),
    # the tools block of the system turn: the model answers with a call
    **{"<tools>": fx.reply(TOOL_CALL)},
)


@dataclass
class Worker:
    backend: ExLlamaV3Backend
    sockets: WorkerSockets
    thread: threading.Thread
    rec: RecordingGenerator
    exits: list[BaseException] = field(default_factory=list)
    sockets_open: bool = True

    def jobs(self) -> list[Any]:
        """The engine jobs started so far, in order."""
        return [r["job"] for r in self.rec.results if r["stage"] == "started"]

    def close_sockets(self) -> None:
        if self.sockets_open:
            self.sockets_open = False
            self.sockets.close()


@pytest.fixture
def addrs(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path / 'in'}", f"ipc://{tmp_path / 'out'}"


@contextmanager
def running_worker(
    backend: ExLlamaV3Backend, rec: RecordingGenerator, addrs: tuple[str, str]
) -> Iterator[Worker]:
    """The worker loop over ``backend`` on ``addrs``, in a thread, until the block ends."""
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
    w = Worker(backend, sockets, thread, rec, exits)
    try:
        yield w
    finally:
        stop.set()
        thread.join(10)
        w.close_sockets()
        backend.close()


@pytest.fixture
def worker(addrs: tuple[str, str]) -> Iterator[Worker]:
    backend, rec = make_backend(
        WorkerSettings(
            backend="exllamav3", model_dir=Path("/models/tiny-exl3"), max_seq_len=CONTEXT, max_rq_tokens=256
        ),
        script=SCRIPT,
        drafting="ngram",
        max_chunk_size=CHUNK,
        cache_tokens=8192,
        chat_template=fx.QWEN_TOOLS_TEMPLATE,
    )
    MODEL[:] = [rec.inner.model]
    with running_worker(backend, rec, addrs) as w:
        yield w


async def proxy_client(aiohttp_client: Any, addrs: tuple[str, str]) -> TestClient[Any, Any]:
    """The real proxy app over the worker at ``addrs``, once it reads ready."""
    config = ProxySettings(
        input_addr=addrs[0], output_addr=addrs[1], heartbeat_timeout=5.0, sse_ping_interval=5.0
    )
    c: TestClient[Any, Any] = await aiohttp_client(create_app(config, ZmqEngineClient(config)))
    for _ in range(200):  # the worker handshake, polled as a Kubernetes probe would
        if (await c.get("/ready")).status == 200:
            return c
        await asyncio.sleep(0.05)
    raise AssertionError("proxy never became ready")


@pytest.fixture
async def client(
    aiohttp_client: Any, worker: Worker, addrs: tuple[str, str]
) -> AsyncIterator[TestClient[Any, Any]]:
    yield await proxy_client(aiohttp_client, addrs)


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


# ------------------------------------------------------------------ grammars, logprobs, tools


def _content(chunks: list[Any]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1] if c.get("choices"))


async def test_a_json_schema_request_runs_under_a_grammar_filter(
    client: TestClient[Any, Any], worker: Worker
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    body = {
        "messages": [{"role": "user", "content": "json_city please"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    resp = await client.post("/v1/chat/completions", json=body)
    out = await resp.json()
    assert resp.status == 200, out
    assert out["choices"][0]["message"]["content"] == '{"city": "Paris"}'
    assert out["choices"][0]["finish_reason"] == "stop"
    (job,) = worker.jobs()
    (flt,) = job.filters
    assert isinstance(flt, fx.LLGuidanceFilter) and flt.eos_after_completed
    assert flt._grammar == json_schema_grammar(schema)
    # the grammar completed at "}" and ended the job (generator/job.py:1001-1002)
    assert [r["eos_reason"] for r in worker.rec.results if r.get("eos")] == ["end_filter"]


async def test_the_grammar_overrides_the_model(client: TestClient[Any, Any]) -> None:
    schema = {"type": "string", "enum": ["yes", "no"]}
    body = {
        "messages": [{"role": "user", "content": "yes_or_no?"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        "stream": True,
    }
    chunks = await _sse(client, "/v1/chat/completions", body)
    assert _content(chunks) == '"no"'  # the model said "maybe"; the mask allowed only the enum


async def test_a_bad_schema_is_a_400_naming_the_field(
    client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": bad}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "response_format.json_schema"  # the proxy's check

    # Without the proxy's check the worker compiles it against the model's tokenizer and refuses it.
    async def unchecked(grammar: str, param: str) -> None:
        return None

    monkeypatch.setattr(proxy.serving.serve, "validate", unchecked)
    for stream in (False, True):
        resp = await client.post("/v1/chat/completions", json={**body, "stream": stream})
        err = (await resp.json())["error"]
        assert resp.status == 400, err
        assert err["param"] == "response_format.json_schema" and err["message"].startswith("invalid grammar")


async def test_logprobs_join_to_the_content_non_stream(client: TestClient[Any, Any]) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 2,
        "temperature": 0,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    out = await resp.json()
    assert resp.status == 200, out
    choice = out["choices"][0]
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"] == REPLY
    for e, ch in zip(entries, REPLY.encode(), strict=True):
        assert e["bytes"] == [ch]
        assert e["logprob"] == pytest.approx(math.log(fx.raw_probs(ch)[ch]), rel=1e-6)
        assert [t["token"] for t in e["top_logprobs"]] == [chr(ch), chr(ch + 1)]


async def test_logprobs_join_to_the_content_of_each_chunk(client: TestClient[Any, Any]) -> None:
    body = {
        "messages": [{"role": "user", "content": "holdback please"}],
        "stop": ["END"],
        "logprobs": True,
        "stream": True,
    }
    chunks = await _sse(client, "/v1/chat/completions", body)
    joined = ""
    for c in chunks[:-1]:
        if not c.get("choices"):
            continue
        delta, lp = c["choices"][0]["delta"], c["choices"][0]["logprobs"]
        if delta.get("content"):
            tokens = "".join(e["token"] for e in lp["content"])
            assert tokens == delta["content"]
            joined += tokens
    assert joined == _content(chunks) == "It ends with EN"  # "EN" was held for "END" until EOS


async def test_tools_are_rendered_into_the_prompt_by_the_chat_template(
    client: TestClient[Any, Any], worker: Worker
) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
    resp = await client.post("/v1/chat/completions", json=body)
    out = await resp.json()
    assert resp.status == 200, out
    (call,) = out["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    # the second turn: the call and its result go back through the template
    history = [
        *body["messages"],
        {"role": "assistant", "content": None, "tool_calls": [{**call}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "22 C, sunny"},
    ]
    resp = await client.post("/v1/chat/completions", json={**body, "messages": history})
    assert resp.status == 200, await resp.text()
    first, second = (fx.Tokenizer._decode(job.client_prompt, True) for job in worker.jobs())
    parameters = json.dumps(TOOLS[0]["function"]["parameters"])  # type: ignore[index]
    for prompt in (first, second):
        assert "<tools>" in prompt and '"name": "get_weather"' in prompt and parameters in prompt
    assert TOOL_CALL in second  # the earlier call, re-rendered by the template
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in second


async def test_tool_call_arguments_stream_as_the_model_writes_them(client: TestClient[Any, Any]) -> None:
    # The fake writes the call a token at a time: the arguments come in pieces,
    # the first of them long before the call's end tag.
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "stream": True}
    chunks = [c for c in await _sse(client, "/v1/chat/completions", body) if c != "[DONE]"]
    deltas = [
        call
        for chunk in chunks
        for choice in chunk.get("choices", [])
        for call in choice["delta"].get("tool_calls") or []
    ]
    header, *fragments = deltas
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert len(fragments) > 3, fragments
    assert json.loads("".join(f["function"]["arguments"] for f in fragments)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
