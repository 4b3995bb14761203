"""No request can hurt the others: what the proxy refuses before it costs
anything (media type, body size and read time, ``n``, a prompt that cannot fit),
when a request takes a ``max_in_flight`` slot, the idle limit, and the
statuses that tell a client to retry (429/503 with ``Retry-After``)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from protocol import PROTOCOL_VERSION, ErrorCode, Ready, RequestError, Started, Submit, TokenDelta
from proxy import errors
from proxy.errors import ProxyError, error_response
from proxy.settings import MIB
from tests.fakes.engine_client import FakeEngineClient, Gate, Step, completion_events
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.dialects.chat.test_http_chat import URL, body, data_of, frames_of

GUARD_S = 10.0  # safety limit for waits that must end; never a speed check
JSON = {"Content-Type": "application/json"}


async def error_of(r: Any) -> dict[str, Any]:
    assert r.content_type == "application/json"
    err: dict[str, Any] = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@contextlib.asynccontextmanager
async def raw_connection(
    client: TestClient[Any, Any],
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def head(path: str, length: int, extra: str = "", content_type: str = "application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\n{extra}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response, read by its ``Content-Length``: after refusing a body the
    server keeps reading (and dropping) it for a while before it closes."""
    async with asyncio.timeout(GUARD_S):
        header = await reader.readuntil(b"\r\n\r\n")
        lines = header.decode().split("\r\n")[:-2]
        fields = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        payload = await reader.readexactly(int(fields["content-length"]))
    return int(lines[0].split()[1]), fields, payload


# ------------------------------------------------------------------ media type


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
async def test_post_without_json_content_type_is_415(
    make_client: MakeClient, fake: FakeEngineClient, content_type: str | None
) -> None:
    """The bodies a cross-site page can POST without a preflight are refused."""
    client = await make_client()
    headers = {"Content-Type": content_type} if content_type else {}
    r = await client.post(URL, data=orjson.dumps(body()), headers=headers)
    assert r.status == 415
    assert (await error_of(r))["code"] == "unsupported_media_type"
    assert fake.submits == []


async def test_json_content_type_with_parameters_is_accepted(make_client: MakeClient) -> None:
    client = await make_client()
    r = await client.post(
        URL, data=orjson.dumps(body()), headers={"Content-Type": "Application/JSON; charset=utf-8"}
    )
    assert r.status == 200


async def test_compressed_body_is_415_before_the_body_is_read(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    """Headers of a gzip body and then nothing: the refusal cannot have waited
    for (let alone inflated) the body."""
    client = await make_client()
    bomb = gzip.compress(b"\0" * (1 << 20))
    async with raw_connection(client) as (reader, writer):
        writer.write(head(URL, 10 * len(bomb), "Content-Encoding: gzip\r\n") + bomb[:100])
        status, headers, payload = await read_response(reader)
    assert status == 415 and headers["connection"] == "close"
    err = orjson.loads(payload)["error"]
    assert err["code"] == "unsupported_media_type" and "gzip" in err["message"]
    assert fake.submits == []
    ok = await client.post(URL, json=body(), headers={"Content-Encoding": "identity"})
    assert ok.status == 200


# ------------------------------------------------------------------ body size and time


async def test_content_length_over_the_limit_is_413_at_once(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client(max_body_mb=0.5)
    async with raw_connection(client) as (reader, writer):
        writer.write(head(URL, MIB))  # and no body at all
        status, headers, payload = await read_response(reader)
    assert status == 413 and headers["connection"] == "close"
    err = orjson.loads(payload)["error"]
    assert err["code"] == "request_too_large" and "max_body_mb" in err["message"]


async def test_chunked_body_over_the_limit_is_413(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client(max_body_mb=0.25)

    async def chunks() -> Any:
        for _ in range(64):
            yield b" " * 8192  # 512 KiB in all, no Content-Length

    r = await client.post(URL, data=chunks(), headers=JSON)
    assert r.status == 413
    assert fake.submits == []


def test_body_limit_is_sized_to_the_context_unless_set() -> None:
    from tests.fakes.engine_client import make_config

    derived = make_config()
    assert derived.body_limit_bytes(None) == 8 * MIB
    assert derived.body_limit_bytes(4096 * 16) == 6 * 4096 * 16 + MIB
    assert make_config(max_body_mb=2).body_limit_bytes(4096 * 16) == 2 * MIB
    assert make_config(max_body_mb=100).body_limit_bytes(None) == 100 * MIB
    # A model that reads images: room for max_images files of max_image_mb in base64.
    images = make_config(max_images=3, max_image_mb=1.5)
    room = 3 * int(1.5 * MIB) * 4 // 3
    assert images.body_limit_bytes(None, images=True) == 8 * MIB + room
    assert images.body_limit_bytes(4096 * 16, images=True) == 6 * 4096 * 16 + MIB + room
    assert make_config(max_body_mb=2).body_limit_bytes(None, images=True) == 2 * MIB


async def test_derived_limit_follows_the_worker(make_client: MakeClient, fake: FakeEngineClient) -> None:
    # 100 tokens of at most 2 characters: prompts over 200 characters cannot fit,
    # bodies over 6 * 200 bytes + 1 MiB are refused before they are read.
    fake.worker_ready = Ready(PROTOCOL_VERSION, "w", "fake-model", "fake", 100, None, longest_token_chars=2)
    client = await make_client()
    async with raw_connection(client) as (reader, writer):
        writer.write(head(URL, 6 * 200 + MIB + 1))
        status, _, payload = await read_response(reader)
    assert status == 413 and "derived from the context" in orjson.loads(payload)["error"]["message"]


async def test_body_that_does_not_arrive_in_time_is_408(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client(body_read_timeout=0.2)
    async with raw_connection(client) as (reader, writer):
        writer.write(head(URL, 1000) + b'{"messages": ')
        status, headers, payload = await read_response(reader)
    assert status == 408 and headers["connection"] == "close"
    err = orjson.loads(payload)["error"]
    assert err["code"] == "request_timeout" and "body_read_timeout" in err["message"]
    assert fake.submits == []


async def test_a_slow_body_holds_no_in_flight_slot(make_client: MakeClient, fake: FakeEngineClient) -> None:
    """The ``max_in_flight`` slot is taken once the body is read and parsed."""
    client = await make_client(max_in_flight=1)
    async with raw_connection(client) as (_, writer):
        writer.write(head(URL, 1000) + b"{")
        await writer.drain()
        await asyncio.sleep(0.05)  # the handler is waiting for the body
        r = await client.post(URL, json=body())
        assert r.status == 200


# ------------------------------------------------------------------ n and prompt length


@pytest.mark.parametrize("path", [URL, "/v1/completions"])
async def test_n_over_max_n_is_400(make_client: MakeClient, fake: FakeEngineClient, path: str) -> None:
    client = await make_client(max_n=2)
    payload: dict[str, Any] = body(n=3) if path == URL else {"prompt": "x", "n": 3}
    r = await client.post(path, json=payload)
    assert r.status == 400
    err = await error_of(r)
    assert err["param"] == "n" and "max_n=2" in err["message"]
    assert fake.submits == []
    payload["n"] = 2
    assert (await client.post(path, json=payload)).status == 200


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        (
            URL,
            {"messages": [{"role": "system", "content": "a" * 150}, {"role": "user", "content": "b" * 51}]},
            "messages",
        ),
        ("/v1/completions", {"prompt": "c" * 201}, "prompt"),
    ],
)
async def test_prompt_longer_than_the_context_can_hold_is_refused_unsent(
    make_client: MakeClient, fake: FakeEngineClient, path: str, payload: dict[str, Any], param: str
) -> None:
    fake.worker_ready = Ready(PROTOCOL_VERSION, "w", "fake-model", "fake", 100, None, longest_token_chars=2)
    client = await make_client()
    r = await client.post(path, json=payload)
    assert r.status == 400
    err = await error_of(r)
    assert (err["code"], err["param"], err["type"]) == (
        "context_length_exceeded",
        param,
        "invalid_request_error",
    )
    assert "201 characters" in err["message"] and "200" in err["message"]
    assert fake.submits == []
    # one character less may fit: it goes to the worker, which counts tokens
    if path == URL:
        payload["messages"][1]["content"] = "b" * 50
    else:
        payload["prompt"] = "c" * 200
    assert (await client.post(path, json=payload)).status == 200
    assert len(fake.submits) == 1


async def test_unknown_token_length_sends_every_prompt(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()  # the fake worker's longest_token_chars is 0: unknown
    assert (
        await client.post(URL, json=body(messages=[{"role": "user", "content": "x" * 50_000}]))
    ).status == 200


LOOKUPS: list[tuple[str, dict[str, Any], str]] = [
    ("/tokenize", {"prompt": "c" * 201}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "c" * 201}]}, "messages"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "c" * 201}]}, "messages"),
]


@pytest.mark.parametrize(("path", "payload", "param"), LOOKUPS)
async def test_lookups_refuse_what_generation_refuses_unsent(
    make_client: MakeClient, fake: FakeEngineClient, path: str, payload: dict[str, Any], param: str
) -> None:
    """A lookup's prompt has the cap of the same prompt on the generation path:
    refused before the worker spends any time tokenizing it."""
    fake.worker_ready = Ready(PROTOCOL_VERSION, "w", "fake-model", "fake", 100, None, longest_token_chars=2)
    client = await make_client()
    r = await client.post(path, json=payload)
    assert r.status == 400
    text = await r.text()
    assert "context_length_exceeded" in text or "201 characters" in text
    assert "201 characters" in text
    assert fake.lookups == []


async def test_tools_count_toward_the_prompt(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.worker_ready = Ready(PROTOCOL_VERSION, "w", "fake-model", "fake", 100, None, longest_token_chars=2)
    client = await make_client()
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 300}}
    r = await client.post(URL, json=body(tools=[tool]))
    assert r.status == 400
    assert (await error_of(r))["code"] == "context_length_exceeded"
    assert fake.submits == []


@pytest.mark.parametrize("path", [URL, "/tokenize", "/v1/messages/count_tokens"])
async def test_more_messages_than_context_tokens_are_refused_unsent(
    make_client: MakeClient, fake: FakeEngineClient, path: str
) -> None:
    """Every turn costs at least a token of template: 101 one-character turns
    cannot fit 100 tokens, whatever their characters."""
    fake.worker_ready = Ready(PROTOCOL_VERSION, "w", "fake-model", "fake", 100, None)
    client = await make_client()
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(101)]
    r = await client.post(path, json={"messages": turns, "max_tokens": 1})
    assert r.status == 400
    assert "101 messages" in await r.text()
    assert fake.submits == [] and fake.lookups == []


async def test_too_many_tools_or_ids(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    r = await client.post(URL, json=body(tools=tools))
    assert r.status == 400
    err = await error_of(r)
    assert err["param"] == "tools" and "at most 128" in err["message"]
    r = await client.post("/detokenize", json={"tokens": [1] * 4097})  # the fake's context: 4096
    assert r.status == 400
    err = await error_of(r)
    assert err["param"] == "tokens" and "4097 ids" in err["message"]
    assert fake.submits == [] and fake.lookups == []


# ------------------------------------------------------------------ retry statuses


@pytest.mark.parametrize(
    ("cls", "status", "retry_after"),
    [
        (errors.QueueFull, 429, "1"),
        (errors.TooManyRequests, 429, "1"),
        (errors.EngineUnavailable, 503, "1"),
        (errors.EngineOverloaded, 503, "1"),
        (errors.EngineNotReady, 503, "5"),
        (errors.EngineDead, 503, "5"),
        (errors.ShuttingDown, 503, "5"),
        (errors.InvalidRequest, 400, None),
        (errors.GatewayTimeout, 504, None),
        (errors.EngineInternalError, 500, None),
    ],
)
def test_retry_after_where_a_retry_can_succeed(
    cls: type[ProxyError], status: int, retry_after: str | None
) -> None:
    resp = error_response(cls("x"))
    assert resp.status == status
    assert resp.headers.get("Retry-After") == retry_after


def rejecting(code: ErrorCode) -> Any:
    def script(s: Submit) -> list[Step]:
        return [RequestError(s.request_id, code, "The engine queue is full (4 requests waiting, max_queue)")]

    return script


@pytest.mark.parametrize("stream", [True, False])
async def test_queue_full_is_429_with_retry_after(
    make_client: MakeClient, fake: FakeEngineClient, stream: bool
) -> None:
    fake.script = rejecting(ErrorCode.QUEUE_FULL)
    client = await make_client()
    r = await client.post(URL, json=body(stream=stream, n=2))
    assert r.status == 429
    assert r.headers["Retry-After"] == "1"
    err = await error_of(r)
    assert err["code"] == "queue_full" and "max_queue" in err["message"]


async def test_unavailable_statuses_carry_retry_after(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    gate = asyncio.Event()
    fake.script = lambda s: [Gate(gate), *completion_events(s.request_id, ["x"])]
    client = await make_client(max_in_flight=1)
    first = asyncio.create_task(client.post(URL, json=body()))
    await fake.wait_submits(1)
    r = await client.post(URL, json=body())
    assert (r.status, r.headers["Retry-After"], (await error_of(r))["code"]) == (
        429,
        "1",
        "too_many_requests",
    )
    gate.set()
    assert (await first).status == 200
    fake.is_ready = False
    r = await client.post(URL, json=body())
    assert (r.status, r.headers["Retry-After"], (await error_of(r))["code"]) == (503, "5", "engine_not_ready")


# ------------------------------------------------------------------ idle limit


def dropped(s: Submit) -> list[Step]:
    """A worker that loses the request: a token, then never a terminal event."""
    return [Started(s.request_id, 3, 0), TokenDelta(s.request_id, "tok", 1)]


async def test_idle_stream_ends_with_an_error_event_and_is_aborted(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = dropped
    client = await make_client(request_idle_timeout=0.3, sse_ping_interval=0.1)
    r = await client.post(URL, json=body(stream=True, n=2))
    assert r.status == 200
    async with asyncio.timeout(GUARD_S):
        frames = frames_of(await r.read())
    items = data_of(frames)
    assert items[-1] == "[DONE]"
    assert items[-2]["error"]["code"] == "timeout"
    assert "request_idle_timeout" in items[-2]["error"]["message"]
    assert b": ping" in frames  # the silence was pinged before it timed out
    rid = fake.submits[0].request_id
    assert sorted(await fake.wait_abort()) == [f"{rid}-0", f"{rid}-1"]


@pytest.mark.parametrize("stream", [True, False])
async def test_idle_before_headers_is_504(
    make_client: MakeClient, fake: FakeEngineClient, stream: bool
) -> None:
    fake.script = lambda s: [] if stream else dropped(s)  # streams: not even a Started
    client = await make_client(request_idle_timeout=0.2)
    r = await client.post(URL, json=body(stream=stream))
    assert r.status == 504
    assert (await error_of(r))["code"] == "timeout"
    assert await fake.wait_abort() == [fake.submits[0].request_id]


async def test_idle_limit_zero_waits_for_the_worker(make_client: MakeClient, fake: FakeEngineClient) -> None:
    gate = asyncio.Event()
    fake.script = lambda s: [*dropped(s), Gate(gate), *completion_events(s.request_id, ["!"])[-2:]]
    client = await make_client(request_idle_timeout=0)
    task = asyncio.create_task(client.post(URL, json=body()))
    await asyncio.sleep(0.3)
    assert not task.done()
    gate.set()
    r = await task
    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "tok!"


# ------------------------------------------------------------------ /ready


async def test_ready_reports_the_worker_load(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.waiting_requests = 3
    fake.kv_cache_usage = 0.123456
    client = await make_client()
    r = await client.get("/ready")
    assert r.status == 200
    assert await r.json() == {
        "status": "ready",
        "model": "fake-model",
        "worker_active_requests": 0,
        "worker_waiting_requests": 3,
        "worker_kv_cache_usage": 0.1235,
    }


@pytest.mark.parametrize("path", [URL, "/v1/messages", "/tokenize", "/v1/messages/count_tokens"])
async def test_expect_continue_over_the_limit_gets_413_not_100(
    make_client: MakeClient, fake: FakeEngineClient, path: str
) -> None:
    """As nginx does: the 413 comes instead of ``100 Continue``, so the client
    never sends the gigabyte it announced."""
    client = await make_client(max_body_mb=1)
    async with raw_connection(client) as (reader, writer):
        writer.write(head(path, 2**30, extra="Expect: 100-continue\r\n"))
        async with asyncio.timeout(GUARD_S):
            first = await reader.readline()
    assert first.startswith(b"HTTP/1.1 413"), first
    # Within the limit: 100 Continue, then the answer.
    data = orjson.dumps(body())
    async with raw_connection(client) as (reader, writer):
        writer.write(head(URL, len(data), extra="Expect: 100-continue\r\n"))
        async with asyncio.timeout(GUARD_S):
            assert (await reader.readline()).startswith(b"HTTP/1.1 100")
            await reader.readline()  # the blank line after it
            writer.write(data)
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
