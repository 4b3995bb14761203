"""Image parts in the three chat-shaped dialects, through the app: what the worker
is sent (bytes, offset, the part's name), and every refusal in the dialect's own
error shape, naming the part."""

from __future__ import annotations

import base64
from typing import Any

import anthropic
import msgspec
import openai
import pytest
from aiohttp.test_utils import TestClient

from protocol.messages import MODALITY_IMAGE, MODALITY_TEXT, ChatMessage, ImageInput
from tests.fakes.engine_client import WORKER, FakeEngineClient
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.core.test_images import picture, png_header_only

VISION = msgspec.structs.replace(WORKER, modalities=(MODALITY_TEXT, MODALITY_IMAGE))
PNG = picture("PNG")
JPEG = picture("JPEG", (8, 8))
B64 = base64.b64encode(PNG).decode()
URL = "data:image/png;base64," + B64


def chat_body(content: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content}], **extra}


def responses_body(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "max_output_tokens": 4, "input": [{"role": "user", "content": content}]}


def messages_body(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}


CHAT_PARTS = [
    {"type": "text", "text": "What is"},
    {"type": "image_url", "image_url": {"url": URL, "detail": "high"}},
    {"type": "text", "text": "this?"},
]
RESPONSES_PARTS = [
    {"type": "input_text", "text": "What is"},
    {"type": "input_image", "image_url": URL, "detail": "auto"},
    {"type": "input_text", "text": "this?"},
]
MESSAGES_PARTS = [
    {"type": "text", "text": "What is"},
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
    {"type": "text", "text": "this?"},
]
CASES = [
    ("/v1/chat/completions", chat_body(CHAT_PARTS), "messages[0].content[1]"),
    ("/v1/responses", responses_body(RESPONSES_PARTS), "input[0].content[1]"),
    ("/v1/messages", messages_body(MESSAGES_PARTS), "messages[0].content[1]"),
]
IDS = ["chat", "responses", "messages"]


def error_of(path: str, body: dict[str, Any]) -> tuple[str, str | None, str]:
    """``(type, param, message)`` of an error body in its dialect's shape."""
    if path == "/v1/messages":
        assert body["type"] == "error" and set(body) == {"type", "error"}
        return body["error"]["type"], None, body["error"]["message"]
    err = body["error"]
    return err["type"], err["param"], err["message"]


@pytest.mark.parametrize(("path", "body", "part"), CASES, ids=IDS)
async def test_the_worker_gets_the_image_at_its_place(
    make_client: MakeClient, fake: FakeEngineClient, path: str, body: dict[str, Any], part: str
) -> None:
    fake.worker_ready = VISION
    client = await make_client()
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    (submit,) = fake.submits
    assert submit.messages[-1] == ChatMessage("user", "What is\n\nthis?", images=(ImageInput(PNG, 8, part),))


@pytest.mark.parametrize(("path", "body", "part"), CASES, ids=IDS)
async def test_a_text_only_model_refuses_the_part_in_the_dialects_shape(
    make_client: MakeClient, fake: FakeEngineClient, path: str, body: dict[str, Any], part: str
) -> None:
    client = await make_client()  # WORKER: text only, as the CPU engine
    resp = await client.post(path, json=body)
    assert resp.status == 400
    kind, param, message = error_of(path, await resp.json())
    assert kind == "invalid_request_error"
    assert param in (part, None)
    assert f"'{part}' is an image" in message and "reads text only" in message
    assert fake.submits == []


async def _refusal(client: TestClient[Any, Any], path: str, body: dict[str, Any]) -> tuple[str | None, str]:
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    _, param, message = error_of(path, await resp.json())
    return param, message


async def test_what_each_dialect_refuses_by_name(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.worker_ready = VISION
    client = await make_client()
    system_image = {
        "model": "m",
        "messages": [{"role": "system", "content": [CHAT_PARTS[1]]}, {"role": "user", "content": "hi"}],
    }
    param, message = await _refusal(client, "/v1/chat/completions", system_image)
    assert param == "messages[0].content[0]" and "user messages" in message
    fetch = chat_body([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])
    param, message = await _refusal(client, "/v1/chat/completions", fetch)
    assert param == "messages[0].content[0]" and "does not fetch" in message

    file_part = responses_body([{"type": "input_image", "file_id": "file-1"}])
    param, message = await _refusal(client, "/v1/responses", file_part)
    assert param == "input[0].content[0].file_id" and "stores no files" in message

    url_source = messages_body([{"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}])
    _, message = await _refusal(client, "/v1/messages", url_source)
    assert "'messages[0].content[0]' is an image URL" in message
    bad_type = messages_body(
        [{"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": B64}}]
    )
    _, message = await _refusal(client, "/v1/messages", bad_type)
    assert "'image/tiff'" in message
    assistant = {
        "model": "m",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [MESSAGES_PARTS[1]]},
            {"role": "user", "content": "and?"},
        ],
    }
    _, message = await _refusal(client, "/v1/messages", assistant)
    assert "'messages[1].content[0]'" in message and "image (user)" in message
    assert fake.submits == []


async def test_limits_refuse_before_the_worker(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.worker_ready = VISION
    client = await make_client(max_images=1, max_image_pixels=1000)
    two = chat_body([CHAT_PARTS[1], CHAT_PARTS[1]])
    param, message = await _refusal(client, "/v1/chat/completions", two)
    assert param == "messages[0].content[1]" and "max_images=1" in message
    bomb = "data:image/png;base64," + base64.b64encode(png_header_only(40_000, 40_000)).decode()
    big = chat_body([{"type": "image_url", "image_url": {"url": bomb}}])
    param, message = await _refusal(client, "/v1/chat/completions", big)
    assert param == "messages[0].content[0]" and "40000 x 40000" in message
    broken = "data:image/png;base64," + base64.b64encode(picture("PNG", (20, 20))[:60]).decode()
    param, message = await _refusal(
        client, "/v1/chat/completions", chat_body([{"type": "image_url", "image_url": {"url": broken}}])
    )
    assert param == "messages[0].content[0]" and "could not be decoded" in message
    assert fake.submits == []


async def test_images_in_the_history_and_with_the_tools_prompt(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.worker_ready = VISION
    client = await make_client()
    jpeg = "data:image/jpeg;base64," + base64.b64encode(JPEG).decode()
    body = {
        "model": "m",
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "a?"}],
            },
            {"role": "assistant", "content": "A cat."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and"},
                    {"type": "image_url", "image_url": {"url": jpeg}},
                ],
            },
        ],
        # no native tools in the fake's template: the generic tools prompt renders the turns
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    (submit,) = fake.submits
    assert submit.messages[0].role == "system" and not submit.messages[0].images  # the tools prompt
    assert [(m.content, m.images) for m in submit.messages[1:]] == [
        ("\na?", (ImageInput(PNG, 0, "messages[0].content[0]"),)),
        ("A cat.", ()),
        ("and\n", (ImageInput(JPEG, 4, "messages[2].content[1]"),)),
    ]


async def test_the_sdks_send_images_as_their_docs_show(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.worker_ready = VISION
    client = await make_client()
    base = str(client.make_url(""))
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as api:
        await api.chat.completions.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": CHAT_PARTS}],  # type: ignore[list-item]
        )
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as claude:
        await claude.messages.create(
            model="m",
            max_tokens=4,
            messages=[{"role": "user", "content": MESSAGES_PARTS}],  # type: ignore[list-item]
        )
    assert [s.messages[-1].images for s in fake.submits] == [
        (ImageInput(PNG, 8, "messages[0].content[1]"),),
        (ImageInput(PNG, 8, "messages[0].content[1]"),),
    ]


async def test_props_and_models_say_what_the_model_reads(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    assert (await (await client.get("/props")).json())["modalities"] == {"vision": False, "audio": False}
    card = (await (await client.get("/v1/models")).json())["data"][0]
    assert card["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}
    fake.worker_ready = VISION
    assert (await (await client.get("/props")).json())["modalities"] == {"vision": True, "audio": False}
    card = await (await client.get("/v1/models/any")).json()
    assert card["architecture"]["input_modalities"] == ["text", "image"]


async def test_a_tool_returns_an_image(make_client: MakeClient, fake: FakeEngineClient) -> None:
    """A screenshot in an Anthropic ``tool_result`` and in a Responses
    ``function_call_output``: it stays at its place when the generic tools prompt
    wraps the result (``<tool_response>\\n`` before it, ``Error: `` for an error)."""
    fake.worker_ready = VISION
    client = await make_client()
    tool = {"name": "shot", "input_schema": {"type": "object"}}
    body = {
        "model": "m",
        "max_tokens": 4,
        "tools": [tool],
        "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "is_error": True,
                        "content": [{"type": "text", "text": "cut"}, MESSAGES_PARTS[1]],
                    }
                ],
            },
        ],
    }
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200, await resp.text()
    result = fake.submits[-1].messages[-1]
    assert result.role == "user"
    offset = len("<tool_response>\nError: cut\n")
    assert result.content == "<tool_response>\nError: cut\n\n</tool_response>"
    assert result.images == (ImageInput(PNG, offset, "messages[2].content[0].content[1]"),)

    body = {
        "model": "m",
        "max_output_tokens": 4,
        "tools": [{"type": "function", "name": "shot", "parameters": {"type": "object"}}],
        "input": [
            {"role": "user", "content": "look"},
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [RESPONSES_PARTS[1]]},
        ],
    }
    resp = await client.post("/v1/responses", json=body)
    assert resp.status == 200, await resp.text()
    result = fake.submits[-1].messages[-1]
    assert result.content == "<tool_response>\n\n</tool_response>"
    assert result.images == (ImageInput(PNG, len("<tool_response>\n"), "input[2].output[0]"),)
