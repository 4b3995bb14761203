"""What agents send, on the real embedded model through ``exl3-sidecar serve``,
read with the official ``openai`` SDK's own types: a two-turn tool conversation
with ``tool_choice="required"`` (stream and non-stream), a ``json_schema``
answer parsed by ``client.chat.completions.parse`` into a pydantic model, and
logprobs that reassemble exactly to the content."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_with_required_choice(server: Server, stream: bool) -> None:
    api = client(server)
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw: Any = {"model": "any", "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80, "seed": 1}
    if stream:
        state = ChatCompletionStreamState()
        for chunk in api.chat.completions.create(messages=messages, stream=True, **kw):
            state.handle_chunk(chunk)
        first = state.get_final_completion().choices[0]
    else:
        first = api.chat.completions.create(messages=messages, **kw).choices[0]
    assert first.finish_reason == "tool_calls"
    calls = first.message.tool_calls
    assert calls, first.message
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str)  # the grammar enforced the schema
    # Second turn: the tool's result goes back, the model answers in text.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})},
    ]
    answer = api.chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], max_tokens=40, seed=1
    )
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


NAMED_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ),
    "responses": (
        "/v1/responses",
        {
            "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": {"type": "function", "name": "get_weather"},
        },
    ),
    "messages": (
        "/v1/messages",
        {
            "tools": [
                {
                    "name": "get_weather",
                    "description": WEATHER["function"]["description"],
                    "input_schema": WEATHER["function"]["parameters"],
                }
            ],
            "tool_choice": {"type": "tool", "name": "get_weather"},
        },
    ),
}


@pytest.mark.parametrize("dialect", list(NAMED_BODIES))
def test_a_named_call_cut_at_six_tokens_is_still_the_call(server: Server, dialect: str) -> None:
    """The issue's check: ``max_tokens: 6`` at temperature 0 with a named
    ``tool_choice``. The server writes the call's opening and name, so the six
    tokens go to the arguments and the answer is the call (as far as written)."""
    path, tools = NAMED_BODIES[dialect]
    limit = {"responses": "max_output_tokens"}.get(dialect, "max_tokens")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body: dict[str, Any] = {"model": "any", "temperature": 0, limit: 6, **tools}
    body["input" if dialect == "responses" else "messages"] = messages
    r = httpx.post(server.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    if dialect == "chat":
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "length" and not choice["message"]["content"]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert call["function"]["arguments"].startswith("{")  # the arguments as far as written
        assert answer["usage"]["completion_tokens"] == 6
    elif dialect == "responses":
        assert answer["status"] == "incomplete"
        (call,) = [o for o in answer["output"] if o["type"] == "function_call"]
        assert call["name"] == "get_weather" and call["arguments"].startswith("{")
    else:
        assert answer["stop_reason"] == "max_tokens"
        (call,) = [b for b in answer["content"] if b["type"] == "tool_use"]
        assert call["name"] == "get_weather"


class City(BaseModel):
    name: str
    country: str
    population: int


def test_json_schema_answer_parses_into_the_pydantic_model(server: Server) -> None:
    parsed = client(server).chat.completions.parse(
        model="any",
        messages=[{"role": "user", "content": "Describe Paris as JSON with name, country and population."}],
        response_format=City,
        max_tokens=120,
        seed=3,
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


def test_logprobs_reassemble_to_the_content(server: Server) -> None:
    api = client(server)
    messages: Any = [{"role": "user", "content": "Say something about café au lait."}]
    r = api.chat.completions.create(
        model="any", messages=messages, logprobs=True, top_logprobs=3, max_tokens=24, temperature=0
    )
    content = r.choices[0].message.content
    lp = r.choices[0].logprobs
    assert content and lp is not None and lp.content is not None
    assert "".join(e.token for e in lp.content) == content
    for e in lp.content:
        assert e.logprob <= 0 and len(e.top_logprobs) <= 3
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-4)
    streamed = api.chat.completions.create(
        model="any", messages=messages, logprobs=True, max_tokens=24, temperature=0, stream=True
    )
    tokens: list[str] = []
    text: list[str] = []
    for c in streamed:
        if c.choices:
            text.append(c.choices[0].delta.content or "")
            if c.choices[0].logprobs and c.choices[0].logprobs.content:
                tokens += [e.token for e in c.choices[0].logprobs.content]
    assert "".join(tokens) == "".join(text) == content
