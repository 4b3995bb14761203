"""Byte-for-byte golden bodies of the proxy's HTTP responses.

Each case drives the app (``create_app`` on ``FakeEngineClient``) through one
fixed request and compares the status line, the ``Content-Type`` and the raw
body bytes with ``tests/unit/proxy/serving/golden/<case>.golden``. Only the random parts are
normalised first: response ids (``chatcmpl-``/``cmpl-`` + 32 hex digits become
``...-ID``) and every ``"created"`` timestamp (becomes ``0``). Everything else
is compared exactly: key order, ``null`` fields, absent keys, float formatting,
the escapes of U+2028/U+2029/U+0085, non-ASCII text, SSE framing.

The golden files were produced by the dict + orjson implementation
(``proxy/chunks.py``, before the typed ``proxy/responses.py`` replaced it), so
they pin the wire format that refactor had to keep. Regenerate them only for an
intended wire change: ``UPDATE_GOLDEN=1 pytest tests/proxy/test_golden_sse.py``,
then review the diff.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from protocol import (
    ErrorCode,
    Event,
    Finished,
    FinishReason,
    QueueProgress,
    RequestError,
    Started,
    Submit,
    TokenDelta,
)
from tests.fakes.engine_client import FakeEngineClient, Script, Step, completion_events, static_script
from tests.unit.proxy.conftest import MakeClient

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

_ID_RE = re.compile(rb'"id":"(chatcmpl|cmpl)-[0-9a-f]{32}"')
_CREATED_RE = re.compile(rb'"created":[0-9]+')

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]

# (queued, prefill, decode) seconds, not round on purpose: they exercise the
# rounding to microseconds and float formatting (prefill becomes 1e-6).
TIMES = (0.123456789, 0.0000012, 2.0)


def normalise(raw: bytes) -> bytes:
    raw = _ID_RE.sub(rb'"id":"\1-ID"', raw)
    return _CREATED_RE.sub(b'"created":0', raw)


def per_choice(texts: dict[str, list[str]], **kw: Any) -> Script:
    """Choice ``i`` (engine id suffix ``-i``) plays ``texts[suffix]``."""

    def script(submit: Submit) -> list[Step]:
        suffix = submit.request_id.rsplit("-", 1)[1]
        return list(completion_events(submit.request_id, texts[suffix], **kw))

    return script


def events_script(make: Callable[[str], list[Event]]) -> Script:
    def script(submit: Submit) -> list[Step]:
        return list(make(submit.request_id))

    return script


@dataclass(frozen=True)
class Case:
    script: Script | None
    method: str
    path: str
    body: dict[str, Any] | bytes | None = None
    config: tuple[tuple[str, Any], ...] = ()
    ready: bool = True


def _error_after_headers(rid: str) -> list[Event]:
    return [
        Started(rid, 5, 0),
        TokenDelta(rid, "par", 1),
        TokenDelta(rid, "tial", 1),
        RequestError(rid, ErrorCode.INTERNAL, 'backend exploded: "CUDA" \u2028 error', None),
    ]


def _queued(rid: str) -> list[Event]:
    # Positions 3 -> 2 -> 1, a repeated 2 (dropped: no change), eta only on the last.
    return [
        QueueProgress(rid, 3, 3, 0),
        QueueProgress(rid, 2, 2, 250),
        QueueProgress(rid, 2, 2, 260),
        QueueProgress(rid, 1, 1, 500, 1200),
        *completion_events(rid, ["ok"], prompt_tokens=4, chunk=4, times=TIMES),
    ]


def _empty_completion(rid: str) -> list[Event]:
    return [Started(rid, 3, 0), Finished(rid, FinishReason.STOP, 3, 0, 0)]


UNICODE_TEXTS = [
    "a\u2028b",
    "\u2029",
    'say "hi"',
    "caf\u00e9 \u65e5\u672c \U0001f600",
    "back\\slash",
    "c\u0085",
    "\t\n\x01\x1f\x7f",
]

CASES: dict[str, Case] = {
    "chat_stream_progress_usage": Case(
        static_script(["Hel", "lo"], prompt_tokens=9, cached_tokens=3, chunk=4, times=TIMES),
        "POST",
        CHAT,
        {
            "messages": MSGS,
            "stream": True,
            "return_progress": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "chat_stream_continuous_n2": Case(
        per_choice({"0": ["a", "b"], "1": ["c", "", "d", "e"]}, prompt_tokens=6, cached_tokens=2, chunk=2),
        "POST",
        CHAT,
        {
            "messages": MSGS,
            "n": 2,
            "stream": True,
            "return_progress": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    "chat_stream_drafting": Case(
        per_choice({"0": ["x", "y"], "1": ["z"]}, draft=(5, 2), tokens_per_text=3, times=TIMES),
        "POST",
        CHAT,
        {"messages": MSGS, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "chat_stream_queued": Case(
        events_script(_queued),
        "POST",
        CHAT,
        {"messages": MSGS, "stream": True, "return_progress": True},
    ),
    "text_stream_queued_no_flag": Case(events_script(_queued), "POST", TEXT, {"prompt": "x", "stream": True}),
    "chat_stream_plain": Case(static_script(["Hi", "!"]), "POST", CHAT, {"messages": MSGS, "stream": True}),
    "chat_stream_empty_completion": Case(
        events_script(_empty_completion), "POST", CHAT, {"messages": MSGS, "stream": True}
    ),
    "text_stream_progress": Case(
        static_script(["Once", " upon"], prompt_tokens=5, chunk=2, times=TIMES),
        "POST",
        TEXT,
        {
            "prompt": "Tell me",
            "stream": True,
            "return_progress": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "chat_nonstream": Case(
        static_script(["Hello", " world"], prompt_tokens=7, cached_tokens=4, times=TIMES),
        "POST",
        CHAT,
        {"messages": MSGS},
    ),
    "chat_nonstream_n2_drafting": Case(
        per_choice({"0": ["p", "q"], "1": ["r"]}, draft=(1, 1), finish_reason=FinishReason.LENGTH),
        "POST",
        CHAT,
        {"messages": MSGS, "n": 2},
    ),
    "text_nonstream": Case(
        static_script(["Once", " upon", " a time"], prompt_tokens=5, times=TIMES),
        "POST",
        TEXT,
        {"prompt": "x"},
    ),
    "stream_error_after_headers": Case(
        events_script(_error_after_headers),
        "POST",
        CHAT,
        {"messages": MSGS, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "error_400_invalid_param": Case(None, "POST", CHAT, {"messages": MSGS, "max_tokens": -1}),
    "error_400_bad_json": Case(None, "POST", CHAT, b"{not json"),
    "error_400_context_length": Case(
        events_script(
            lambda rid: [RequestError(rid, ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")]
        ),
        "POST",
        CHAT,
        {"messages": MSGS, "stream": True},
    ),
    "model_alias": Case(None, "GET", "/v1/models/other"),
    "error_503_not_ready": Case(None, "POST", TEXT, {"prompt": "x"}, ready=False),
    "models": Case(None, "GET", "/v1/models"),
    "model_card": Case(None, "GET", "/v1/models/fake-model"),
    "health": Case(None, "GET", "/health"),
    "ready": Case(None, "GET", "/ready"),
    "ready_not_ready": Case(None, "GET", "/ready", ready=False),
    "unicode_stream": Case(
        static_script(UNICODE_TEXTS),
        "POST",
        CHAT,
        {"messages": MSGS, "stream": True},
        config=(("served_model_name", 'm\u00f6del "\u2028"'),),
    ),
    "unicode_text_nonstream": Case(static_script(UNICODE_TEXTS), "POST", TEXT, {"prompt": "x"}),
}


async def _request(client: TestClient[Any, Any], case: Case) -> tuple[int, str, bytes]:
    kw: dict[str, Any] = {}
    if isinstance(case.body, bytes):
        kw["data"] = case.body
        kw["headers"] = {"Content-Type": "application/json"}
    elif case.body is not None:
        kw["json"] = case.body
    async with client.request(case.method, case.path, **kw) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


@pytest.mark.parametrize("name", sorted(CASES))
async def test_golden_body(name: str, make_client: MakeClient, fake: FakeEngineClient) -> None:
    case = CASES[name]
    if case.script is not None:
        fake.script = case.script
    if not case.ready:
        fake.is_ready = False
        fake.worker_ready = None
    client = await make_client(**dict(case.config))
    status, content_type, raw = await _request(client, case)
    got = f"{status} {content_type}\n".encode() + normalise(raw)
    path = GOLDEN / f"{name}.golden"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(got)
    assert path.exists(), f"missing {path}; create it with UPDATE_GOLDEN=1"
    assert got == path.read_bytes()
