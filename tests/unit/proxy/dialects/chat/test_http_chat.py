"""``POST /v1/chat/completions`` and the other routes, over HTTP, on a fake engine."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import ClientResponse

from protocol import ErrorCode, PrefillProgress, RequestError, Started, Submit, TokenDelta
from tests.fakes.engine_client import FakeEngineClient, Gate, Pause, Step, completion_events, static_script
from tests.unit.proxy.conftest import MakeClient, sse_json

URL = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": MSGS, **fields}


def frames_of(raw: bytes) -> list[bytes]:
    """Split a raw SSE body into frames, checking the separator discipline."""
    assert raw.endswith(b"\n\n")
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    return parts[:-1]


def data_of(frames: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for f in frames:
        if f.startswith(b": "):
            continue
        assert f.startswith(b"data: ")
        out.append("[DONE]" if f == b"data: [DONE]" else orjson.loads(f[6:]))
    return out


async def read_frame(resp: ClientResponse) -> bytes:
    return (await resp.content.readuntil(b"\n\n"))[:-2]


def content_of(chunks: list[Any], index: int = 0) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if isinstance(c, dict) and c["choices"] and c["choices"][0]["index"] == index
    )


# ------------------------------------------------------------------ framing


async def test_stream_framing_is_exact(make_client: MakeClient, fake: FakeEngineClient) -> None:
    texts = ["Hel", "lo", ", wor", "ld"]
    fake.script = static_script(texts)
    client = await make_client()
    r = await client.post(URL, json=body(stream=True))
    assert r.status == 200
    assert r.headers["Content-Type"] == "text/event-stream"
    assert r.headers["Cache-Control"] == "no-cache"
    assert r.headers["X-Accel-Buffering"] == "no"
    raw = await r.read()
    assert b"\r" not in raw
    frames = frames_of(raw)
    assert frames[-1] == b"data: [DONE]"
    assert raw.count(b"[DONE]") == 1
    for f in frames[:-1]:
        assert b"\n" not in f
        # compact JSON after exactly "data: "
        assert f == b"data: " + orjson.dumps(orjson.loads(f[6:]))
    chunks = data_of(frames)[:-1]
    assert len(chunks) == len(texts) + 1  # one per text, one with finish_reason
    assert content_of(chunks) == "".join(texts)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert not any("role" in c["choices"][0]["delta"] for c in chunks[1:])
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * len(texts) + ["stop"]
    assert {c["id"] for c in chunks} == {fake.submits[0].request_id}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-model" for c in chunks)
    assert fake.aborted == []


async def test_line_separators_are_escaped_on_the_wire(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    texts = ["a\u2028b", "\u2029", "c\u0085"]
    fake.script = static_script(texts)
    client = await make_client()
    raw = await (await client.post(URL, json=body(stream=True))).read()
    for ch in ("\u2028", "\u2029", "\u0085"):
        assert ch.encode() not in raw
    assert raw.count(b"\\u2028") == 1 and raw.count(b"\\u2029") == 1 and raw.count(b"\\u0085") == 1
    assert content_of(data_of(frames_of(raw))) == "".join(texts)


# ------------------------------------------------------------------ progress


async def test_progress_chunks_have_llama_cpp_shape(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    fake.script = static_script(["x", "y"], prompt_tokens=9, cached_tokens=3, chunk=4)
    client = await make_client()
    chunks = await sse_json(http, str(client.make_url(URL)), body(stream=True, return_progress=True))
    assert chunks[-1] == "[DONE]"
    first = chunks[0]
    expected = [
        {
            "id": first["id"],
            "object": "chat.completion.chunk",
            "created": first["created"],
            "model": "fake-model",
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": None},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            "prompt_progress": {"total": 9, "cache": 3, "processed": p, "time_ms": t},
        }
        for p, t in [(3, 0), (7, 10), (9, 20)]
    ]
    assert chunks[:3] == expected
    assert not any("prompt_progress" in c for c in chunks[3:-1])
    assert content_of(chunks[:-1]) == "xy"


async def test_no_progress_without_flag_or_without_stream(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    client = await make_client()
    chunks = await sse_json(http, str(client.make_url(URL)), body(stream=True))
    assert not any("prompt_progress" in c for c in chunks[:-1])
    r = await client.post(URL, json=body(return_progress=True))
    data = await r.json()
    assert "prompt_progress" not in data
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}


# ------------------------------------------------------------------ usage


async def test_usage_chunk_rules(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    fake.script = static_script(["a", "b", "c"], prompt_tokens=20, cached_tokens=0, tokens_per_text=2)
    client = await make_client()
    url = str(client.make_url(URL))

    plain = (await sse_json(http, url, body(stream=True)))[:-1]
    assert all(c["choices"] and c.get("usage") is None for c in plain)

    with_usage = (await sse_json(http, url, body(stream=True, stream_options={"include_usage": True})))[:-1]
    *rest, last = with_usage
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == 20
    assert last["usage"]["completion_tokens"] == 6
    assert last["usage"]["total_tokens"] == 26
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(c["choices"] and "usage" in c and c["usage"] is None for c in rest)
    assert rest[-1]["choices"][0]["finish_reason"] == "stop"

    opts = {"include_usage": True, "continuous_usage_stats": True}
    running = (await sse_json(http, url, body(stream=True, stream_options=opts)))[:-1]
    assert [c["usage"]["completion_tokens"] for c in running[:-1]] == [2, 4, 6, 6]
    assert running[-1]["choices"] == [] and running[-1]["usage"] == last["usage"]


async def test_stream_and_non_stream_usage_are_equal(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    fake.script = static_script(["p", "q"], prompt_tokens=30, cached_tokens=16, draft=(5, 2))
    client = await make_client()
    streamed = await sse_json(
        http, str(client.make_url(URL)), body(stream=True, stream_options={"include_usage": True})
    )
    r = await client.post(URL, json=body())
    full = await r.json()
    assert streamed[-2]["usage"] == full["usage"]
    assert full["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert full["usage"]["completion_tokens_details"] == {
        "accepted_prediction_tokens": 5,
        "rejected_prediction_tokens": 2,
    }
    assert full["object"] == "chat.completion"
    assert full["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "pq"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]


async def test_no_draft_details_without_drafting(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    usage = (await (await client.post(URL, json=body())).json())["usage"]
    assert "completion_tokens_details" not in usage
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert {"prompt_time", "completion_time", "total_time"} <= usage.keys()


async def test_n_choices_are_merged(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    def script(s: Submit) -> list[Step]:
        i = int(s.request_id.rsplit("-", 1)[1])
        return list(completion_events(s.request_id, [f"c{i}"] * (i + 1), prompt_tokens=12, cached_tokens=4))

    fake.script = script
    client = await make_client()
    chunks = await sse_json(
        http,
        str(client.make_url(URL)),
        body(stream=True, n=3, return_progress=True, stream_options={"include_usage": True}),
    )
    rid = chunks[0]["id"]
    (submit,) = fake.submits  # one Submit carries every choice
    assert (submit.request_id, submit.n) == (rid, 3)
    assert [c.request_id for c in fake.choices] == [f"{rid}-{i}" for i in range(3)]
    for i in range(3):
        assert content_of(chunks[:-2], i) == f"c{i}" * (i + 1)
        finishes = [
            c for c in chunks[:-2] if c["choices"][0]["index"] == i and c["choices"][0]["finish_reason"]
        ]
        assert len(finishes) == 1
    assert all(c["choices"][0]["index"] == 0 for c in chunks if "prompt_progress" in c)
    assert len([c for c in chunks if "prompt_progress" in c]) == 3  # 12 prompt, 4 cached, chunks of 4
    usage = chunks[-2]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (12, 1 + 2 + 3)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}', None),
        (b'{"model": "m"}', "messages"),
        (b'{"messages": {"role": "user"}}', "messages"),
        (orjson.dumps(body(max_tokens=-1)), "max_tokens"),
        (orjson.dumps(body(max_tokens="10")), "max_tokens"),
        (orjson.dumps(body(n=0)), "n"),
        (orjson.dumps(body(temperature=9)), "temperature"),
        (b"", None),
    ],
)
async def test_bad_input_is_400_and_the_server_keeps_serving(
    make_client: MakeClient, fake: FakeEngineClient, raw: bytes, param: str | None
) -> None:
    client = await make_client()
    r = await client.post(URL, data=raw, headers={"Content-Type": "application/json"})
    assert r.status == 400
    assert r.content_type == "application/json"
    err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert fake.submits == []
    ok = await client.post(URL, json=body())
    assert ok.status == 200


def rejecting(code: ErrorCode, message: str) -> Any:
    def script(s: Submit) -> list[Step]:
        return [RequestError(s.request_id, code, message, "messages")]

    return script


@pytest.mark.parametrize("stream", [True, False])
async def test_context_length_exceeded_is_400(
    make_client: MakeClient, fake: FakeEngineClient, stream: bool
) -> None:
    fake.script = rejecting(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt has 5000 tokens, the context 4096")
    client = await make_client()
    r = await client.post(URL, json=body(stream=stream))
    assert r.status == 400
    assert r.content_type == "application/json"
    assert await r.json() == {
        "error": {
            "message": "prompt has 5000 tokens, the context 4096",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }


async def test_overloaded_is_503(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = rejecting(ErrorCode.OVERLOADED, "queue full")
    client = await make_client()
    r = await client.post(URL, json=body(stream=True))
    assert r.status == 503
    assert (await r.json())["error"]["code"] == "overloaded"


async def test_error_after_headers_is_one_event_then_done(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    def script(s: Submit) -> list[Step]:
        rid = s.request_id
        return [
            Started(rid, 3, 0),
            TokenDelta(rid, "partial", 1),
            RequestError(rid, ErrorCode.INTERNAL, "GPU fell"),
        ]

    fake.script = script
    client = await make_client()
    r = await client.post(URL, json=body(stream=True))
    assert r.status == 200
    frames = frames_of(await r.read())
    items = data_of(frames)
    assert items[-1] == "[DONE]"
    assert items[-2] == {
        "error": {"message": "GPU fell", "type": "server_error", "param": None, "code": "internal_error"}
    }
    assert content_of(items[:-2]) == "partial"
    # the failed request is aborted in the worker (a no-op there, but nothing leaks)
    assert fake.aborted == [fake.submits[0].request_id]


async def test_engine_dead_mid_stream(make_client: MakeClient, fake: FakeEngineClient) -> None:
    gate = asyncio.Event()

    def script(s: Submit) -> list[Step]:
        return [Started(s.request_id, 3, 0), TokenDelta(s.request_id, "tok", 1), Gate(gate)]

    fake.script = script
    client = await make_client()
    r = await client.post(URL, json=body(stream=True))
    assert r.status == 200
    first = orjson.loads((await read_frame(r))[6:])
    assert first["choices"][0]["delta"]["content"] == "tok"
    fake.kill()
    rest = data_of(frames_of(await r.read()))
    assert rest[-1] == "[DONE]"
    assert rest[-2]["error"]["code"] == "engine_dead"
    assert len(rest) == 2


async def test_engine_dead_before_headers_is_503(make_client: MakeClient, fake: FakeEngineClient) -> None:
    gate = asyncio.Event()
    fake.script = lambda s: [Gate(gate)]
    client = await make_client()
    task = asyncio.create_task(client.post(URL, json=body(stream=True)))
    await fake.wait_submits(1)
    fake.kill()
    r = await task
    assert r.status == 503
    assert (await r.json())["error"]["code"] == "engine_dead"


async def test_not_ready(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.is_ready = False
    fake.worker_ready = None
    client = await make_client()
    assert (await client.get("/health")).status == 200
    r = await client.get("/ready")
    assert r.status == 503 and (await r.json())["status"] == "not_ready"
    r = await client.post(URL, json=body(stream=True))
    assert r.status == 503
    assert (await r.json())["error"]["code"] == "engine_not_ready"
    assert (await client.get("/v1/models")).status == 503
    fake.is_ready = True
    from tests.fakes.engine_client import WORKER

    fake.worker_ready = WORKER
    r = await client.get("/ready")
    assert r.status == 200 and (await r.json()) == {
        "status": "ready",
        "model": "fake-model",
        "worker_active_requests": 0,
        "worker_waiting_requests": 0,
        "worker_kv_cache_usage": 0.0,
    }
    assert (await client.post(URL, json=body())).status == 200


async def test_in_flight_cap(make_client: MakeClient, fake: FakeEngineClient) -> None:
    gate = asyncio.Event()

    def script(s: Submit) -> list[Step]:
        return [Gate(gate), *completion_events(s.request_id, ["done"])]

    fake.script = script
    client = await make_client(max_in_flight=1)
    first = asyncio.create_task(client.post(URL, json=body()))
    await fake.wait_submits(1)
    r = await client.post(URL, json=body())
    assert r.status == 429 and r.headers["Retry-After"] == "1"
    err = (await r.json())["error"]
    assert "max_in_flight=1" in err["message"]
    assert err["code"] == "too_many_requests"
    gate.set()
    assert (await (await first).json())["choices"][0]["message"]["content"] == "done"
    assert (await client.post(URL, json=body())).status == 200


async def test_keep_alive_pings(make_client: MakeClient, fake: FakeEngineClient) -> None:
    def script(s: Submit) -> list[Step]:
        rid = s.request_id
        return [Pause(0.3), *completion_events(rid, [])[:-1], Pause(0.3), *completion_events(rid, ["z"])[-2:]]

    fake.script = script
    client = await make_client(sse_ping_interval=0.02)
    raw = await (await client.post(URL, json=body(stream=True, return_progress=True))).read()
    frames = frames_of(raw)
    assert b"\r" not in raw
    # silent before the first event: headers went out with a ping first
    assert frames[0] == b": ping"
    assert all(f == b": ping" or f.startswith(b"data: ") for f in frames)
    kinds = ["ping" if f == b": ping" else "data" for f in frames]
    first_data = kinds.index("data")
    # and again during the silent pause between prefill and the first token
    assert "ping" in kinds[first_data:]
    assert frames[-1] == b"data: [DONE]"
    assert content_of(data_of(frames)[:-1]) == "z"


async def test_models(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    data = await (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data["data"]] == [
        ("fake-model", "model", 4096)
    ]
    assert (await client.get("/v1/models/fake-model")).status == 200
    # Any name the POST endpoints serve is a model here too (one rule, issue 19).
    r = await client.get("/v1/models/any")
    card = await r.json()
    assert r.status == 200
    assert (card["id"], card["root"], card["max_model_len"]) == ("any", "fake-model", 4096)
    served = await (await client.post(URL, json={**body(), "model": "any"})).json()
    assert served["model"] == "fake-model"


async def test_served_model_name(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client(served_model_name="alias")
    assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "alias"
    assert (await (await client.post(URL, json=body())).json())["model"] == "alias"


async def test_unknown_route_and_method_use_the_envelope(make_client: MakeClient) -> None:
    client = await make_client()
    r = await client.get("/v1/nope")
    assert r.status == 404 and (await r.json())["error"]["type"] == "invalid_request_error"
    r = await client.get(URL)
    assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"


# ------------------------------------------------------------------ disconnects


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_disconnect_aborts_the_engine_request(
    make_client: MakeClient, fake: FakeEngineClient, phase: str
) -> None:
    never = asyncio.Event()

    def script(s: Submit) -> list[Step]:
        rid = s.request_id
        steps: list[Step] = [Started(rid, 50, 0), PrefillProgress(rid, 50, 0, 0, 0)]
        if phase == "decode":
            steps += [PrefillProgress(rid, 50, 0, 50, 7), TokenDelta(rid, "tok", 1)]
        return [*steps, Gate(never)]

    fake.script = script
    client = await make_client()
    r = await client.post(URL, json=body(stream=True, return_progress=True))
    frame = orjson.loads((await read_frame(r))[6:])
    if phase == "decode":
        while not frame["choices"][0]["delta"].get("content"):
            frame = orjson.loads((await read_frame(r))[6:])
    else:
        assert frame["prompt_progress"]["processed"] == 0
    r.close()
    assert await fake.wait_abort() == [frame["id"]]
    assert fake.submits[0].request_id == frame["id"]


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_before_headers_aborts(
    make_client: MakeClient, fake: FakeEngineClient, stream: bool
) -> None:
    never = asyncio.Event()
    fake.script = lambda s: [Gate(never)]
    client = await make_client()
    payload = orjson.dumps(body(stream=stream))
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    await fake.wait_submits(1)
    writer.close()
    await writer.wait_closed()
    assert await fake.wait_abort() == [fake.submits[0].request_id]
    assert await reader.read() == b""


async def test_pings_while_events_make_no_chunk(make_client: MakeClient, fake: FakeEngineClient) -> None:
    def script(s: Submit) -> list[Step]:
        rid = s.request_id
        held: list[Step] = []
        for _ in range(8):  # text held back (e.g. a partial stop string): empty deltas
            held += [Pause(0.05), TokenDelta(rid, "", 1)]
        return [Started(rid, 2, 0), TokenDelta(rid, "a", 1), *held, *completion_events(rid, ["b"])[-2:]]

    fake.script = script
    client = await make_client(sse_ping_interval=0.1)
    frames = frames_of(await (await client.post(URL, json=body(stream=True))).read())
    kinds = ["ping" if f == b": ping" else "data" for f in frames]
    first_content = kinds.index("data")
    assert "ping" in kinds[first_content + 1 : -3]
    assert content_of(data_of(frames)[:-1]) == "ab"
