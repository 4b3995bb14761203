"""The JSON bodies the proxy emits, as typed structs, and the two completion formats.

Every body is a ``msgspec.Struct`` encoded once by ``msgspec.json``: ``encode``
for plain JSON responses, ``proxy.sse.event`` for stream events (which also
escapes U+2028/U+2029/U+0085). Field order is key order on the wire, so never
reorder fields. A field set to ``msgspec.UNSET`` is left out; ``None`` is
written as ``null``. Which key appears when is part of the HTTP contract
(``docs/http-contract.md``); the rules that depend on a request's history live
in ``proxy.streaming``.

Sources: the OpenAI API reference (``chat.completion``,
``chat.completion.chunk``, ``text_completion``, usage, model and error objects),
llama.cpp's server (``prompt_progress``), vLLM (``continuous_usage_stats``,
``max_model_len``); ``queue_progress`` is this server's (``docs/http-contract.md``).

Stream chunk (``StreamChunk``)::

    {"id": "chatcmpl-..." | "cmpl-...",
     "object": "chat.completion.chunk" | "text_completion",
     "created": int, "model": str,
     "choices": [choice],                         # exactly one; [] on the usage chunk
     "prompt_progress": {"total": int, "cache": int, "processed": int,
                         "time_ms": int},         # progress chunks only
     "usage": usage | null,                       # only with include_usage: null,
                                                  # running usage (continuous), or the
                                                  # final usage on the usage chunk
     "queue_progress": {"position": int, "queued": int, "time_ms": int,
                        "eta_ms": int}}           # queue chunks only; eta_ms when known

    chat choice: {"index": int, "delta": {"role": "assistant", "content": str | null},
                  "logprobs": null, "finish_reason": str | null}
                 (``role`` only on a choice's first chunk, ``content`` absent on
                 the finish chunk, ``null`` on progress chunks)
    text choice: {"index": int, "text": str, "logprobs": null, "finish_reason": str | null}

Non-stream response (``Completion``)::

    {"id", "object": "chat.completion" | "text_completion", "created", "model",
     "choices": [choice, ...], "usage": usage}

    chat choice: {"index": int, "message": {"role": "assistant", "content": str},
                  "logprobs": null, "finish_reason": str}
    text choice: as in the stream, with its ``finish_reason``

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

Error envelope (``ErrorEnvelope``)::

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Models: ``{"object": "list", "data": [card]}`` with card ``{"id": str, "object":
"model", "created": int, "owned_by": "exl3-sidecar", "max_model_len": int}``
(``max_model_len`` only once the worker's context size is known).
Probes: ``/health`` ``{"status": "ok"}``; ``/ready`` ``{"status": "ready",
"model": str | null, "worker_active_requests": int | null,
"worker_waiting_requests": int | null, "worker_kv_cache_usage": float | null}``
or ``{"status": "not_ready" | "draining"}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

import msgspec
from msgspec import UNSET, UnsetType

from protocol.messages import Finished, PrefillProgress, QueueProgress, TokenLogprob
from proxy.tools import ToolCall, ToolCallDelta

encode = msgspec.json.Encoder().encode
"""One JSON body (no SSE framing, no line-separator escaping: a complete
response body is never split into lines by a client)."""

# gc=False: these structs never take part in reference cycles, and skipping GC
# tracking makes the one-per-token chunk allocation cheaper.


# ---------------------------------------------------------------- usage


class PromptTokensDetails(msgspec.Struct, gc=False):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct, gc=False):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


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


def running_usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Usage:
    """Usage so far (vLLM's ``continuous_usage_stats``): counts and cached tokens only."""
    return Usage(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        PromptTokensDetails(cached_tokens),
    )


def _seconds(x: float) -> float:
    return round(x, 6)


def final_usage(finished: Sequence[Finished], per_prompt: int = 0) -> Usage:
    """Usage of a whole response from the ``Finished`` event of every choice, in
    choice order.

    Choices come in groups of ``per_prompt`` that share one prompt (0: all of
    them, the usual single prompt): ``prompt_tokens`` and ``cached_tokens`` are
    those of each group's first choice, summed over prompts, and so is
    ``prompt_time``. Completion tokens and draft counters are summed over
    choices; ``completion_tokens_details`` is present only when at least one
    choice drafted (non-``None`` counters). ``completion_time`` and
    ``total_time`` are the longest over choices (they ran concurrently);
    ``total_time`` includes queueing.
    """
    firsts = finished[:: per_prompt or len(finished)]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finished)
    drafted = [f for f in finished if f.draft_accepted is not None or f.draft_rejected is not None]
    details: CompletionTokensDetails | UnsetType = UNSET
    if drafted:
        details = CompletionTokensDetails(
            sum(f.draft_accepted or 0 for f in drafted), sum(f.draft_rejected or 0 for f in drafted)
        )
    return Usage(
        prompt,
        completion,
        prompt + completion,
        PromptTokensDetails(sum(f.cached_tokens for f in firsts)),
        details,
        prompt_time=_seconds(sum(f.time_prefill for f in firsts)),
        completion_time=_seconds(max(f.time_decode for f in finished)),
        total_time=_seconds(max(f.time_queued + f.time_prefill + f.time_decode for f in finished)),
    )


# ---------------------------------------------------------------- logprobs and timings

Logprobs = Sequence[TokenLogprob] | None
"""A chunk's or a choice's generated tokens with their log-probabilities, or
``None`` when the request did not ask for them."""


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


# ---------------------------------------------------------------- choices


class Delta(msgspec.Struct, frozen=True, gc=False):
    """A chat chunk's ``delta``: ``{"role"?, "content"?, "tool_calls"?}``."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


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


class ChatMessageChoice(msgspec.Struct, frozen=True, gc=False):
    """A non-stream chat choice."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


StreamChoice = ChatDeltaChoice | TextChoice
ResponseChoice = ChatMessageChoice | TextChoice


# ---------------------------------------------------------------- bodies


class PromptProgress(msgspec.Struct, frozen=True, gc=False):
    """llama.cpp's ``prompt_progress``: tokens, and integer ms since prompt
    processing started."""

    total: int
    cache: int
    processed: int
    time_ms: int

    @classmethod
    def of(cls, ev: PrefillProgress) -> PromptProgress:
        return cls(ev.total, ev.cached, ev.processed, ev.time_ms)


class QueuePosition(msgspec.Struct, frozen=True, gc=False):
    """``queue_progress``: 1-based ``position`` among the ``queued`` requests
    waiting in the worker, ms since queued, and ``eta_ms`` only when the worker
    can estimate it (``protocol.messages.QueueProgress``)."""

    position: int
    queued: int
    time_ms: int
    eta_ms: int | UnsetType = UNSET

    @classmethod
    def of(cls, ev: QueueProgress) -> QueuePosition:
        return cls(ev.position, ev.queued, ev.time_ms, UNSET if ev.eta_ms is None else ev.eta_ms)


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


class ErrorDetail(msgspec.Struct, gc=False):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorEnvelope(msgspec.Struct, gc=False):
    """OpenAI's error body, also sent as the last SSE event of a failed stream."""

    error: ErrorDetail


class ModelCard(msgspec.Struct, kw_only=True, gc=False):
    """One entry of ``/v1/models``; ``max_model_len`` is vLLM's name for the
    context size, which clients use to size prompts."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exl3-sidecar"
    max_model_len: int | UnsetType = UNSET


class ModelList(msgspec.Struct, kw_only=True, gc=False):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(msgspec.Struct, gc=False):
    status: Literal["ok"] = "ok"


class ReadyStatus(msgspec.Struct, gc=False):
    """``/ready``: ``model`` and the worker's load (its latest heartbeat: running
    and waiting requests, KV cache usage 0..1) only when ready."""

    status: Literal["ready", "not_ready", "draining"]
    model: str | UnsetType | None = UNSET
    worker_active_requests: int | UnsetType | None = UNSET
    worker_waiting_requests: int | UnsetType | None = UNSET
    worker_kv_cache_usage: float | UnsetType | None = UNSET


# ---------------------------------------------------------------- formats


class ResponseFormat(Protocol):
    """Everything that differs between the objects of ``/v1/chat/completions``
    and ``/v1/completions``; ``proxy.streaming`` and the handlers only ever go
    through one of ``CHAT`` or ``TEXT``.

    ``first`` is true for the first chunk sent for a choice: a chat delta then
    carries ``role``.
    """

    @property
    def id_prefix(self) -> str:
        """Prefix of response ids (``chatcmpl-``, ``cmpl-``)."""
        ...

    @property
    def chunk_object(self) -> str:
        """``object`` of stream chunks."""
        ...

    @property
    def response_object(self) -> str:
        """``object`` of the non-stream response."""
        ...

    def content_choice(
        self, index: int, text: str, first: bool, logprobs: Logprobs = None, offset: int = 0
    ) -> StreamChoice:
        """The choice of a chunk carrying generated ``text`` (never empty) and,
        when asked for, the ``logprobs`` of its tokens; ``offset``: characters of
        the choice's text before this chunk (text completions' ``text_offset``)."""
        ...

    def progress_choice(self) -> StreamChoice:
        """Choice 0 of a ``prompt_progress`` chunk: no text yet."""
        ...

    def finish_choice(
        self, index: int, finish_reason: str, first: bool, logprobs: Logprobs = None, offset: int = 0
    ) -> StreamChoice:
        """The choice of a choice's last chunk, with its ``finish_reason`` (and
        the logprobs of its last tokens that added no text, if any)."""
        ...

    def tool_calls_choice(self, index: int, calls: list[ToolCallDelta], first: bool) -> StreamChoice:
        """The choice of a chunk carrying ``delta.tool_calls`` (chat only)."""
        ...

    def tool_response_choice(
        self, index: int, content: str | None, calls: list[ToolCall], finish_reason: str
    ) -> ResponseChoice:
        """A non-stream choice whose answer holds tool calls (chat only)."""
        ...

    def response_choice(
        self, index: int, text: str, finish_reason: str, logprobs: Logprobs = None
    ) -> ResponseChoice:
        """A choice of the non-stream response: the whole text (and the logprobs
        of all its tokens when asked for)."""
        ...


_ROLE_DELTA = Delta(role="assistant")
_EMPTY_DELTA = Delta()
# llama.cpp sends an assistant delta with null content on progress chunks;
# clients that read ``delta.content`` see "no text yet".
_CHAT_PROGRESS = ChatDeltaChoice(0, Delta(role="assistant", content=None))
_TEXT_PROGRESS = TextChoice(0, "")


class ChatFormat:
    """``/v1/chat/completions``: ``chat.completion.chunk`` deltas, ``chat.completion``."""

    __slots__ = ()
    id_prefix: Final = "chatcmpl-"
    chunk_object: Final = "chat.completion.chunk"
    response_object: Final = "chat.completion"

    def content_choice(
        self, index: int, text: str, first: bool, logprobs: Logprobs = None, offset: int = 0
    ) -> ChatDeltaChoice:
        delta = Delta(role="assistant", content=text) if first else Delta(content=text)
        return ChatDeltaChoice(index, delta, _chat_logprobs(logprobs))

    def progress_choice(self) -> ChatDeltaChoice:
        return _CHAT_PROGRESS

    def finish_choice(
        self, index: int, finish_reason: str, first: bool, logprobs: Logprobs = None, offset: int = 0
    ) -> ChatDeltaChoice:
        delta = _ROLE_DELTA if first else _EMPTY_DELTA
        return ChatDeltaChoice(index, delta, _chat_logprobs(logprobs), finish_reason)

    def tool_calls_choice(self, index: int, calls: list[ToolCallDelta], first: bool) -> ChatDeltaChoice:
        # OpenAI's first tool-call delta carries the role and a null content.
        delta = Delta(role="assistant", content=None, tool_calls=calls) if first else Delta(tool_calls=calls)
        return ChatDeltaChoice(index, delta)

    def tool_response_choice(
        self, index: int, content: str | None, calls: list[ToolCall], finish_reason: str
    ) -> ChatMessageChoice:
        message = AssistantMessage(content=content, tool_calls=calls or UNSET)
        return ChatMessageChoice(index, message, None, finish_reason)

    def response_choice(
        self, index: int, text: str, finish_reason: str, logprobs: Logprobs = None
    ) -> ChatMessageChoice:
        message = AssistantMessage(content=text)
        return ChatMessageChoice(index, message, _chat_logprobs(logprobs), finish_reason)


class TextFormat:
    """``/v1/completions``: ``text_completion`` for chunks and the response alike."""

    __slots__ = ()
    id_prefix: Final = "cmpl-"
    chunk_object: Final = "text_completion"
    response_object: Final = "text_completion"

    def content_choice(
        self, index: int, text: str, first: bool, logprobs: Logprobs = None, offset: int = 0
    ) -> TextChoice:
        return TextChoice(index, text, None if logprobs is None else TextLogprobs.of(logprobs, offset))

    def progress_choice(self) -> TextChoice:
        return _TEXT_PROGRESS

    def finish_choice(
        self, index: int, finish_reason: str, first: bool, logprobs: Logprobs = None, offset: int = 0
    ) -> TextChoice:
        lp = None if logprobs is None else TextLogprobs.of(logprobs, offset)
        return TextChoice(index, "", lp, finish_reason)

    def tool_calls_choice(self, index: int, calls: list[ToolCallDelta], first: bool) -> TextChoice:
        raise TypeError("text completions have no tool calls")

    def tool_response_choice(
        self, index: int, content: str | None, calls: list[ToolCall], finish_reason: str
    ) -> TextChoice:
        raise TypeError("text completions have no tool calls")

    def response_choice(
        self, index: int, text: str, finish_reason: str, logprobs: Logprobs = None
    ) -> TextChoice:
        if logprobs is None:
            return TextChoice(index, text, None, finish_reason)
        # The tokens are the end of the text (an echoed prompt comes before them).
        start = len(text) - sum(len(lp.token) for lp in logprobs)
        return TextChoice(index, text, TextLogprobs.of(logprobs, start), finish_reason)


def _chat_logprobs(entries: Logprobs) -> ChatLogprobs | None:
    return None if entries is None else ChatLogprobs([TokenLogprobOut.of(lp) for lp in entries])


CHAT: Final[ResponseFormat] = ChatFormat()
TEXT: Final[ResponseFormat] = TextFormat()


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """The fields every chunk and the response of one request repeat: the
    endpoint's ``fmt``, ``id`` (``fmt.id_prefix`` + hex), ``created`` (Unix
    seconds) and the served ``model`` name."""

    fmt: ResponseFormat
    id: str
    created: int
    model: str


def response(
    header: ChunkHeader,
    texts: Sequence[str],
    finished: Sequence[Finished],
    logprobs: Sequence[Sequence[TokenLogprob]] | None = None,
    per_prompt: int = 0,
) -> Completion:
    """The non-stream response: one choice per text (choice order), with its
    ``finish_reason`` and, when ``logprobs`` is given (one sequence per choice),
    its tokens' log-probabilities, and ``usage`` (always present, see
    ``final_usage``)."""
    fmt = header.fmt
    return Completion(
        header.id,
        fmt.response_object,
        header.created,
        header.model,
        [
            fmt.response_choice(i, text, str(f.finish_reason), None if logprobs is None else logprobs[i])
            for i, (text, f) in enumerate(zip(texts, finished, strict=True))
        ],
        final_usage(finished, per_prompt),
    )
