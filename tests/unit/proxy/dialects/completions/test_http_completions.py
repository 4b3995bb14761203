"""``POST /v1/completions`` (legacy text completions) on a fake engine."""

from __future__ import annotations

import httpx
import orjson
import pytest

from protocol import Submit
from tests.fakes.engine_client import FakeEngineClient, Step, completion_events, static_script
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
    client = await make_client(max_n=4)
    r = await client.post(URL, json={"prompt": []})
    assert r.status == 400
    assert (await r.json())["error"]["param"] == "prompt"
    r = await client.post(URL, json={"prompt": ["a", "b", "c"], "n": 2})  # 6 choices > max_n
    assert r.status == 400
    assert (await r.json())["error"]["param"] == "prompt"
    r = await client.post(URL, json={"max_tokens": 3})
    assert r.status == 400


def _per_prompt(submit: Submit) -> list[Step]:
    # Prompt "p<k> ..." has k + 2 tokens, k of them cached; choice j answers "<prompt>/<j>".
    prompt = submit.prompt or ""
    k = int(prompt.split()[0][1:])
    last = submit.request_id.rsplit("-", 1)[-1]  # "...-p<i>-<j>" per choice
    choice = last if not last.startswith("p") else "0"
    texts = [f"{prompt}/{choice}"]
    return list(completion_events(submit.request_id, texts, prompt_tokens=k + 2, cached_tokens=k))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_list_gets_n_choices_each_indexed_across_prompts(
    make_client: MakeClient, fake: FakeEngineClient, stream: bool
) -> None:
    fake.script = _per_prompt
    client = await make_client()
    body = {"prompt": ["p1 x", "p2 y", "p3 z"], "n": 2, "echo": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = await client.post(URL, json=body)
    assert r.status == 200
    if stream:
        lines = (await r.text()).splitlines()
        events = [orjson.loads(line[6:]) for line in lines if line.startswith("data: {")]
        texts: dict[int, str] = {}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        usage = events[-1]["usage"]
    else:
        data = await r.json()
        texts = {c["index"]: c["text"] for c in data["choices"]}
        usage = data["usage"]
    prompts = body["prompt"]
    assert sorted(texts) == list(range(6))
    for i, text in texts.items():
        prompt = prompts[i // 2]
        # Each choice starts with its own prompt (echo), then its own answer.
        assert text.startswith(prompt) and text.endswith(f"{prompt}/{i % 2}")
    # Prompts counted once each (k + 2 tokens, k cached), completions summed.
    assert usage["prompt_tokens"] == sum(k + 2 for k in (1, 2, 3))
    assert usage["prompt_tokens_details"]["cached_tokens"] == 1 + 2 + 3
    assert usage["completion_tokens"] == 6
    assert [s.prompt for s in fake.submits] == prompts
