"""Error messages quote a bounded prefix of what the client sent, and say what
is wrong with a body msgspec misreports (issue 33)."""

from __future__ import annotations

from proxy.errors import MAX_MESSAGE_CHARS, InvalidRequest, quoted
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient

URL = "/v1/chat/completions"


def test_quoted_keeps_short_values_and_cuts_long_ones() -> None:
    assert quoted("get_weather") == "'get_weather'"
    long = quoted("x" * 1_000_000)
    assert long == repr("x" * 64) + "... (1000000 characters)"
    assert len(quoted(list(range(10_000)))) <= 64 + 5


def test_every_message_is_bounded() -> None:
    e = InvalidRequest("y" * 100_000)
    assert len(e.message) < MAX_MESSAGE_CHARS + 40 and str(e) == e.message


async def test_a_huge_tool_name_gives_a_small_error(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client()
    name = "n" * 1_000_000
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": name}}],
    }
    for path, payload in (
        (URL, body),
        ("/v1/messages", {**body, "max_tokens": 5, "tools": [{"name": name}]}),
    ):
        r = await client.post(path, json=payload)
        assert r.status == 400
        text = await r.text()
        assert len(text) < 3000, path
        assert "1000000 characters" in text or "nnnn" in text
    assert fake.submits == []


async def test_a_lone_surrogate_is_named(make_client: MakeClient) -> None:
    client = await make_client()
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    r = await client.post(URL, data=raw, headers={"Content-Type": "application/json"})
    assert r.status == 400
    message = (await r.json())["error"]["message"]
    assert "lone UTF-16 surrogate" in message and "\\ud800" in message
    assert "truncated" not in message
