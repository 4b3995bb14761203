"""``Generation`` with the chat and text encoders: chunk rules that depend on the history of a request.

Chunks are checked as the JSON of the SSE events the encoders write (unset keys
absent, ``None`` kept), so the assertions read like the wire format."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from protocol import (
    ErrorCode,
    Event,
    Finished,
    FinishReason,
    PrefillProgress,
    RequestError,
    Started,
    TokenDelta,
)
from proxy.core.dialect import Header
from proxy.core.generation import Generation, Options
from proxy.dialects.chat.frames import ChatFrames, chat_body
from proxy.dialects.completions import TextFrames
from proxy.dialects.openai.shapes import usage_of
from proxy.errors import ContextLengthExceeded, EngineInternalError, InvalidRequest
from tests.fakes.engine_client import completion_events

HEADER = Header("resp", 1700000000, "m")


def frames_of(
    gen: Generation,
    text: bool = False,
    include_usage: bool = False,
    continuous_usage: bool = False,
    timings: bool = False,
) -> ChatFrames | TextFrames:
    cls = TextFrames if text else ChatFrames
    obj = "text_completion" if text else "chat.completion.chunk"
    kw = {"include_usage": include_usage, "continuous_usage": continuous_usage, "timings": timings}
    return cls(gen, HEADER, obj, **kw)


def run(
    events: list[Event],
    *,
    text: bool = False,
    ids: list[str] | None = None,
    progress: bool = False,
    **flags: bool,
) -> tuple[Generation, list[dict[str, Any]]]:
    gen = Generation(ids or ["r"], Options(progress=progress))
    gen.stream_to(frames_of(gen, text, **flags))
    out: list[bytes] = []
    for ev in events:
        gen.feed(ev, out)
    return gen, [decode_event(b) for b in out]


def decode_event(frame: bytes) -> dict[str, Any]:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    data: dict[str, Any] = msgspec.json.decode(frame[6:-2])
    return data


def progress_of(chunks: list[dict[str, Any]]) -> list[dict[str, int]]:
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c]


def test_progress_chunks_follow_events_until_generation() -> None:
    events = completion_events("r", ["a", "b"], prompt_tokens=10, cached_tokens=2, chunk=3)
    _, chunks = run(events, progress=True)
    expected = [
        {"total": 10, "cache": 2, "processed": p, "time_ms": t}
        for p, t in [(2, 0), (5, 10), (8, 20), (10, 30)]
    ]
    assert progress_of(chunks) == expected
    first_content = next(i for i, c in enumerate(chunks) if c["choices"][0]["delta"].get("content"))
    assert all("prompt_progress" in c for c in chunks[:first_content])
    assert not any("prompt_progress" in c for c in chunks[first_content:])
    for c in chunks[:first_content]:
        assert c["choices"] == [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": None},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        assert c["object"] == "chat.completion.chunk"


def test_no_progress_without_the_flag() -> None:
    _, chunks = run(completion_events("r", ["a"]), progress=False)
    assert progress_of(chunks) == []
    # and the first chunk then carries the role with the content
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "a"}


def test_progress_dropped_during_generation_and_when_going_backwards() -> None:
    events: list[Event] = [
        Started("r", 8, 0),
        PrefillProgress("r", 8, 0, 0, 0),
        PrefillProgress("r", 8, 0, 4, 5),
        PrefillProgress("r", 8, 0, 2, 6),  # backwards: dropped
        PrefillProgress("r", 8, 0, 8, 9),
        PrefillProgress("r", 8, 0, 8, 9),  # after processed == total: dropped
        TokenDelta("r", "x", 1),
        PrefillProgress("r", 9, 0, 4, 1),  # requeue re-prefill mid-stream: dropped
        TokenDelta("r", "y", 1),
        Finished("r", FinishReason.STOP, 8, 0, 2),
    ]
    _, chunks = run(events, progress=True)
    assert [p["processed"] for p in progress_of(chunks)] == [0, 4, 8]


def test_final_progress_is_synthesised_when_missing_before_first_token() -> None:
    events: list[Event] = [
        Started("r", 100, 40),
        PrefillProgress("r", 100, 40, 40, 0),
        PrefillProgress("r", 100, 40, 72, 33),
        TokenDelta("r", "x", 1),
        Finished("r", FinishReason.STOP, 100, 40, 1),
    ]
    _, chunks = run(events, progress=True)
    assert progress_of(chunks) == [
        {"total": 100, "cache": 40, "processed": 40, "time_ms": 0},
        {"total": 100, "cache": 40, "processed": 72, "time_ms": 33},
        {"total": 100, "cache": 40, "processed": 100, "time_ms": 33},
    ]


def test_progress_only_for_choice_zero() -> None:
    events = completion_events("r-0", ["a"], chunk=5) + completion_events("r-1", ["b"], chunk=2)
    _, chunks = run(events, ids=["r-0", "r-1"], progress=True)
    # choice 0 has 10 prompt tokens in chunks of 5: processed 0, 5, 10
    assert [p["processed"] for p in progress_of(chunks)] == [0, 5, 10]
    assert all(c["choices"][0]["index"] == 0 for c in chunks if "prompt_progress" in c)


def test_role_once_empty_text_skipped_finish_last() -> None:
    events: list[Event] = [
        Started("r", 3, 0),
        TokenDelta("r", "", 1),
        TokenDelta("r", "Hi", 1),
        TokenDelta("r", "", 1),
        TokenDelta("r", "!", 1),
        Finished("r", FinishReason.LENGTH, 3, 0, 4),
    ]
    _, chunks = run(events)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": "Hi"}, {"content": "!"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all("usage" not in c for c in chunks)


def test_empty_completion_still_sends_the_role() -> None:
    _, chunks = run([Started("r", 3, 0), Finished("r", FinishReason.STOP, 3, 0, 0)])
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant"}]


def test_text_completion_chunks() -> None:
    _, chunks = run(completion_events("r", ["x", "y"], chunk=100), text=True, progress=True)
    assert [c["object"] for c in chunks] == ["text_completion"] * 5
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "y", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}],
    ]
    assert [c.get("prompt_progress", {}).get("processed") for c in chunks] == [0, 10, None, None, None]


def test_usage_null_on_chunks_with_include_usage_and_running_usage_when_continuous() -> None:
    events = completion_events("r", ["a", "b", "c"], prompt_tokens=6, cached_tokens=2, tokens_per_text=2)
    _, chunks = run(events, include_usage=True)
    assert all(c["usage"] is None for c in chunks)
    _, chunks = run(events, include_usage=True, continuous_usage=True)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [2, 4, 6, 6]
    assert all(c["usage"]["prompt_tokens"] == 6 for c in chunks)
    assert all(c["usage"]["total_tokens"] == 6 + c["usage"]["completion_tokens"] for c in chunks)
    assert all(c["usage"]["prompt_tokens_details"] == {"cached_tokens": 2} for c in chunks)


def test_final_usage_sums_choices_and_counts_the_prompt_once() -> None:
    fin = [
        Finished("r-0", FinishReason.STOP, 50, 32, 7, 5, 3, 0.5, 1.0, 2.0),
        Finished("r-1", FinishReason.LENGTH, 50, 32, 11, None, None, 0.25, 1.5, 3.0),
        Finished("r-2", FinishReason.STOP, 50, 32, 2, 1, 4, 0.0, 1.0, 0.5),
    ]
    events: list[Event] = [*(Started(f.request_id, 50, 32) for f in fin), *fin]
    state, _ = run(events, ids=["r-0", "r-1", "r-2"])
    assert state.done
    assert msgspec.to_builtins(usage_of(state.final_counts())) == {
        "prompt_tokens": 50,
        "completion_tokens": 7 + 11 + 2,
        "total_tokens": 50 + 20,
        "prompt_tokens_details": {"cached_tokens": 32},
        "completion_tokens_details": {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 7},
        "prompt_time": 1.0,
        "completion_time": 3.0,
        "total_time": 4.75,
    }
    body = msgspec.json.decode(chat_body(state, HEADER, timings=False))
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop"]


def test_no_draft_details_without_drafting_and_cached_zero_present() -> None:
    state, _ = run(completion_events("r", ["a"], cached_tokens=0))
    usage = msgspec.to_builtins(usage_of(state.final_counts()))
    assert "completion_tokens_details" not in usage
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    state, _ = run(completion_events("r", ["a"], draft=(0, 0)))
    assert msgspec.to_builtins(usage_of(state.final_counts()))["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }


@pytest.mark.parametrize(
    ("code", "exc", "status"),
    [
        (ErrorCode.CONTEXT_LENGTH_EXCEEDED, ContextLengthExceeded, 400),
        (ErrorCode.INVALID_REQUEST, InvalidRequest, 400),
        (ErrorCode.INTERNAL, EngineInternalError, 500),
    ],
)
def test_request_error_raises_after_earlier_chunks(
    code: ErrorCode, exc: type[Exception], status: int
) -> None:
    state = Generation(["r"], Options())
    state.stream_to(frames_of(state))
    out: list[bytes] = []
    state.feed(Started("r", 3, 0), out)
    state.feed(TokenDelta("r", "a", 1), out)
    with pytest.raises(exc) as info:
        state.feed(RequestError("r", code, "boom", "messages"), out)
    assert len(out) == 1
    assert info.value.status == status  # type: ignore[attr-defined]
    assert state.unfinished_ids() == ["r"]


def test_events_of_other_requests_are_ignored() -> None:
    state, chunks = run([TokenDelta("other", "x", 1), RequestError("other", ErrorCode.INTERNAL, "x")])
    assert chunks == []
    assert not state.done
