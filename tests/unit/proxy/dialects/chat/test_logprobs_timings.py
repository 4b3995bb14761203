"""Logprobs (chat and text shapes), llama.cpp ``timings`` and ``echo`` as the
proxy assembles them from the worker's events, read back with the official
``openai`` SDK and as raw JSON."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from openai import AsyncOpenAI

from protocol import (
    Event,
    Finished,
    FinishReason,
    PrefillProgress,
    Started,
    Submit,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from tests.fakes.engine_client import FakeEngineClient, Pause, Step, completion_events, static_script
from tests.unit.proxy.conftest import MakeClient

# (token text, logprob) per generated token; "" is a token that ends inside a
# UTF-8 character and adds no text until the next one.
TOKENS = [("Hel", -0.1), ("lo", -0.25), ("", -1.5), ("\u00e9!", -0.75)]
TIMES = (0.01, 0.2, 0.5)  # queued, prefill, decode seconds


def _lp(text: str, logprob: float) -> TokenLogprob:
    top = (TopLogprob(text, logprob, text.encode()), TopLogprob("x", logprob - 1, b"x"))
    return TokenLogprob(text, logprob, text.encode() or b"\xc3", top)


def scripted(submit: Submit) -> list[Step]:
    rid = submit.request_id
    k = submit.params.logprobs
    events: list[Event] = [
        Started(rid, 12, 4),
        PrefillProgress(rid, 12, 4, 4, 0),
        PrefillProgress(rid, 12, 4, 12, 30),
    ]
    for text, lp in TOKENS:
        entry = _lp(text, lp)
        if k is not None:
            entry = TokenLogprob(entry.token, entry.logprob, entry.token_bytes, entry.top[:k])
        events.append(TokenDelta(rid, text, 1, None if k is None else (entry,)))
    events.append(Finished(rid, FinishReason.STOP, 12, 4, len(TOKENS), 3, 1, *TIMES))
    return list(events)


CONTENT = "".join(t for t, _ in TOKENS)


def sdk(client: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)


async def test_chat_logprobs_stream_and_non_stream_join_to_the_content(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = scripted
    client = await make_client()
    messages: Any = [{"role": "user", "content": "hi"}]
    async with sdk(client) as api:
        r = await api.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=2)
        stream = await api.chat.completions.create(
            model="m", messages=messages, logprobs=True, top_logprobs=1, stream=True
        )
        chunks = [c async for c in stream]
    assert fake.choices[0].params.logprobs == 2
    choice = r.choices[0]
    assert choice.message.content == CONTENT
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert [e.token for e in entries] == [t for t, _ in TOKENS]
    assert "".join(e.token for e in entries) == CONTENT
    assert [e.logprob for e in entries] == [lp for _, lp in TOKENS]
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert entries[0].bytes == list(b"Hel")
    # Stream: each chunk's tokens join to that chunk's content; the token that
    # added no text rides on the next chunk.
    streamed = []
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            lps = c.choices[0].logprobs
            assert lps is not None and lps.content is not None
            assert "".join(e.token for e in lps.content) == c.choices[0].delta.content
            assert all(len(e.top_logprobs) == 1 for e in lps.content)
            streamed += lps.content
    assert [(e.token, e.logprob) for e in streamed] == TOKENS


async def test_text_logprobs_have_offsets_and_echo_puts_the_prompt_first(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = scripted
    client = await make_client()
    async with sdk(client) as api:
        r = await api.completions.create(model="m", prompt="Say: ", logprobs=2)
        echoed = await api.completions.create(model="m", prompt="Say: ", echo=True)
        stream = await api.completions.create(model="m", prompt="Say: ", echo=True, stream=True)
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    lp = r.choices[0].logprobs
    assert r.choices[0].text == CONTENT
    assert lp is not None and lp.tokens == [t for t, _ in TOKENS]
    assert lp.token_logprobs == [v for _, v in TOKENS]
    offsets, at = [], 0
    for t, _ in TOKENS:
        offsets.append(at)
        at += len(t)
    assert lp.text_offset == offsets
    assert lp.top_logprobs is not None and lp.top_logprobs[0] == {"Hel": -0.1, "x": -1.1}
    assert echoed.choices[0].text == "Say: " + CONTENT
    assert echoed.choices[0].logprobs is None
    assert streamed == "Say: " + CONTENT


async def test_timings_on_every_chunk_and_the_response_only_when_asked(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = scripted
    client = await make_client()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "timings_per_token": True}
    r = await (await client.post("/v1/chat/completions", json=body)).json()
    t = r["timings"]
    prompt_ms, decode_ms = TIMES[1] * 1000, TIMES[2] * 1000
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (4, 8, len(TOKENS))
    assert t["prompt_ms"] == pytest.approx(prompt_ms)
    assert t["prompt_per_token_ms"] == pytest.approx(prompt_ms / 8)
    assert t["prompt_per_second"] == pytest.approx(8 / TIMES[1])
    assert t["predicted_ms"] == pytest.approx(decode_ms)
    assert t["predicted_per_second"] == pytest.approx(len(TOKENS) / TIMES[2])
    assert (t["draft_n"], t["draft_n_accepted"]) == (4, 3)

    resp = await client.post("/v1/chat/completions", json={**body, "stream": True, "return_progress": True})
    chunks = [
        orjson.loads(line[6:]) for line in (await resp.text()).splitlines() if line.startswith("data: {")
    ]
    assert all("timings" in c for c in chunks)
    assert chunks[-1]["timings"] == t  # the last chunk carries the worker's final numbers
    running = [c["timings"]["predicted_n"] for c in chunks]
    assert running == sorted(running)
    plain = await (
        await client.post("/v1/chat/completions", json={**body, "timings_per_token": False})
    ).json()
    assert "timings" not in plain
    assert math.isclose(plain["usage"]["prompt_time"], TIMES[1])


def _stream_timings(text: str) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each chunk's ``timings`` and its ``prompt_progress`` (``None`` on others)."""
    chunks = [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return [(c["timings"], c.get("prompt_progress")) for c in chunks]


async def test_timings_during_prefill_count_what_was_processed_so_far(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    # llama.cpp's get_timings: prompt_n = n_prompt_tokens_processed, the rates over it.
    fake.script = static_script(["a", "b"], prompt_tokens=40, cached_tokens=8, chunk=8)
    client = await make_client()
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "return_progress": True,
        "timings_per_token": True,
    }
    seen = _stream_timings(await (await client.post("/v1/chat/completions", json=body)).text())
    during = [(t, p) for t, p in seen if p is not None]
    assert [t["prompt_n"] for t, _ in during] == [0, 8, 16, 24, 32]  # processed - cached, chunk by chunk
    for t, p in during:
        assert t["cache_n"] == 8 and t["prompt_n"] == p["processed"] - p["cache"]
        assert t["prompt_ms"] == p["time_ms"]
        if t["prompt_n"]:
            assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] / p["time_ms"] * 1000, rel=1e-3)
            assert t["prompt_per_token_ms"] == pytest.approx(p["time_ms"] / t["prompt_n"], rel=1e-3)
    rates = [t["prompt_per_second"] for t, _ in during if t["prompt_n"]]
    assert len(set(rates)) == 1  # 8 tokens per 10 ms each chunk: one rate, not a falling one


async def test_no_time_in_timings_goes_backwards_to_the_last_chunk(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    # The worker's final decode time (1 µs here) can be below what the proxy measured
    # since the first token; the last chunk must not report less than the one before.
    def script(submit: Submit) -> list[Step]:
        events = completion_events(submit.request_id, ["a", "b", "c"], times=(0.0, 0.0001, 0.000001))
        return [*events[:-2], Pause(0.02), *events[-2:]]

    fake.script = script
    client = await make_client()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    seen = _stream_timings(
        await (await client.post("/v1/chat/completions", json={**body, "timings_per_token": True})).text()
    )
    for key in ("prompt_ms", "predicted_ms"):
        values = [t[key] for t, _ in seen]
        assert values == sorted(values), (key, values)
    assert seen[-1][0]["predicted_ms"] >= 20  # the proxy's 20 ms, not the worker's 0.001
