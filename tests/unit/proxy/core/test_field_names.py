"""Every error a client sees names its own field, whichever layer raised it, and
whether progress is sent is decided once by the core, for every dialect."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from protocol import ErrorCode, RequestError, Started, Submit, TokenDelta
from proxy.dialects.registry import ROUTES
from proxy.errors import ContextLengthExceeded, FieldNames, InvalidRequest
from tests.fakes.engine_client import FakeEngineClient, Step, static_script
from tests.unit.proxy.conftest import MakeClient, sse_events

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5},
    "/v1/completions": {"prompt": "x", "max_tokens": 5},
    "/v1/responses": {"input": "x", "max_output_tokens": 5},
    "/v1/messages": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5},
}


def test_every_dialect_has_a_body_here() -> None:
    assert sorted(BODIES) == sorted(path for path, _ in ROUTES)


def test_rename_maps_the_head_and_the_quoted_names() -> None:
    names = FieldNames({"stop": "stop_sequences", "messages": "input"}, renumbered=frozenset({"messages"}))
    e = names.rename(InvalidRequest("'stop' cannot be combined with ...", param="stop"))
    assert (e.param, e.message, str(e)) == (
        "stop_sequences",
        "'stop_sequences' cannot be combined with ...",
        "'stop_sequences' cannot be combined with ...",
    )
    e = names.rename(InvalidRequest("stop must be short", param="stop"))
    assert e.message == "stop_sequences must be short"
    # Indices of renumbered fields are dropped rather than given wrong.
    e = names.rename(ContextLengthExceeded("too long", param="messages[3].content"))
    assert e.param == "input"
    # A name that only starts like a mapped one is the dialect's own.
    e = names.rename(InvalidRequest("bad", param="stop_sequences[0]"))
    assert e.param == "stop_sequences[0]"
    assert names.rename(InvalidRequest("bad")).param is None


def _worker_refuses(param: str, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> Any:
    def script(s: Submit) -> list[Step]:
        return [RequestError(s.request_id, code, message, param=param)]

    return script


@pytest.mark.parametrize(
    ("path", "wire", "own"),
    [
        ("/v1/chat/completions", "max_tokens", "max_tokens"),
        ("/v1/completions", "max_tokens", "max_tokens"),
        ("/v1/responses", "max_tokens", "max_output_tokens"),
        ("/v1/messages", "max_tokens", "max_tokens"),
        ("/v1/responses", "logprobs", "top_logprobs"),
        ("/v1/messages", "stop", "stop_sequences"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_error_names_the_dialects_field(
    make_client: MakeClient,
    fake: FakeEngineClient,
    http: httpx.AsyncClient,
    path: str,
    wire: str,
    own: str,
    stream: bool,
) -> None:
    fake.script = _worker_refuses(wire, f"{wire} must be >= 1, got 0")
    client = await make_client()
    # Refused before the first event: a stream is answered with the error's status too.
    resp = await client.post(path, json={**BODIES[path], "stream": stream})
    assert resp.status == 400
    text = await resp.text()
    assert f"{own} must be >= 1" in text
    if own != wire:
        assert f'"{wire} must' not in text


@pytest.mark.parametrize(
    ("path", "wire", "own"),
    [("/v1/responses", "max_tokens", "max_output_tokens"), ("/v1/messages", "stop", "stop_sequences")],
)
async def test_a_worker_error_inside_a_stream_names_the_dialects_field(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient, path: str, wire: str, own: str
) -> None:
    def script(s: Submit) -> list[Step]:
        rid = s.request_id
        return [
            Started(rid, 3, 0),
            TokenDelta(rid, "a", 1),
            RequestError(rid, ErrorCode.INVALID_REQUEST, f"{wire} is wrong", param=wire),
        ]

    fake.script = script
    client = await make_client()
    events = await sse_events(http, str(client.make_url(path)), {**BODIES[path], "stream": True})
    text = str(events[-2:])
    assert f"{own} is wrong" in text and f"'{wire} is wrong" not in text


async def test_context_overflow_names_input_on_responses(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = _worker_refuses("messages", "the prompt is too long", ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    client = await make_client()
    resp = await client.post("/v1/responses", json=BODIES["/v1/responses"])
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")


async def test_a_proxy_error_from_the_task_names_the_dialects_field(make_client: MakeClient) -> None:
    """The conversion (``proxy.core.task.tool_plan``) names chat's ``stop``; a
    Messages client sent ``stop_sequences``."""
    client = await make_client()
    body = {
        **BODIES["/v1/messages"],
        "stop_sequences": ["\n"],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
    }
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert "'stop_sequences' cannot be combined" in error["message"]
    assert "'stop'" not in error["message"]


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("stream", [False, True])
async def test_progress_only_on_a_stream_that_asked(
    make_client: MakeClient, fake: FakeEngineClient, path: str, stream: bool
) -> None:
    fake.script = static_script(["a"], prompt_tokens=6, chunk=3)
    client = await make_client()
    resp = await client.post(path, json={**BODIES[path], "stream": stream, "return_progress": True})
    assert resp.status == 200
    text = await resp.text()
    assert ("prompt_progress" in text) is stream


STOP_FIELD = {
    "/v1/chat/completions": ("stop", 4),
    "/v1/completions": ("stop", 4),
    "/v1/responses": ("stop", 4),
    "/v1/messages": ("stop_sequences", 64),
}


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_stop_sequences_are_bounded_per_dialect(
    make_client: MakeClient, fake: FakeEngineClient, path: str
) -> None:
    """Each dialect's limit of stop strings (OpenAI's 4; Messages 64), refused
    before the worker sees the request, naming the dialect's field."""
    field, limit = STOP_FIELD[path]
    fake.script = static_script(["a"])
    client = await make_client()
    ok = await client.post(path, json={**BODIES[path], field: [f"#{i}" for i in range(limit)]})
    assert ok.status == 200
    submitted = len(fake.submits)
    resp = await client.post(path, json={**BODIES[path], field: [f"#{i}" for i in range(limit + 1)]})
    assert resp.status == 400
    text = await resp.text()
    assert f"'{field}' takes at most {limit} sequences, got {limit + 1}" in text
    if path != "/v1/messages":  # Anthropic's error shape has no param
        assert f'"param":"{field}"' in text.replace(" ", "")
    long = await client.post(path, json={**BODIES[path], field: ["x", "y" * 257]})
    assert long.status == 400
    assert f"'{field}' sequences are at most 256 characters; number 1 has 257" in await long.text()
    assert len(fake.submits) == submitted
