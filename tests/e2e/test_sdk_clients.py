"""The official clients of the two new dialects on the real embedded model
through ``exl3-sidecar serve``: the ``openai`` SDK on ``/v1/responses``
(``responses.create``, ``responses.stream``, a function-tool round trip,
``responses.parse``), the OpenAI Agents SDK with its default Responses model
and one function tool, and the ``anthropic`` SDK on ``/v1/messages``
(``messages.create``, ``messages.stream``, a tool round trip,
``messages.count_tokens``).

Each test reads the answer with the SDK's own types and asserts what must hold
whatever a 135M model says: the shapes, the usage arithmetic, prompt counts
equal to ``POST /tokenize`` of the same conversation (the chat dialect's
rendering, an independent path), and a forced tool call parsed with the
declared name and a JSON object argument. Decoding is greedy (temperature 0).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    RunResult,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the weather in Paris?"
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": WEATHER_PARAMS,
    "strict": True,
}
# anthropic 2.x's create() and stream() take no sampling arguments (the Messages
# API still does): temperature goes in the body as the SDK sends extra fields.
GREEDY = {"temperature": 0}
MESSAGES_TOOL: Any = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": WEATHER_PARAMS,
}


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def anthropic_client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def tokenize_count(server: Server, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> int:
    """Prompt tokens of a chat conversation, from ``POST /tokenize``."""
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    r = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return int(r.json()["count"])


# ---------------------------------------------------------------- openai SDK, /v1/responses


def test_responses_create_usage_adds_up(server: Server) -> None:
    api = openai_client(server)
    r = api.responses.create(
        model="any", instructions=INSTRUCTIONS, input="Say OK.", max_output_tokens=16, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.output_text and r.output_text == "".join(p.text for p in item.content if p.type == "output_text")
    u = r.usage
    assert u is not None
    expected = tokenize_count(
        server, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Say OK."}]
    )
    assert u.input_tokens == expected
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert 1 <= u.output_tokens <= 16
    if r.status == "incomplete":
        assert u.output_tokens == 16
        assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"


def test_responses_input_tokens_counts_what_create_reports(server: Server) -> None:
    """OpenAI's ``POST /v1/responses/input_tokens`` through the SDK: the same count as
    ``usage.input_tokens`` of the same body sent to ``/v1/responses``, tools included."""
    api = openai_client(server)
    tool: Any = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    for kw in (
        {"instructions": INSTRUCTIONS, "input": "Say OK."},
        {"input": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool]},
    ):
        counted = api.responses.input_tokens.count(model="any", **kw)  # type: ignore[arg-type]
        assert counted.object == "response.input_tokens"
        made = api.responses.create(model="any", max_output_tokens=1, temperature=0, **kw)  # type: ignore[arg-type]
        assert made.usage is not None and counted.input_tokens == made.usage.input_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        api.responses.input_tokens.count(model="any", input="x", conversation="conv_1")
    assert "conversation" in str(e.value)


def test_responses_stream_events_and_final_response(server: Server) -> None:
    api = openai_client(server)
    kw: Any = {"model": "any", "instructions": INSTRUCTIONS, "input": "Name a color.", "temperature": 0}
    with api.responses.stream(max_output_tokens=24, **kw) as stream:
        events = list(stream)
        if events[-1].type == "response.completed":
            assert stream.get_final_response().output_text == events[-1].response.output_text
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # The SDK's get_final_response() takes response.completed only; a greedy answer that
    # reaches max_output_tokens ends in response.incomplete, which carries the response too.
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == deltas
    assert final.usage is not None
    # The same request without streaming: same greedy text, same usage.
    plain = api.responses.create(max_output_tokens=24, **kw)
    assert plain.output_text == final.output_text
    assert plain.usage is not None
    assert (plain.usage.input_tokens, plain.usage.output_tokens) == (
        final.usage.input_tokens,
        final.usage.output_tokens,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_tool_round_trip(server: Server, stream: bool) -> None:
    api = openai_client(server)
    kw: Any = {"model": "any", "tools": [RESPONSES_TOOL], "temperature": 0, "max_output_tokens": 80}
    conversation: list[Any] = [{"role": "user", "content": QUESTION}]
    if stream:
        with api.responses.stream(input=conversation, tool_choice="required", **kw) as s:
            events = list(s)
            first = s.get_final_response()
        [args_done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    else:
        first = api.responses.create(input=conversation, tool_choice="required", **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    assert isinstance(args, dict) and isinstance(args.get("city"), str)  # the grammar held the schema
    if stream:
        assert args_done.arguments == call.arguments
    # Second turn: the call and its output go back; the model answers in text.
    conversation += [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21, "sky": "clear"}'},
    ]
    answer = api.responses.create(input=conversation, tool_choice="none", **(kw | {"max_output_tokens": 24}))
    assert answer.output_text
    assert all(o.type == "message" for o in answer.output)


class City(BaseModel):
    name: str
    country: str
    population: int


def test_responses_parse_into_a_pydantic_model(server: Server) -> None:
    r = openai_client(server).responses.parse(
        model="any",
        input="Describe Paris as JSON with name, country and population.",
        text_format=City,
        max_output_tokens=120,
        temperature=0,
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)


# ---------------------------------------------------------------- OpenAI Agents SDK


def test_agents_sdk_runs_a_function_tool(server: Server) -> None:
    set_tracing_disabled(True)  # nothing leaves for OpenAI's trace exporter
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        seen.append(city)
        return f"Sunny, 21 C in {city}"

    async def run() -> RunResult:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0
        ) as api:
            agent = Agent(
                name="weather",
                instructions=INSTRUCTIONS,
                model=OpenAIResponsesModel(model="any", openai_client=api),
                tools=[get_weather],
                # Forced on the first turn; the SDK resets it to auto after a tool
                # ran (reset_tool_choice), so a later turn can answer in text.
                model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
            )
            return await Runner.run(agent, QUESTION, max_turns=4, run_config=RunConfig(tracing_disabled=True))

    result = asyncio.run(run())
    assert seen and all(isinstance(city, str) for city in seen)
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == len(seen) + 1  # each call's turn, then the answer
    for raw in result.raw_responses:
        assert raw.usage.input_tokens > 0 and raw.usage.output_tokens > 0
        assert raw.usage.total_tokens == raw.usage.input_tokens + raw.usage.output_tokens
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == [f"Sunny, 21 C in {city}" for city in seen]


# ---------------------------------------------------------------- anthropic SDK, /v1/messages


def test_messages_create_and_count_tokens(server: Server) -> None:
    api = anthropic_client(server)
    kw: Any = {"model": "any", "system": INSTRUCTIONS, "messages": [{"role": "user", "content": "Say OK."}]}
    counted = api.messages.count_tokens(**kw)
    m = api.messages.create(max_tokens=16, extra_body=GREEDY, **kw)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text  # type: ignore[union-attr]
    assert m.stop_reason in ("end_turn", "max_tokens")
    u = m.usage
    whole = u.input_tokens + (u.cache_read_input_tokens or 0)
    assert counted.input_tokens == whole
    expected = tokenize_count(
        server, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Say OK."}]
    )
    assert whole == expected
    assert 1 <= u.output_tokens <= 16
    if m.stop_reason == "max_tokens":
        assert u.output_tokens == 16


def test_messages_stream_text_and_usage(server: Server) -> None:
    api = anthropic_client(server)
    kw: Any = {
        "model": "any",
        "system": INSTRUCTIONS,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 24,
        "extra_body": GREEDY,
    }
    with api.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text  # type: ignore[union-attr]
    plain = api.messages.create(**kw)
    assert plain.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert plain.usage.output_tokens == final.usage.output_tokens
    whole = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert whole == plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)
    assert (
        api.messages.count_tokens(model="any", system=INSTRUCTIONS, messages=kw["messages"]).input_tokens
        == whole
    )


def test_messages_stream_last_event_carries_the_cumulative_usage(server: Server) -> None:
    """Claude's SDKs take a stream's usage from its last ``message_delta`` (the current API
    sends ``input_tokens`` and both cache counts there, cumulative): a repeated prompt's
    cache hit shows there, equal to ``message_start``'s, and adds up to ``count_tokens``."""
    api = anthropic_client(server)
    story = "Write about a lighthouse keeper who collects shells, one line per shell, " * 4
    kw: Any = {
        "model": "any",
        "system": INSTRUCTIONS,
        "messages": [{"role": "user", "content": story}],
        "max_tokens": 4,
        "extra_body": GREEDY,
    }
    counted = api.messages.count_tokens(model="any", system=INSTRUCTIONS, messages=kw["messages"])
    api.messages.create(**kw)  # fills the prefix cache
    with api.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    last = [e for e in events if e.type == "message_delta"][-1].usage
    assert last.cache_read_input_tokens is not None and last.cache_read_input_tokens > 0
    assert last.cache_read_input_tokens == start.cache_read_input_tokens
    assert last.input_tokens == start.input_tokens
    assert last.cache_creation_input_tokens == 0  # no cache_control breakpoints: nothing written
    assert last.input_tokens + last.cache_read_input_tokens == counted.input_tokens
    assert last.output_tokens == final.usage.output_tokens >= 1
    assert final.usage.cache_read_input_tokens == last.cache_read_input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_round_trip(server: Server, stream: bool) -> None:
    api = anthropic_client(server)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    kw: Any = {"model": "any", "tools": [MESSAGES_TOOL], "max_tokens": 80, "extra_body": GREEDY}
    if stream:
        with api.messages.stream(messages=messages, tool_choice={"type": "any"}, **kw) as s:
            first = s.get_final_message()
    else:
        first = api.messages.create(messages=messages, tool_choice={"type": "any"}, **kw)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses, first.content
    use = uses[0]
    assert use.name == "get_weather" and use.id
    assert isinstance(use.input, dict) and isinstance(use.input.get("city"), str)
    counted = api.messages.count_tokens(
        model="any", messages=messages, tools=[MESSAGES_TOOL], tool_choice={"type": "any"}
    )
    # The forced call's prompt is the same conversation with the same tools.
    assert counted.input_tokens == first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
        },
    ]
    answer = api.messages.create(messages=messages, tool_choice={"type": "none"}, **(kw | {"max_tokens": 24}))
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]


# ---------------------------------------------------------------- vLLM's /tokenize fields


# llama.cpp (llama-cpp-python 0.3.36) on the wheel's SmolLM2-135M-Instruct.Q4_1.gguf,
# tokenize(text, add_bos=False, special=True), 2026-12-05: the same 24 ids.
LLAMA_CPP_TEXT = "The quick brown fox jumps over the lazy dog. <|im_start|> 12345 héllo wörld"
LLAMA_CPP_IDS = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 216, 1, 216]
LLAMA_CPP_IDS += [33, 34, 35, 36, 37, 294, 2756, 31394, 267, 29989, 400]


def test_tokenize_takes_add_special_tokens_both_ways_and_detokenize_skips_specials(server: Server) -> None:
    def tokens(body: dict[str, Any]) -> list[int]:
        r = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return list(r.json()["tokens"])

    bare = tokens({"prompt": LLAMA_CPP_TEXT, "add_special_tokens": False})
    assert bare == LLAMA_CPP_IDS
    # SmolLM2's tokenizer puts no BOS before plain text: the default and true are the same ids.
    assert (
        tokens({"prompt": LLAMA_CPP_TEXT})
        == tokens({"prompt": LLAMA_CPP_TEXT, "add_special_tokens": True})
        == bare
    )
    messages = [{"role": "user", "content": "hi"}]
    assert tokens({"messages": messages, "add_special_tokens": True}) == tokens({"messages": messages})
    chat = tokens({"messages": messages})
    r = httpx.post(
        server.base_url + "/detokenize", json={"tokens": chat, "skip_special_tokens": True}, timeout=60
    )
    plain = r.json()["prompt"]
    full = httpx.post(server.base_url + "/detokenize", json={"tokens": chat}, timeout=60).json()["prompt"]
    assert "<|im_start|>" in full and "<|im_start|>" not in plain and plain.strip().endswith("assistant")
    # llama.cpp's /apply-template: the same conversation's prompt text, whose ids are the same.
    rendered = httpx.post(server.base_url + "/apply-template", json={"messages": messages}, timeout=60)
    assert rendered.json()["prompt"] == full
    assert tokens({"prompt": full, "add_special_tokens": False}) == chat
