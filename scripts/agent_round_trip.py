"""A tool-call round trip and a schema-constrained answer on a running server,
with the official ``openai`` SDK (what ``tests/e2e/test_agent_features.py``
asserts, printed)::

    pip install -e '.[examples]'   # the openai SDK and pydantic
    exl3-sidecar serve --port 5057
    python scripts/agent_round_trip.py http://127.0.0.1:5057/v1

A request the server refuses is printed as the server's message (status, code,
message), exit status 1, not as the SDK's traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import openai
from pydantic import BaseModel

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


class City(BaseModel):
    name: str
    country: str
    population: int


def main(base_url: str) -> None:
    api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = api.chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=80, seed=1
    ).choices[0]
    calls = first.message.tool_calls or []
    print("turn 1:", first.finish_reason, [(c.id, c.function.name, c.function.arguments) for c in calls])
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temp_c": 21, "sky": "clear"})},
    ]
    second = api.chat.completions.create(
        model="any", messages=messages, tools=[WEATHER], max_tokens=40, seed=1
    )
    print("turn 2:", second.choices[0].finish_reason, repr(second.choices[0].message.content))
    parsed = api.chat.completions.parse(
        model="any",
        messages=[{"role": "user", "content": "Describe Paris as JSON with name, country and population."}],
        response_format=City,
        max_tokens=120,
        seed=3,
    ).choices[0]
    print("schema:", parsed.finish_reason, parsed.message.content, "->", parsed.message.parsed)


if __name__ == "__main__":
    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:5000/v1"
    try:
        main(url)
    except openai.APIStatusError as e:
        body: Any = e.body  # the SDK's: the envelope's "error" object
        if isinstance(body, dict) and body.get("message"):
            kind = body.get("code") or body.get("type")
            sys.exit(f"the server refused: {e.status_code} {kind}: {body['message']}")
        sys.exit(f"the server refused: {e.status_code} {e.message}")
    except openai.APIConnectionError as e:
        sys.exit(f"cannot reach {url}: {e}")
