"""Anthropic's Messages dialect, driven by the official ``anthropic`` SDK and by raw HTTP."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from anthropic import AsyncAnthropic

from protocol import ErrorCode, FinishReason, QueueProgress, RequestError, Started, Submit, TokenDelta
from tests.fakes.engine_client import FakeEngineClient, Step, fake_token_ids, static_script
from tests.unit.proxy.conftest import MakeClient, sse_events

URL = "/v1/messages"
MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def sdk(client: object) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=str(client.make_url("")), api_key="x", max_retries=0)  # type: ignore[attr-defined]


async def test_create_usage_has_anthropic_meaning(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["Hello", " world"], prompt_tokens=12, cached_tokens=4)
    client = await make_client()
    async with sdk(client) as api:
        m = await api.messages.create(model="m", max_tokens=100, messages=MSGS, system="Be brief.")  # type: ignore[arg-type]
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == "Hello world"  # type: ignore[union-attr]
    assert m.stop_reason == "end_turn"
    assert m.id.startswith("msg_")
    # input_tokens + cache_read_input_tokens is the whole prompt
    assert (m.usage.input_tokens, m.usage.cache_read_input_tokens, m.usage.output_tokens) == (8, 4, 2)
    (submit,) = fake.submits
    assert [(c.role, c.content) for c in submit.messages] == [("system", "Be brief."), ("user", "hi")]
    assert submit.params.max_tokens == 100


async def test_stream_events_and_progress(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    def script(s: Submit) -> list[Step]:
        return [QueueProgress(s.request_id, 2, 2, 7), *static_script(["a", "b"], prompt_tokens=6, chunk=3)(s)]

    fake.script = script
    client = await make_client()
    body = {"model": "m", "max_tokens": 10, "messages": MSGS, "stream": True, "return_progress": True}
    events = await sse_events(http, str(client.make_url(URL + "?beta=true")), body)
    assert [n for n, _ in events] == [
        "message_start",
        "queue_progress",
        "prompt_progress",
        "prompt_progress",
        "prompt_progress",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(d["type"] == n for n, d in events)
    assert events[1][1]["queue_progress"] == {"position": 2, "queued": 2, "time_ms": 7}
    assert [d["prompt_progress"]["processed"] for n, d in events if n == "prompt_progress"] == [0, 3, 6]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == 6


async def test_sdk_stream_helper_skips_progress(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["Hi", " there"], prompt_tokens=6, chunk=2)
    client = await make_client()
    async with (
        sdk(client) as api,
        api.messages.stream(
            model="m",
            max_tokens=10,
            messages=MSGS,
            extra_body={"return_progress": True},  # type: ignore[arg-type]
        ) as stream,
    ):
        texts = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(texts) == "Hi there"
    assert final.content[0].text == "Hi there"  # type: ignore[union-attr]
    assert final.usage.output_tokens == 2


async def test_tool_use_round_trip(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["Checking.", "\n", CALL])
    client = await make_client()
    async with sdk(client) as api:
        m = await api.messages.create(
            model="m",
            max_tokens=100,
            messages=[{"role": "user", "content": "Paris?"}],
            tools=[WEATHER],  # type: ignore[list-item]
        )
        assert m.stop_reason == "tool_use"
        uses = [b for b in m.content if b.type == "tool_use"]
        assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})]  # type: ignore[union-attr]
        async with api.messages.stream(
            model="m",
            max_tokens=100,
            messages=[{"role": "user", "content": "Paris?"}],
            tools=[WEATHER],  # type: ignore[list-item]
        ) as stream:
            final = await stream.get_final_message()
        streamed = [b for b in final.content if b.type == "tool_use"]
        assert [(u.name, u.input) for u in streamed] == [("get_weather", {"city": "Paris"})]  # type: ignore[union-attr]
        assert final.stop_reason == "tool_use"
        fake.script = static_script(["Sunny."])
        use = uses[0]
        follow = [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]},  # type: ignore[union-attr]
        ]
        m2 = await api.messages.create(model="m", max_tokens=100, messages=follow, tools=[WEATHER])  # type: ignore[arg-type,list-item]
    assert m2.content[0].text == "Sunny."  # type: ignore[union-attr]
    rendered = "\n".join(c.content for c in fake.submits[-1].messages)
    assert "18 C" in rendered and "get_weather" in rendered


@pytest.mark.parametrize(
    ("choice", "mode"),
    [
        ({"type": "any"}, "required"),
        ({"type": "tool", "name": "get_weather"}, "function"),
        ({"type": "none"}, None),
    ],
)
async def test_tool_choice_maps(
    make_client: MakeClient, fake: FakeEngineClient, choice: dict[str, Any], mode: str | None
) -> None:
    fake.script = static_script([CALL])
    client = await make_client()
    body = {"model": "m", "max_tokens": 50, "messages": MSGS, "tools": [WEATHER], "tool_choice": choice}
    resp = await client.post(URL, json=body)
    assert resp.status == 200, await resp.text()
    grammar = fake.submits[-1].params.grammar
    assert (grammar is not None) == (mode is not None)


async def test_count_tokens_equals_the_prompt_of_the_same_request(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    body = {"model": "m", "messages": MSGS, "system": "Be brief.", "tools": [WEATHER]}
    async with sdk(client) as api:
        counted = await api.messages.count_tokens(**body)  # type: ignore[arg-type]
        await api.messages.create(max_tokens=5, **body)  # type: ignore[arg-type]
    (lookup,) = fake.lookups
    sent = fake.submits[-1]
    # The count is the same prompt the generation request sends: same messages, tools rendered.
    assert lookup.submit.messages == sent.messages  # type: ignore[union-attr]
    assert counted.input_tokens == len(fake_token_ids(sent))


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"messages": MSGS}, 400, "invalid_request_error"),  # max_tokens is required
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 5,
                "messages": MSGS,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "invalid_request_error",
        ),
        ({"max_tokens": 5, "messages": MSGS, "mcp_servers": [{"url": "x"}]}, 400, "invalid_request_error"),
    ],
)
async def test_errors_have_anthropic_shape(
    make_client: MakeClient, body: dict[str, Any], status: int, kind: str
) -> None:
    client = await make_client()
    resp = await client.post(URL, json={"model": "m", **body})
    assert resp.status == status
    err = await resp.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


async def test_sdk_raises_typed_errors(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    async with sdk(client) as api:
        with pytest.raises(anthropic.BadRequestError):
            await api.messages.create(
                model="m",
                max_tokens=5,
                messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],  # type: ignore[list-item]
            )
    fake.is_ready = False
    async with sdk(client) as api:
        with pytest.raises(anthropic.APIStatusError) as info:
            await api.messages.create(model="m", max_tokens=5, messages=MSGS)  # type: ignore[arg-type]
    assert info.value.status_code == 503
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


async def test_what_claude_code_sends_that_changes_nothing_is_accepted(
    make_client: MakeClient, fake: FakeEngineClient, http: httpx.AsyncClient
) -> None:
    client = await make_client()
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "...", "signature": "s"},
                    {"type": "text", "text": "hello"},
                ],
            },
            {"role": "user", "content": "again"},
        ],
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "metadata": {"user_id": "u"},
        "temperature": 1,
        "stream": True,
    }
    assert [n for n, _ in await sse_events(http, str(client.make_url(URL + "?beta=true")), body)][
        -1
    ] == "message_stop"
    sent = fake.submits[-1]
    assert [(m.role, m.content) for m in sent.messages] == [
        ("system", "You are Claude Code."),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "again"),
    ]
    # a cap, passed on for the worker to clamp to what the context leaves
    assert sent.params.max_tokens == 32000


async def test_x_api_key_is_accepted(make_client: MakeClient) -> None:
    client = await make_client(api_key="secret")
    ok = await client.post(
        URL, json={"model": "m", "max_tokens": 5, "messages": MSGS}, headers={"x-api-key": "secret"}
    )
    assert ok.status == 200
    bad = await client.post(
        URL, json={"model": "m", "max_tokens": 5, "messages": MSGS}, headers={"x-api-key": "no"}
    )
    assert bad.status == 401
    assert (await bad.json())["error"]["type"] == "authentication_error"


async def test_error_after_headers_is_an_error_event(
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
    body = {"model": "m", "max_tokens": 5, "messages": MSGS, "stream": True}
    name, data = (await sse_events(http, str(client.make_url(URL)), body))[-1]
    assert name == "error"
    assert data == {"type": "error", "error": {"type": "api_error", "message": "engine exploded"}}
    async with sdk(client) as api:
        with pytest.raises(anthropic.APIStatusError, match="engine exploded"):
            async with api.messages.stream(model="m", max_tokens=5, messages=MSGS) as stream:  # type: ignore[arg-type]
                async for _ in stream:
                    pass


async def test_max_tokens_cut_is_max_tokens(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["a"], finish_reason=FinishReason.LENGTH)
    client = await make_client()
    async with sdk(client) as api:
        m = await api.messages.create(model="m", max_tokens=1, messages=MSGS)  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens"


async def test_system_message_inside_messages_is_a_system_turn_in_place(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    # Claude Code 2.1 sends its environment notes as a system message after the user's turn.
    client = await make_client()
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": [{"type": "text", "text": "top"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "# Environment", "cache_control": {"type": "ephemeral"}}
                ],
            },
        ],
    }
    resp = await client.post(URL + "?beta=true", json=body)
    assert resp.status == 200, await resp.text()
    assert [(m.role, m.content) for m in fake.submits[-1].messages] == [
        ("system", "top"),
        ("user", "hi"),
        ("system", "# Environment"),
    ]
    bad = {**body, "messages": [*body["messages"], {"role": "system", "content": [{"type": "image"}]}]}
    resp = await client.post(URL, json=bad)
    assert resp.status == 400
    assert "messages[2].content[0]" in (await resp.json())["error"]["message"]


async def test_deferred_tools_are_not_shown_to_the_model(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    deferred = {
        "name": "cron_create",
        "description": "Schedule a prompt",
        "input_schema": {"type": "object", "properties": {}},
        "defer_loading": True,
    }
    body = {"model": "m", "max_tokens": 5, "messages": MSGS, "tools": [WEATHER, deferred]}
    resp = await client.post(URL, json=body)
    assert resp.status == 200, await resp.text()
    rendered = "\n".join(m.content for m in fake.submits[-1].messages)
    assert "get_weather" in rendered
    assert "cron_create" not in rendered
    async with sdk(client) as api:
        counted = await api.messages.count_tokens(model="m", messages=MSGS, tools=[WEATHER, deferred])  # type: ignore[arg-type,list-item]
    assert counted.input_tokens == len(fake_token_ids(fake.submits[-1]))


async def test_an_assistant_prefill_is_refused_not_ignored(make_client: MakeClient) -> None:
    client = await make_client()
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "The capital is"}]
    r = await client.post(URL, json={"model": "m", "max_tokens": 8, "messages": msgs})
    assert r.status == 400
    err = await r.json()
    assert err["type"] == "error" and "messages[1]" in err["error"]["message"]


@pytest.mark.parametrize(("method", "path", "status"), [("GET", URL, 405), ("POST", URL + "/batches", 404)])
async def test_routing_errors_under_messages_have_anthropic_shape(
    make_client: MakeClient, method: str, path: str, status: int
) -> None:
    client = await make_client()
    r = await client.request(method, path, json={})
    assert r.status == status
    err = await r.json()
    assert err["type"] == "error" and err["error"]["type"] in ("not_found_error", "invalid_request_error")


async def test_count_tokens_refuses_what_the_request_would(make_client: MakeClient) -> None:
    client = await make_client()
    body = {
        "model": "m",
        "messages": MSGS,
        "output_format": {"type": "json_schema", "schema": {"type": "nonsense"}},
    }
    counted = await client.post(URL + "/count_tokens", json=body)
    sent = await client.post(URL, json={**body, "max_tokens": 4})
    assert counted.status == sent.status == 400


def _use(tool_id: str, tool_input: object = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": "get_weather", "input": tool_input or {"city": "P"}}


def _result(tool_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_id, "content": "18 C"}


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        (  # a result for a call nobody made
            [
                {"role": "user", "content": "P?"},
                {"role": "assistant", "content": [_use("t1")]},
                {"role": "user", "content": [_result("t9")]},
            ],
            "messages[2].content[0].tool_use_id",
            "unexpected `tool_use_id`",
        ),
        (  # two results for one call
            [
                {"role": "user", "content": "P?"},
                {"role": "assistant", "content": [_use("t1")]},
                {"role": "user", "content": [_result("t1"), _result("t1")]},
            ],
            "messages[2].content[1].tool_use_id",
            "more than one `tool_result`",
        ),
        (  # a result for a call of an earlier turn, not the one just before
            [
                {"role": "user", "content": "P?"},
                {"role": "assistant", "content": [_use("t1")]},
                {"role": "user", "content": [_result("t1")]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [_result("t1")]},
            ],
            "messages[4].content[0].tool_use_id",
            "unexpected `tool_use_id`",
        ),
        (  # tool_use input given as a string
            [
                {"role": "user", "content": "P?"},
                {"role": "assistant", "content": [_use("t1", '{"city": "P"}')]},
                {"role": "user", "content": [_result("t1")]},
            ],
            "messages[1].content[0].input",
            "must be an object",
        ),
        (  # one id for two calls
            [
                {"role": "user", "content": "P?"},
                {"role": "assistant", "content": [_use("t1"), _use("t1")]},
                {"role": "user", "content": [_result("t1")]},
            ],
            "messages[1].content[1]",
            "must be unique",
        ),
        ([{"role": "user", "content": ""}], "'messages[0]'", "non-empty content"),
        ([{"role": "user", "content": []}], "'messages[0]'", "non-empty content"),
    ],
)
async def test_tool_ids_and_empty_content_refused_as_anthropic_does(
    make_client: MakeClient, fake: FakeEngineClient, messages: list[dict[str, Any]], param: str, words: str
) -> None:
    client = await make_client()
    for path in (URL, URL + "/count_tokens"):
        r = await client.post(
            path, json={"model": "m", "max_tokens": 8, "messages": messages, "tools": [WEATHER]}
        )
        assert r.status == 400, path
        err = await r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert param in err["error"]["message"] and words in err["error"]["message"], err
    assert fake.submits == [] and fake.lookups == []


async def test_a_consistent_tool_history_is_accepted(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["Sunny."])
    client = await make_client()
    messages = [
        {"role": "user", "content": "P?"},
        {"role": "assistant", "content": [_use("t1"), _use("t2")]},
        {"role": "user", "content": [_result("t2"), _result("t1"), {"type": "text", "text": "thanks"}]},
        {"role": "assistant", "content": [_use("t3")]},
        {"role": "user", "content": [_result("t3")]},
    ]
    r = await client.post(URL, json={"model": "m", "max_tokens": 8, "messages": messages, "tools": [WEATHER]})
    assert r.status == 200, await r.text()
