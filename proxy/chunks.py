"""Builders of the OpenAI JSON objects the proxy emits: stream chunks, usage, responses.

Pure functions returning dicts (serialised by ``proxy.sse``); no state, no I/O.
Shapes follow the OpenAI API reference (``chat.completion``,
``chat.completion.chunk``, ``text_completion``) and, for ``prompt_progress``,
llama.cpp's server; ``shared/reference/http-contract.md`` lists the rules.

Usage object (counts in tokens, times in seconds)::

    {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int,
     "prompt_tokens_details": {"cached_tokens": int},              # always, 0 on a miss
     "completion_tokens_details": {"accepted_prediction_tokens": int,
                                   "rejected_prediction_tokens": int},  # only when drafting
     "prompt_time": float, "completion_time": float, "total_time": float}

OpenAI defines ``accepted_prediction_tokens``/``rejected_prediction_tokens`` for
Predicted Outputs; here they count speculative-decoding drafts the target model
confirmed/discarded, the same accounting idea from a different source. The
timing extras are unknown fields to OpenAI clients, which ignore them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from protocol.messages import Finished, PrefillProgress

Kind = Literal["chat", "text"]
"""``chat``: /v1/chat/completions objects; ``text``: /v1/completions objects."""

CHUNK_OBJECT: dict[Kind, str] = {"chat": "chat.completion.chunk", "text": "text_completion"}
RESPONSE_OBJECT: dict[Kind, str] = {"chat": "chat.completion", "text": "text_completion"}


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """The fields every chunk of one response repeats: ``id`` (``chatcmpl-...`` or
    ``cmpl-...``), ``created`` (Unix seconds) and the served ``model`` name."""

    kind: Kind
    id: str
    created: int
    model: str


def chunk(header: ChunkHeader, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream chunk with the given ``choices`` (``[]`` for the usage chunk)."""
    return {
        "id": header.id,
        "object": CHUNK_OBJECT[header.kind],
        "created": header.created,
        "model": header.model,
        "choices": choices,
    }


def chat_delta_choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    """A chat chunk choice: ``{"index", "delta", "logprobs": null, "finish_reason"}``."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def text_choice(index: int, text: str, finish_reason: str | None = None) -> dict[str, Any]:
    """A text completion choice: ``{"index", "text", "logprobs": null, "finish_reason"}``."""
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def progress_chunk(header: ChunkHeader, ev: PrefillProgress) -> dict[str, Any]:
    """llama.cpp's progress chunk: choice 0 with an empty assistant delta (chat) or
    empty text (completions), plus ``prompt_progress`` ``{total, cache, processed,
    time_ms}`` (tokens; integer ms since prompt processing started)."""
    choice = (
        chat_delta_choice(0, {"role": "assistant", "content": None})
        if header.kind == "chat"
        else text_choice(0, "")
    )
    out = chunk(header, [choice])
    out["prompt_progress"] = {
        "total": ev.total,
        "cache": ev.cached,
        "processed": ev.processed,
        "time_ms": ev.time_ms,
    }
    return out


def running_usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Usage so far (vLLM's ``continuous_usage_stats``): counts and cached tokens only."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _seconds(x: float) -> float:
    return round(x, 6)


def final_usage(finished: Sequence[Finished]) -> dict[str, Any]:
    """Usage of a whole response from the ``Finished`` event of every choice, in
    choice order (shape in the module docstring).

    The prompt is shared by all choices: ``prompt_tokens`` and ``cached_tokens``
    and ``prompt_time`` come from choice 0. Completion tokens and draft counters
    are summed; ``completion_tokens_details`` is present only when at least one
    choice drafted (non-``None`` counters). ``completion_time`` and
    ``total_time`` are the longest over choices (they ran concurrently);
    ``total_time`` includes queueing.
    """
    first = finished[0]
    completion = sum(f.completion_tokens for f in finished)
    usage: dict[str, Any] = {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }
    drafted = [f for f in finished if f.draft_accepted is not None or f.draft_rejected is not None]
    if drafted:
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(f.draft_accepted or 0 for f in drafted),
            "rejected_prediction_tokens": sum(f.draft_rejected or 0 for f in drafted),
        }
    usage["prompt_time"] = _seconds(first.time_prefill)
    usage["completion_time"] = _seconds(max(f.time_decode for f in finished))
    usage["total_time"] = _seconds(max(f.time_queued + f.time_prefill + f.time_decode for f in finished))
    return usage


def response(header: ChunkHeader, texts: Sequence[str], finished: Sequence[Finished]) -> dict[str, Any]:
    """The non-stream response: one choice per text (choice order), with its
    ``finish_reason``, and ``usage`` (always present, see ``final_usage``)."""
    choices: list[dict[str, Any]]
    if header.kind == "chat":
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": str(f.finish_reason),
            }
            for i, (text, f) in enumerate(zip(texts, finished, strict=True))
        ]
    else:
        choices = [
            text_choice(i, text, str(f.finish_reason))
            for i, (text, f) in enumerate(zip(texts, finished, strict=True))
        ]
    return {
        "id": header.id,
        "object": RESPONSE_OBJECT[header.kind],
        "created": header.created,
        "model": header.model,
        "choices": choices,
        "usage": final_usage(finished),
    }
