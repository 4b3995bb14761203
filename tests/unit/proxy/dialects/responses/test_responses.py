"""The Responses API dialect, driven by the official ``openai`` SDK and by raw HTTP."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from protocol import (
    Detokenize,
    ErrorCode,
    FinishReason,
    QueueProgress,
    RequestError,
    Started,
    Submit,
    TokenDelta,
    Tokenize,
)
from tests.fakes.engine_client import FakeEngineClient, Step, static_script
from tests.unit.proxy.conftest import MakeClient, sse_events

URL = "/v1/responses"


def sdk(client: object) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)  # type: ignore[attr-defined]


async def test_create_non_stream_usage_and_text(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["Hello", " world"], prompt_tokens=12, cached_tokens=4, draft=(3, 1))
    client = await make_client()
    async with sdk(client) as api:
        r = await api.responses.create(model="m", input="hi", instructions="Be brief.")
    assert r.output_text == "Hello world"
    assert r.status == "completed"
    assert r.id.startswith("resp_")
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (12, 2, 14)
    assert r.usage.input_tokens_details.cached_tokens == 4
    extra = r.usage.output_tokens_details.model_extra or {}
    assert (extra["accepted_prediction_tokens"], extra["rejected_prediction_tokens"]) == (3, 1)
    (submit,) = fake.submits
    assert [(m.role, m.content) for m in submit.messages] == [("system", "Be brief."), ("user", "hi")]


async def test_stream_event_sequence_and_progress(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    def script(s: Submit) -> list[Step]:
        rid = s.request_id
        return [
            QueueProgress(rid, 1, 1, 5),
            *[
                ev
                for ev in static_script(["a", "b"], prompt_tokens=6, chunk=3)(s)
                if not isinstance(ev, QueueProgress)
            ],
        ]

    fake.script = script
    client = await make_client()
    body = {"model": "m", "input": "x", "stream": True, "return_progress": True}
    events = await sse_events(http, str(client.make_url(URL)), body)
    names = [n for n, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.queue_progress",
        "response.prompt_progress",
        "response.prompt_progress",
        "response.prompt_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(d["type"] == n for n, d in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    progress = [d["prompt_progress"] for n, d in events if n == "response.prompt_progress"]
    assert [p["processed"] for p in progress] == [0, 3, 6]
    assert events[2][1]["queue_progress"] == {"position": 1, "queued": 1, "time_ms": 5}
    done = events[-1][1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "ab"
    assert done["usage"]["input_tokens"] == 6


async def test_sdk_stream_helper_skips_progress_events(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = static_script(["Hi", " there"], prompt_tokens=6, chunk=2)
    client = await make_client()
    async with (
        sdk(client) as api,
        api.responses.stream(model="m", input="x", extra_body={"return_progress": True}) as stream,
    ):
        types = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert final.output_text == "Hi there"
    assert types.count("response.prompt_progress") == 4
    assert types[-1] == "response.completed"


async def test_length_cut_is_incomplete(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["a", "b"], finish_reason=FinishReason.LENGTH)
    client = await make_client()
    async with sdk(client) as api:
        r = await api.responses.create(model="m", input="x", max_output_tokens=2)
        stream = await api.responses.create(model="m", input="x", max_output_tokens=2, stream=True)
        last = [e async for e in stream][-1]
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert last.type == "response.incomplete"
    (_, submit) = fake.submits
    assert submit.params.max_tokens == 2


async def test_function_tool_call_round_trip(make_client: MakeClient, fake: FakeEngineClient) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    fake.script = static_script(["Let me check.", "\n", call])
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    client = await make_client()
    async with sdk(client) as api:
        r = await api.responses.create(model="m", input="Weather in Paris?", tools=tools)  # type: ignore[arg-type]
        calls = [o for o in r.output if o.type == "function_call"]
        assert [(c.name, msgspec.json.decode(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        stream = await api.responses.create(model="m", input="Weather?", tools=tools, stream=True)  # type: ignore[arg-type]
        events = [e async for e in stream]
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert msgspec.json.decode(deltas) == {"city": "Paris"}
        done = next(e for e in events if e.type == "response.completed")
        kinds = [o.type for o in done.response.output]
        assert kinds == ["message", "function_call"]
        # the next turn sends the call and its output back as items
        follow = [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"},
        ]
        fake.script = static_script(["It is sunny."])
        r2 = await api.responses.create(model="m", input=follow, tools=tools)  # type: ignore[arg-type]
    assert r2.output_text == "It is sunny."
    rendered = "\n".join(m.content for m in fake.submits[-1].messages)
    assert "18 C, sunny" in rendered and "get_weather" in rendered


async def test_parse_with_a_pydantic_model(make_client: MakeClient, fake: FakeEngineClient) -> None:
    class City(BaseModel):
        name: str
        population: int

    fake.script = static_script(['{"name": "Paris", ', '"population": 2100000}'])
    client = await make_client()
    async with sdk(client) as api:
        r = await api.responses.parse(model="m", input="A city?", text_format=City)
    assert r.output_parsed == City(name="Paris", population=2100000)
    (submit,) = fake.submits
    assert submit.params.grammar is not None and submit.params.grammar_param == "text.format.schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        # Codex CLI 0.171's defaults: its sub-agent tools as a namespace, a web search tool
        (
            {
                "tools": [
                    {"type": "function", "name": "f", "parameters": {"type": "object"}},
                    {"type": "namespace", "name": "multi_agent_v1", "description": "d", "tools": []},
                ]
            },
            "tools[1]",
        ),
        ({"tools": [{"type": "web_search", "external_web_access": False}]}, "tools[0]"),
        ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0]"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_it(
    make_client: MakeClient, extra: dict[str, Any], param: str
) -> None:
    client = await make_client()
    resp = await client.post(URL, json={"model": "m", "input": "x", **extra})
    assert resp.status == 400, await resp.text()
    err = (await resp.json())["error"]
    assert err["param"] == param


async def test_what_codex_sends_that_changes_nothing_is_accepted(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    client = await make_client()
    body = {
        "model": "m",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        ],
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc",
        "store": False,
        "client_metadata": {"x": "y"},
        "metadata": {"k": "v"},
        "stream": True,
    }
    names = [n for n, _ in await sse_events(http, str(client.make_url(URL)), body)]
    assert names[-1] == "response.completed"
    (submit,) = fake.submits
    assert [(m.role, m.content) for m in submit.messages] == [("system", "rules"), ("user", "hi")]


async def test_error_after_headers_is_response_failed(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    def script(s: Submit) -> list[Step]:
        rid = s.request_id
        return [
            Started(rid, 3, 0),
            TokenDelta(rid, "a", 1),
            RequestError(rid, ErrorCode.INTERNAL, "engine exploded"),
        ]

    fake.script = script
    client = await make_client()
    events = await sse_events(http, str(client.make_url(URL)), {"model": "m", "input": "x", "stream": True})
    name, data = events[-1]
    assert name == "response.failed"
    assert data["response"]["error"] == {"code": "internal_error", "message": "engine exploded"}


async def test_get_stored_response_is_404(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/v1/responses/resp_123")
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "response_not_found"
    async with sdk(client) as api:
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve("resp_123")


async def test_logit_bias_reaches_the_worker(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    r = await client.post(URL, json={"model": "m", "input": "hi", "logit_bias": {"21285": 100}})
    assert r.status == 200
    assert fake.submits[-1].params.logit_bias == {21285: 100.0}
    bad = await client.post(URL, json={"model": "m", "input": "hi", "logit_bias": "x"})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "logit_bias"


@pytest.mark.parametrize(
    ("body", "add_bos", "specials"),
    [
        ({"prompt": "hi"}, None, False),
        ({"prompt": "hi", "add_special_tokens": True}, None, False),
        ({"prompt": "hi", "add_special_tokens": False}, False, False),
        ({"messages": [{"role": "user", "content": "hi"}]}, None, False),
        ({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}, None, False),
        ({"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, None, True),
    ],
)
async def test_tokenize_passes_add_special_tokens_as_vllm_means_it(
    make_client: MakeClient,
    fake: FakeEngineClient,
    body: dict[str, Any],
    add_bos: bool | None,
    specials: bool,
) -> None:
    """vLLM's defaults: true on a prompt (the tokenizer's BOS, the engine's own
    choice), false on messages; false on a prompt drops BOS (``Submit.add_bos``),
    true on messages asks for the tokenizer's leading specials
    (``Tokenize.add_special_tokens``)."""
    client = await make_client()
    r = await client.post("/tokenize", json=body)
    assert r.status == 200, await r.text()
    (msg,) = fake.lookups
    assert isinstance(msg, Tokenize)
    assert msg.submit.add_bos is add_bos and msg.add_special_tokens is specials


async def test_detokenize_passes_skip_special_tokens(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    for skip in (False, True):
        r = await client.post("/detokenize", json={"tokens": [1, 2], "skip_special_tokens": skip})
        assert r.status == 200
        assert isinstance(fake.lookups[-1], Detokenize) and fake.lookups[-1].skip_special_tokens is skip
    bad = await client.post("/detokenize", json={"tokens": [1], "skip_special_tokens": "yes"})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "skip_special_tokens"


@pytest.mark.parametrize(
    ("body", "param"),
    [({"prompt": "hi", "return_token_strs": True}, "return_token_strs")],
)
async def test_tokenize_refuses_what_it_cannot_honour(
    make_client: MakeClient, body: dict[str, Any], param: str
) -> None:
    client = await make_client()
    r = await client.post("/tokenize", json=body)
    assert r.status == 400 and (await r.json())["error"]["param"] == param
    ok = await client.post("/tokenize", json={**body, param: None})
    assert ok.status == 200


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "message", "role": "user"}, "input[0].content"),
        ({"role": "user"}, "input[0].content"),
        ({"type": "function_call_output", "call_id": "c1"}, "input[0].output"),
    ],
)
async def test_items_without_their_content_are_refused(
    make_client: MakeClient, fake: FakeEngineClient, item: dict[str, Any], param: str
) -> None:
    """OpenAI's API: "Missing required parameter" naming the item's field."""
    client = await make_client()
    r = await client.post("/v1/responses", json={"model": "m", "input": [item]})
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == param and "Missing required parameter" in err["message"]
    assert fake.submits == []


async def test_apply_template_is_the_text_of_the_tokenized_conversation(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    """llama.cpp's ``/apply-template``: the worker tokenizes the conversation as chat would
    and the text of those ids comes back (the fake detokenizes as ``t<id>``)."""
    client = await make_client()
    body = {"messages": [{"role": "user", "content": "hi there"}]}
    r = await client.post("/apply-template", json=body)
    assert r.status == 200, await r.text()
    tokenized, detokenized = fake.lookups
    assert isinstance(tokenized, Tokenize) and isinstance(detokenized, Detokenize)
    assert tokenized.submit.messages[-1].content == "hi there"
    assert (await r.json())["prompt"] == " ".join(f"t{t}" for t in detokenized.token_ids)
    bad = await client.post("/apply-template", json={**body, "prediction": {"type": "content"}})
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "prediction"
