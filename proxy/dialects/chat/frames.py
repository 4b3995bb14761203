"""``/v1/chat/completions`` output: ``chat.completion.chunk`` events and the ``chat.completion`` body.

Stream chunk (``proxy.dialects.openai.shapes.StreamChunk``)::

    {"id": "chatcmpl-...", "object": "chat.completion.chunk", "created": int, "model": str,
     "choices": [choice],                         # exactly one; [] on the usage chunk
     "prompt_progress": {"total", "cache", "processed", "time_ms"},   # progress chunks only
     "usage": usage | null,                       # only with include_usage: null, running
                                                  # usage (continuous), or the final usage
                                                  # on the usage chunk
     "queue_progress": {"position", "queued", "time_ms", "eta_ms"?},  # queue chunks only
     "timings": {...}}                            # only with timings_per_token

    choice: {"index": int, "delta": {"role": "assistant", "content": str | null,
             "tool_calls": [...]} | {"role"?, "reasoning_content": str},
             "logprobs": {"content": [...]} | null, "finish_reason": str | null}
    (``role`` only on a choice's first chunk, ``content`` absent on the finish
    chunk, ``null`` on progress chunks and a first tool-call delta)

Body (``Completion``)::

    {"id", "object": "chat.completion", "created", "model",
     "choices": [{"index", "message": {"role": "assistant", "content": str | null,
                  "tool_calls": [...]?, "reasoning_content": str?}, "logprobs": {...} | null,
                  "finish_reason": str}],
     "usage": usage, "timings"?: {...}}

Sources: the OpenAI API reference (chat completion and chunk objects),
llama.cpp's server (``prompt_progress``, ``timings``; an assistant delta with
null content on progress chunks, so clients reading ``delta.content`` see "no
text yet"; ``reasoning_content`` in the message and in deltas of their own, as
its ``--reasoning-format deepseek`` writes; vLLM's ``reasoning`` with
``--reasoning-field reasoning``).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from proxy.core.dialect import Header
from proxy.core.generation import Choice, Generation, Logprobs
from proxy.dialects.openai.frames import ChunkFrames
from proxy.dialects.openai.shapes import (
    AssistantMessage,
    ChatDeltaChoice,
    ChatLogprobs,
    ChatMessageChoice,
    Completion,
    Delta,
    ResponseChoice,
    Timings,
    TokenLogprobOut,
    usage_of,
)
from proxy.server import sse
from proxy.server.bodies import encode
from proxy.tools import ToolCallDelta

_ROLE_DELTA = Delta(role="assistant")
_EMPTY_DELTA = Delta()
_PROGRESS = ChatDeltaChoice(0, Delta(role="assistant", content=None))


def _logprobs(entries: Logprobs) -> ChatLogprobs | None:
    return None if entries is None else ChatLogprobs([TokenLogprobOut.of(lp) for lp in entries])


def _first(choice: Choice) -> bool:
    """Whether the next chunk of ``choice`` is its first (marks it sent)."""
    if choice.first_sent:
        return False
    choice.first_sent = True
    return True


class ChatFrames(ChunkFrames):
    """The chat stream encoder (module docstring)."""

    __slots__ = ()

    progress_choice = _PROGRESS

    def text(self, choice: Choice, text: str, logprobs: Logprobs, offset: int, out: list[bytes]) -> None:
        delta = Delta(role="assistant", content=text) if _first(choice) else Delta(content=text)
        out.append(sse.event(self.chunk(ChatDeltaChoice(choice.index, delta, _logprobs(logprobs)))))

    def reasoning(self, choice: Choice, text: str, out: list[bytes]) -> None:
        # A delta of its own, never with content (llama.cpp's and vLLM's streams).
        role: Literal["assistant"] | UnsetType = "assistant" if _first(choice) else UNSET
        field = self.gen.options.reasoning_field
        delta = Delta(
            role=role,
            reasoning_content=text if field != "reasoning" else UNSET,
            reasoning=text if field != "reasoning_content" else UNSET,
        )
        out.append(sse.event(self.chunk(ChatDeltaChoice(choice.index, delta))))

    def tool_call(self, choice: Choice, call: ToolCallDelta, out: list[bytes]) -> None:
        # OpenAI's first tool-call delta carries the role and a null content.
        if _first(choice):
            delta = Delta(role="assistant", content=None, tool_calls=[call])
        else:
            delta = Delta(tool_calls=[call])
        out.append(sse.event(self.chunk(ChatDeltaChoice(choice.index, delta))))

    def finish(self, choice: Choice, reason: str, logprobs: Logprobs, out: list[bytes]) -> None:
        delta = _ROLE_DELTA if _first(choice) else _EMPTY_DELTA
        out.append(sse.event(self.chunk(ChatDeltaChoice(choice.index, delta, _logprobs(logprobs), reason))))


def chat_body(gen: Generation, header: Header, timings: bool) -> bytes:
    """The ``chat.completion`` body of a finished ``gen``."""
    tools = gen.options.tools is not None
    field = gen.options.reasoning_field
    choices: list[ResponseChoice] = []
    for r in gen.results():
        thought: str | UnsetType = UNSET if r.reasoning is None else r.reasoning
        if tools:
            message = AssistantMessage(content=r.content, tool_calls=r.tool_calls or UNSET)
        else:
            message = AssistantMessage(content=r.text)
        message = msgspec.structs.replace(
            message,
            reasoning_content=thought if field != "reasoning" else UNSET,
            reasoning=thought if field != "reasoning_content" else UNSET,
        )
        choices.append(ChatMessageChoice(r.index, message, _logprobs(r.logprobs), r.finish_reason))
    counts = gen.final_counts()
    body = Completion(header.id, "chat.completion", header.created, header.model, choices, usage_of(counts))
    if timings:
        body.timings = Timings.final(counts)
    return encode(body)
