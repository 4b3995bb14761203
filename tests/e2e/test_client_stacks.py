"""The client stacks of issue 19, each on the real embedded model through
``exl3-sidecar serve`` at temperature 0, used the way their documentation
shows: openai-python's ``parse``, pydantic-ai's default structured output
(``ToolOutput``: a forced call of its ``final_result`` tool), instructor in
``JSON_SCHEMA`` mode, LangChain's ``with_structured_output`` (its default
method), the OpenAI Agents SDK's agent with a tool and an ``output_type``
(chat completions and Responses), and LiteLLM's forced tool call.

Each test asserts what the server must guarantee (an object of the declared
type; a call of the named function with a JSON object of the declared
arguments) and, where the client hides it, that the request took the path
under test (read from the request body); never what a 135M model happens to
say."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

PROMPT = "Describe Paris as JSON with name, country and population."
# Room for the answer (about 25 tokens) or a call (about 30) with margin.
MAX_TOKENS = 200


class City(BaseModel):
    # No other keys: with them allowed, the grammar let SmolLM2 add a
    # "population_density" of 150 zeros until max_tokens (greedy, 2026-12-02).
    model_config = ConfigDict(extra="forbid")

    name: str
    country: str
    population: int


class Recorder:
    """The JSON bodies of the requests an ``openai`` client sends, read by an
    httpx request hook (the SDK's own client, so its defaults stay)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def record(self, request: Any) -> None:
        self.bodies.append(json.loads(request.content))

    async def _arecord(self, request: Any) -> None:
        self.record(request)

    def client(self, server: Server) -> openai.OpenAI:
        http = openai.DefaultHttpxClient(event_hooks={"request": [self.record]})
        return openai.OpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, http_client=http
        )

    def async_client(self, server: Server) -> openai.AsyncOpenAI:
        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._arecord]})
        return openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, http_client=http
        )


def test_openai_parse(server: Server) -> None:
    with Recorder().client(server) as api:
        completion = api.chat.completions.parse(
            model="any",
            messages=[{"role": "user", "content": PROMPT}],
            response_format=City,
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)


async def test_pydantic_ai_default_tool_output(server: Server) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    rec = Recorder()
    async with rec.async_client(server) as client:
        model = OpenAIChatModel("any", provider=OpenAIProvider(openai_client=client))
        # output_type a model class: pydantic-ai's default is ToolOutput.
        agent = Agent(model, output_type=City, retries=0)
        result = await agent.run(PROMPT, model_settings={"temperature": 0, "max_tokens": MAX_TOKENS})
    assert isinstance(result.output, City)
    # The path under test: the object came as a forced call of its output tool.
    (body,) = rec.bodies
    assert body["tool_choice"] == "required"
    assert [t["function"]["name"] for t in body["tools"]] == ["final_result"]
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert [type(p) for p in responses[0].parts] == [ToolCallPart]
    assert responses[0].parts[0].tool_name == "final_result"


def test_instructor_json_schema_mode(server: Server) -> None:
    import instructor

    rec = Recorder()
    with rec.client(server) as api:
        client = instructor.from_openai(api, mode=instructor.Mode.JSON_SCHEMA)
        city = client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": PROMPT}],
            response_model=City,
            temperature=0,
            max_tokens=MAX_TOKENS,
            max_retries=0,  # a retry would hide a first answer that did not validate
        )
    assert isinstance(city, City)
    (body,) = rec.bodies
    assert body["response_format"]["type"] == "json_schema"


def test_langchain_with_structured_output(server: Server) -> None:
    from langchain_openai import ChatOpenAI

    rec = Recorder()
    with openai.DefaultHttpxClient(event_hooks={"request": [rec.record]}) as http:
        llm = ChatOpenAI(
            model="any",
            base_url=server.base_url + "/v1",
            api_key="unused",
            temperature=0,
            max_tokens=MAX_TOKENS,
            max_retries=0,
            http_client=http,
        )
        out = llm.with_structured_output(City, include_raw=True).invoke(PROMPT)
    assert out["parsing_error"] is None
    assert isinstance(out["parsed"], City)
    # Its default method for ChatOpenAI is json_schema.
    (body,) = rec.bodies
    assert body["response_format"]["type"] == "json_schema"


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
async def test_openai_agents_tool_and_output_type(server: Server, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
    )

    rec = Recorder()
    calls: list[str] = []

    # The lookup is offered until it has been called once: whichever the model
    # picks first (the call or the answer, one grammar), the run ends with the
    # answer rather than with a small model repeating the call until max_turns.
    @function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_population(city: str) -> int:
        """Population of a city."""
        calls.append(city)
        return 2_100_000

    async with rec.async_client(server) as client:
        model = (
            OpenAIChatCompletionsModel(model="any", openai_client=client)
            if api == "chat_completions"
            else OpenAIResponsesModel(model="any", openai_client=client)
        )
        agent = Agent(
            name="cities",
            instructions="Answer about cities.",
            tools=[get_population],
            output_type=City,
            model=model,
            model_settings=ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
        )
        result = await Runner.run(agent, PROMPT, max_turns=3, run_config=RunConfig(tracing_disabled=True))
    assert isinstance(result.final_output, City)
    # The first request is the standard agent's: a tool beside the output schema.
    first = rec.bodies[0]
    assert [t.get("name") or t["function"]["name"] for t in first["tools"]] == ["get_population"]
    schema_format = first["response_format"] if api == "chat_completions" else first["text"]["format"]
    assert schema_format["type"] == "json_schema"
    assert len(rec.bodies) == 1 + len(calls)


def test_litellm_forced_tool_call(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its model cost map is fetched from the network at import unless told not to.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    rec = Recorder()
    # Its own client otherwise stays cached, open, for the rest of the session.
    with rec.client(server) as api:
        response = litellm.completion(
            model="openai/any",
            api_base=server.base_url + "/v1",
            api_key="unused",
            client=api,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=40,  # the case: the call fits in 40 tokens
            num_retries=0,
        )
    (body,) = rec.bodies
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    message = response.choices[0].message
    assert not message.content
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
