"""The official ``openai`` package parses what the proxy sends."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from protocol import ErrorCode, RequestError, Started, Submit, TokenDelta
from tests.fakes.engine_client import FakeEngineClient, Step, static_script
from tests.unit.proxy.conftest import MakeClient


def sdk(client: object) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)  # type: ignore[attr-defined]


async def test_stream_with_usage_and_progress(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(
        ["Hi", " there", "\u2028!"], prompt_tokens=6, cached_tokens=2, chunk=2, draft=(2, 1)
    )
    client = await make_client()
    async with sdk(client) as api:
        stream = await api.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_progress": True},
        )
        chunks = [c async for c in stream]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert usage_chunks == [chunks[-1]]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (6, 3, 9)
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens == 2
    assert last.usage.completion_tokens_details is not None
    assert last.usage.completion_tokens_details.accepted_prediction_tokens == 2
    assert last.usage.completion_tokens_details.rejected_prediction_tokens == 1
    progress = [(c.model_extra or {}).get("prompt_progress") for c in chunks]
    assert [p["processed"] for p in progress if p] == [2, 4, 6]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi there\u2028!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_non_stream(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    async with sdk(client) as api:
        r = await api.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=2)
        comp = await api.completions.create(model="m", prompt="x")
    assert [c.message.content for c in r.choices] == ["Hello world", "Hello world"]
    assert r.usage is not None and r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 10
    assert comp.choices[0].text == "Hello world"


async def test_error_event_raises_api_error(make_client: MakeClient, fake: FakeEngineClient) -> None:
    def script(s: Submit) -> list[Step]:
        return [
            Started(s.request_id, 3, 0),
            TokenDelta(s.request_id, "a", 1),
            RequestError(s.request_id, ErrorCode.INTERNAL, "engine exploded"),
        ]

    fake.script = script
    client = await make_client()
    async with sdk(client) as api:
        stream = await api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True
        )
        with pytest.raises(openai.APIError, match="engine exploded"):
            async for _ in stream:
                pass


async def test_http_errors_raise_typed_exceptions(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    async with sdk(client) as api:
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], max_tokens=-1
            )
    assert info.value.param == "max_tokens"
