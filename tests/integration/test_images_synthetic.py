"""An image request end to end in every chat-shaped dialect, through the real proxy
and a real synthetic worker that takes images (``--synthetic-image-tokens``) and
keeps a prefix cache (``--synthetic-prefix-cache``): its prompt tokens count the
image's, progress runs over them, and a second request that repeats the image
reads it from the cache, while another image is computed again."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from httpx_sse import aconnect_sse

from tests.integration.synthetic import served_proxy, synthetic_worker
from tests.unit.proxy.core.test_images import picture

IMAGE_TOKENS = 16
RED = base64.b64encode(picture("PNG", (6, 6))).decode()
BLUE = base64.b64encode(picture("JPEG", (9, 9))).decode()

# "user:" "What" "is" <16 image tokens> "this?" "assistant:" (engine_worker.synthetic)
FIRST_PROMPT = 1 + 2 + IMAGE_TOKENS + 1 + 1
# ... then "x" (the assistant's reply), "user:" "and" "now?" "assistant:"
SECOND_PROMPT = FIRST_PROMPT + 1 + 4


@pytest.fixture
async def base_url(tmp_path: Path) -> AsyncIterator[str]:
    args = ("--synthetic-image-tokens", str(IMAGE_TOKENS), "--synthetic-prefix-cache")
    with synthetic_worker(tmp_path, *args, "--synthetic-step-ms", "2", "--chunk-size", "8") as addrs:
        async with served_proxy(addrs) as url:
            yield url


def _chat(image: str, follow_up: bool) -> tuple[str, dict[str, Any]]:
    turn = [
        {"type": "text", "text": "What is"},
        {"type": "image_url", "image_url": {"url": f"data:image/{_kind(image)};base64,{image}"}},
        {"type": "text", "text": "this?"},
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": turn}]
    if follow_up:
        messages += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "and now?"}]
    body = {"model": "m", "max_tokens": 3, "messages": messages, "stream_options": {"include_usage": True}}
    return "/v1/chat/completions", body


def _responses(image: str, follow_up: bool) -> tuple[str, dict[str, Any]]:
    turn = [
        {"type": "input_text", "text": "What is"},
        {"type": "input_image", "image_url": f"data:image/{_kind(image)};base64,{image}"},
        {"type": "input_text", "text": "this?"},
    ]
    items: list[dict[str, Any]] = [{"role": "user", "content": turn}]
    if follow_up:
        items += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "and now?"}]
    return "/v1/responses", {"model": "m", "max_output_tokens": 3, "input": items}


def _messages(image: str, follow_up: bool) -> tuple[str, dict[str, Any]]:
    source = {"type": "base64", "media_type": f"image/{_kind(image)}", "data": image}
    turn = [
        {"type": "text", "text": "What is"},
        {"type": "image", "source": source},
        {"type": "text", "text": "this?"},
    ]
    messages: list[dict[str, Any]] = [{"role": "user", "content": turn}]
    if follow_up:
        messages += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "and now?"}]
    return "/v1/messages", {"model": "m", "max_tokens": 3, "messages": messages}


def _kind(image: str) -> str:
    """``png`` or ``jpeg``, by the file's signature (the pictures here are one or the other)."""
    return "png" if base64.b64decode(image[:8]).startswith(b"\x89PNG") else "jpeg"


_RESPONSE_ENDS = ("response.completed", "response.incomplete")  # max_output_tokens ends these


def _usage(path: str, events: list[dict[str, Any]]) -> tuple[int, int]:
    """``(prompt tokens, cached tokens)`` from a stream's last usage, in each dialect's terms."""
    if path == "/v1/chat/completions":
        usage = [e["usage"] for e in events if e.get("usage")][-1]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    if path == "/v1/responses":
        usage = next(e["response"]["usage"] for e in events if e.get("type") in _RESPONSE_ENDS)
        return usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
    usage = next(e["usage"] for e in events if e.get("type") == "message_delta")
    cached = usage["cache_read_input_tokens"]
    return usage["input_tokens"] + cached, cached


def _progress(events: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    return [
        (p["total"], p["cache"], p["processed"])
        for p in (e.get("prompt_progress") for e in events)
        if p is not None
    ]


async def _stream(
    client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    body = {**body, "stream": True, "return_progress": True}
    async with aconnect_sse(client, "POST", url + path, json=body) as source:
        assert source.response.status_code == 200, await source.response.aread()
        async for ev in source.aiter_sse():
            if ev.data != "[DONE]":
                events.append(orjson.loads(ev.data))
    return events


@pytest.mark.parametrize("dialect", [_chat, _responses, _messages], ids=["chat", "responses", "messages"])
async def test_image_tokens_progress_and_cache_hits_by_image(base_url: str, dialect: Any) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        path, first = dialect(RED, follow_up=False)
        events = await _stream(client, base_url, path, first)
        assert _usage(path, events) == (FIRST_PROMPT, 0)
        progress = _progress(events)
        assert progress[0] == (FIRST_PROMPT, 0, 0) and progress[-1] == (FIRST_PROMPT, 0, FIRST_PROMPT)

        # The same image again, with more conversation after it: the whole first prompt is cached.
        path, second = dialect(RED, follow_up=True)
        events = await _stream(client, base_url, path, second)
        assert _usage(path, events) == (SECOND_PROMPT, FIRST_PROMPT)
        assert _progress(events)[0] == (SECOND_PROMPT, FIRST_PROMPT, FIRST_PROMPT)

        # Another image at the same place: only "user:" "What" "is" before it are shared.
        path, other = dialect(BLUE, follow_up=True)
        events = await _stream(client, base_url, path, other)
        assert _usage(path, events) == (SECOND_PROMPT, 3)


async def test_count_tokens_counts_the_image(base_url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        _, body = _messages(RED, follow_up=False)
        del body["max_tokens"]
        resp = await client.post(base_url + "/v1/messages/count_tokens", json=body)
        assert resp.json() == {"input_tokens": FIRST_PROMPT}
        props = (await client.get(base_url + "/props")).json()
        assert props["modalities"] == {"vision": True, "audio": False}


async def test_the_prompt_text_of_a_conversation_with_an_image_is_refused_naming_it(
    base_url: str,
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        _, body = _chat(RED, follow_up=False)
        resp = await client.post(base_url + "/apply-template", json=body)
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "messages[0].content[1]"
        # /tokenize takes the same conversation and counts the image as generation does
        resp = await client.post(base_url + "/tokenize", json={"messages": body["messages"]})
        assert resp.json()["count"] == FIRST_PROMPT
        del body["messages"][0]["content"][1]
        resp = await client.post(base_url + "/apply-template", json=body)
        assert resp.status_code == 200
        ids = (await client.post(base_url + "/tokenize", json={"messages": body["messages"]})).json()
        text = (await client.post(base_url + "/detokenize", json={"tokens": ids["tokens"]})).json()
        assert resp.json()["prompt"] == text["prompt"]
