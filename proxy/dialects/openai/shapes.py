"""OpenAI's response shapes for chat and text completions (``msgspec.Struct``s;
field order is key order on the wire, a field set to ``UNSET`` is left out).

``Usage`` (chat and text completions), logprobs in the chat and legacy shapes,
llama.cpp's ``timings``, the stream chunk and the non-stream body. Sources: the
OpenAI API reference (usage, logprobs objects, chunks), llama.cpp's server
(``timings``), vLLM (``continuous_usage_stats``). ``prompt_progress`` and
``queue_progress`` are this server's, the same in every dialect
(``proxy.core.progress``).

Usage (``Usage``; counts in tokens, times in seconds)::

    {"prompt_tokens": int, "completion_tokens": int, "total_tokens": int,
     "prompt_tokens_details": {"cached_tokens": int},              # always, 0 on a miss
     "completion_tokens_details": {"accepted_prediction_tokens": int,
                                   "rejected_prediction_tokens": int},  # only when drafting
     "prompt_time": float, "completion_time": float, "total_time": float}  # final usage only

OpenAI defines ``accepted_prediction_tokens``/``rejected_prediction_tokens`` for
Predicted Outputs; here they count speculative-decoding drafts the target model
confirmed/discarded, the same accounting idea from a different source. The
timing extras are unknown fields to OpenAI clients, which ignore them.
Chunk and body shapes: ``proxy.dialects.chat.frames``, ``proxy.dialects.completions``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from protocol.messages import TokenLogprob
from proxy.core.progress import PromptProgress, QueuePosition
from proxy.core.usage import Counts
from proxy.tools import ToolCall, ToolCallDelta

# gc=False: these structs never take part in reference cycles, and skipping GC
# tracking makes the one-per-token chunk allocation cheaper.


class PromptTokensDetails(msgspec.Struct, gc=False):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct, gc=False):
    accepted_prediction_tokens: int | UnsetType = UNSET
    rejected_prediction_tokens: int | UnsetType = UNSET
    reasoning_tokens: int | UnsetType = UNSET


class Usage(msgspec.Struct, gc=False):
    """Token counts (running or final) and, on the final usage, the timing extras."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET
    prompt_time: float | UnsetType = UNSET
    completion_time: float | UnsetType = UNSET
    total_time: float | UnsetType = UNSET


def usage_of(counts: Counts, final: bool = True) -> Usage:
    """OpenAI's ``usage`` of ``counts``: with the draft details when some choice
    drafted and, when ``final``, the timing extras; running usage (vLLM's
    ``continuous_usage_stats``) carries counts and cached tokens only."""
    if not final:
        return Usage(
            counts.prompt_tokens,
            counts.completion_tokens,
            counts.total_tokens,
            PromptTokensDetails(counts.cached_tokens),
        )
    details: CompletionTokensDetails | UnsetType = UNSET
    if counts.draft_accepted is not None:
        details = CompletionTokensDetails(counts.draft_accepted, counts.draft_rejected or 0)
    if counts.reasoning_tokens:
        if isinstance(details, CompletionTokensDetails):
            details.reasoning_tokens = counts.reasoning_tokens
        else:
            details = CompletionTokensDetails(reasoning_tokens=counts.reasoning_tokens)
    return Usage(
        counts.prompt_tokens,
        counts.completion_tokens,
        counts.total_tokens,
        PromptTokensDetails(counts.cached_tokens),
        details,
        prompt_time=counts.prompt_time,
        completion_time=counts.completion_time,
        total_time=counts.total_time,
    )


class TopLogprobOut(msgspec.Struct, frozen=True, gc=False):
    """One alternative of a chat ``logprobs.content`` entry; ``bytes`` is the
    token's UTF-8 bytes as a list of ints (OpenAI API reference)."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(msgspec.Struct, frozen=True, gc=False):
    """One generated token of a chat choice's ``logprobs.content``."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]

    @classmethod
    def of(cls, lp: TokenLogprob) -> TokenLogprobOut:
        return cls(
            lp.token,
            lp.logprob,
            list(lp.token_bytes),
            [TopLogprobOut(t.token, t.logprob, list(t.token_bytes)) for t in lp.top],
        )


class ChatLogprobs(msgspec.Struct, frozen=True, gc=False):
    """A chat choice's ``logprobs``: ``{"content": [entry, ...], "refusal": null}``."""

    content: list[TokenLogprobOut]
    refusal: None = None


class TextLogprobs(msgspec.Struct, frozen=True, gc=False):
    """A text completion choice's ``logprobs`` (the legacy shape): parallel lists
    of ``tokens``, ``token_logprobs``, ``top_logprobs`` (``{token: logprob}`` per
    position) and ``text_offset`` (characters into the choice's text)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]

    @classmethod
    def of(cls, entries: Sequence[TokenLogprob], offset: int) -> TextLogprobs:
        offsets: list[int] = []
        for lp in entries:
            offsets.append(offset)
            offset += len(lp.token)
        return cls(
            [lp.token for lp in entries],
            [lp.logprob for lp in entries],
            [{t.token: t.logprob for t in lp.top} for lp in entries],
            offsets,
        )


class Timings(msgspec.Struct, frozen=True, gc=False):
    """llama.cpp's ``timings`` (its server's ``result_timings``): prompt tokens
    taken from the prefix cache (``cache_n``) and prefilled (``prompt_n``, new
    tokens only), generated tokens (``predicted_n``), their milliseconds and
    rates, and with drafting ``draft_n`` (drafted tokens verified) and
    ``draft_n_accepted``."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | UnsetType = UNSET
    draft_n_accepted: int | UnsetType = UNSET

    @classmethod
    def of(
        cls,
        cached: int,
        prompt_n: int,
        prompt_s: float,
        predicted_n: int,
        predicted_s: float,
        draft: tuple[int, int] | None = None,
    ) -> Timings:
        """From counts and seconds; rates are 0 where a count or time is 0."""
        prompt_ms = round(prompt_s * 1000, 3)
        predicted_ms = round(predicted_s * 1000, 3)
        return cls(
            cached,
            prompt_n,
            prompt_ms,
            round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
            round(prompt_n / prompt_s, 3) if prompt_s > 0 else 0.0,
            predicted_n,
            predicted_ms,
            round(predicted_ms / predicted_n, 3) if predicted_n else 0.0,
            round(predicted_n / predicted_s, 3) if predicted_s > 0 else 0.0,
            UNSET if draft is None else draft[0] + draft[1],
            UNSET if draft is None else draft[0],
        )

    @classmethod
    def final(cls, counts: Counts) -> Timings:
        """The ``timings`` of a finished response, from its ``Counts`` (the
        same numbers as its usage)."""
        draft = None
        if counts.draft_accepted is not None:
            draft = (counts.draft_accepted, counts.draft_rejected or 0)
        return cls.of(
            counts.cached_tokens,
            counts.prompt_tokens - counts.cached_tokens,
            counts.prompt_time,
            counts.completion_tokens,
            counts.completion_time,
            draft,
        )


class Delta(msgspec.Struct, frozen=True, gc=False):
    """A chat chunk's ``delta``: ``{"role"?, "content"?, "tool_calls"?}``, or the
    thinking as ``{"role"?, "reasoning_content"}`` (``"reasoning"`` with vLLM's name)."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class ChatDeltaChoice(msgspec.Struct, frozen=True, gc=False):
    """A chat chunk choice."""

    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class TextChoice(msgspec.Struct, frozen=True, gc=False):
    """A text completion choice, streamed or not."""

    index: int
    text: str
    logprobs: TextLogprobs | None = None
    finish_reason: str | None = None


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A chat response's ``message``: ``content`` is ``null`` when the answer is
    only ``tool_calls``."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    reasoning: str | UnsetType = UNSET


class ChatMessageChoice(msgspec.Struct, frozen=True, gc=False):
    """A non-stream chat choice."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


StreamChoice = ChatDeltaChoice | TextChoice
ResponseChoice = ChatMessageChoice | TextChoice


class StreamChunk(msgspec.Struct, gc=False):
    """One streamed chunk (shape in the module docstring)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[StreamChoice]
    prompt_progress: PromptProgress | UnsetType = UNSET
    usage: Usage | UnsetType | None = UNSET
    queue_progress: QueuePosition | UnsetType = UNSET
    timings: Timings | UnsetType = UNSET


class Completion(msgspec.Struct, gc=False):
    """The non-stream response (shape in the module docstring)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ResponseChoice]
    usage: Usage
    timings: Timings | UnsetType = UNSET
