"""Images end to end on ExLlamaV3's path, without a GPU: the real proxy in front of the real
worker loop running ``ExLlamaV3Backend`` over the fake 1.6.5 generator and its vision
component (``tests/fakes/exllamav3``: one embedding row per 28 x 28 pixels, wrapped in a
start and an end token). In every chat-shaped dialect: the prompt tokens count the image's,
progress runs over them, a second request that repeats the image (and its conversation)
finds it in the prefix cache, and another image misses from where it starts."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_worker.settings import WorkerSettings
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import make_backend
from tests.integration.synthetic import served_proxy
from tests.integration.test_exllamav3_through_proxy import running_worker
from tests.integration.test_images_synthetic import _chat, _messages, _progress, _responses, _stream, _usage
from tests.unit.proxy.core.test_images import picture

RED = base64.b64encode(picture("PNG", (84, 56))).decode()  # 3 x 2 rows
BLUE = base64.b64encode(picture("JPEG", (84, 56))).decode()
ROWS = fx.image_rows(84, 56)


def _ids(text: str) -> list[int]:
    return fx.Tokenizer().encode(text, encode_special_tokens=True).tolist()[0]


# The ChatML prompt of the dialects' first request: "What is", the image, "this?" (parts
# joined with newlines, the image an empty part), then the reply "Hel" (3 tokens) ...
HEAD = _ids("<|im_start|>user\nWhat is\n")
TAIL = _ids("\nthis?<|im_end|>\n<|im_start|>assistant\n")
FIRST_PROMPT = len(HEAD) + 1 + ROWS + 1 + len(TAIL)
# ... and the follow-up: the reply "x" as the assistant's turn and a new question.
SECOND_PROMPT = FIRST_PROMPT + len(
    _ids("x<|im_end|>\n<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n")
)


@pytest.fixture
async def base_url(tmp_path: Path) -> AsyncIterator[str]:
    backend, rec = make_backend(
        WorkerSettings(backend="exllamav3", model_dir=Path("/models/fake-vl")), vision=True
    )
    addrs = f"ipc://{tmp_path / 'in'}", f"ipc://{tmp_path / 'out'}"
    with running_worker(backend, rec, addrs):
        async with served_proxy(addrs) as url:
            yield url


@pytest.mark.parametrize("dialect", [_chat, _responses, _messages], ids=["chat", "responses", "messages"])
async def test_image_tokens_progress_and_cache_hits_by_image(base_url: str, dialect: Any) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        path, first = dialect(RED, follow_up=False)
        events = await _stream(client, base_url, path, first)
        assert _usage(path, events) == (FIRST_PROMPT, 0)
        progress = _progress(events)
        assert progress[0] == (FIRST_PROMPT, 0, 0) and progress[-1] == (FIRST_PROMPT, 0, FIRST_PROMPT)

        # The same image, the conversation going on: the whole first prompt is cached.
        path, second = dialect(RED, follow_up=True)
        events = await _stream(client, base_url, path, second)
        assert _usage(path, events) == (SECOND_PROMPT, FIRST_PROMPT)

        # Another image at the same place: its ids are new, the hit ends at its start token.
        path, other = dialect(BLUE, follow_up=True)
        events = await _stream(client, base_url, path, other)
        assert _usage(path, events) == (SECOND_PROMPT, len(HEAD) + 1)


async def test_props_and_models_say_the_model_takes_images(base_url: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        props = (await client.get(base_url + "/props")).json()
        assert props["modalities"] == {"vision": True, "audio": False}
        model = (await client.get(base_url + "/v1/models")).json()["data"][0]
        assert model["architecture"]["input_modalities"] == ["text", "image"]
        _, body = _messages(RED, follow_up=False)
        del body["max_tokens"]
        counted = (await client.post(base_url + "/v1/messages/count_tokens", json=body)).json()
        assert counted == {"input_tokens": FIRST_PROMPT}
