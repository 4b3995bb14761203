"""``POST /v1/completions`` (legacy text completions) on a fake engine."""

from __future__ import annotations

import httpx

from tests.fakes.engine_client import FakeEngineClient, static_script
from tests.unit.proxy.conftest import MakeClient, sse_json

URL = "/v1/completions"


async def test_text_completion_stream(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    fake.script = static_script(["Once", " upon"], prompt_tokens=5, chunk=8)
    client = await make_client()
    chunks = await sse_json(
        http,
        str(client.make_url(URL)),
        {
            "prompt": "Tell me",
            "stream": True,
            "return_progress": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert chunks[-1] == "[DONE]"
    *body, usage_chunk = chunks[:-1]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks[:-1])
    progress = [c for c in body if "prompt_progress" in c]
    assert [c["prompt_progress"] for c in progress] == [
        {"total": 5, "cache": 0, "processed": 0, "time_ms": 0},
        {"total": 5, "cache": 0, "processed": 5, "time_ms": 10},
    ]
    assert all(
        c["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}] for c in progress
    )
    rest = body[len(progress) :]
    assert [c["choices"][0]["text"] for c in rest] == ["Once", " upon", ""]
    assert [c["choices"][0]["finish_reason"] for c in rest] == [None, None, "stop"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 2
    assert fake.submits[0].prompt == "Tell me"
    assert fake.submits[0].messages == ()


async def test_text_completion_response(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["a", "b"], prompt_tokens=3, cached_tokens=2)
    client = await make_client()
    r = await client.post(URL, json={"prompt": ["x"], "max_tokens": 2})
    data = await r.json()
    assert data["object"] == "text_completion"
    assert data["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"}]
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert (data["usage"]["prompt_tokens"], data["usage"]["total_tokens"]) == (3, 5)
    assert fake.submits[0].params.max_tokens == 2


async def test_text_completion_bad_prompt(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    r = await client.post(URL, json={"prompt": ["a", "b"]})
    assert r.status == 400
    assert (await r.json())["error"]["param"] == "prompt"
    r = await client.post(URL, json={"max_tokens": 3})
    assert r.status == 400
    assert (await r.json())["error"]["param"] == "prompt"
