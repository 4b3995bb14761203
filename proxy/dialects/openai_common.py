"""The OpenAI shapes the chat, text completions and Responses dialects share.

Request side: the tolerant decoding of a JSON body into a request struct
(``decode``: unknown fields ignored, a top-level ``null`` is "not given",
fields this server refuses named in a 400), numeric field types, text content
parts, ``stream_options``, ``logit_bias``.

Response side (``msgspec.Struct``s; field order is key order on the wire, a
field set to ``UNSET`` is left out): ``Usage`` (chat and text completions),
logprobs in the chat and legacy shapes, llama.cpp's ``timings``,
``prompt_progress`` and ``queue_progress``.

Sources: the OpenAI API reference (usage, logprobs objects), llama.cpp's server
(``timings``, ``prompt_progress``), vLLM (``continuous_usage_stats``);
``queue_progress`` is this server's (``docs/http-contract.md``).

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
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Annotated, ClassVar, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from protocol.messages import PrefillProgress, QueueProgress, TokenLogprob
from proxy import sse
from proxy.constraints import ANY_JSON_OBJECT
from proxy.dialect import Header
from proxy.errors import InvalidRequest, ProxyError, envelope
from proxy.generation import Generation
from proxy.task import JsonOutput, Sampling
from proxy.tools import ToolCall, ToolCallDelta
from proxy.usage import Counts

log = logging.getLogger(__name__)

# gc=False: these structs never take part in reference cycles, and skipping GC
# tracking makes the one-per-token chunk allocation cheaper.

# ---------------------------------------------------------------- request fields

Prob = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# Token counts and ids travel as MessagePack integers and are used as tensor
# indices: anything beyond int32 is a client error, not an overflow in the worker.
INT32_MAX = 2**31 - 1
Count = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)]
# Multiplicative: below ~0.01 it scales logits past float32's range.
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=0.01, le=100.0)]
MinTokens = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
Salt = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
"""vLLM's ``cache_salt``: prefix-cache entries are shared only within one salt."""


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds one last chunk with ``choices: []``
    and the usage; ``continuous_usage_stats`` (vLLM) adds running usage to every
    chunk (only together with ``include_usage``)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


_S = TypeVar("_S", bound=msgspec.Struct)

_PATH_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]+)`")


def param_of(message: str) -> str | None:
    """The JSON path msgspec names in a validation message, as the error's
    ``param`` (``$.messages[0].content`` -> ``messages[0].content``)."""
    m = _PATH_RE.search(message)
    # msgspec writes a dict value's path as "name[...]"; the parameter is "name".
    path = m.group("path").replace("[...]", "") if m else ""
    missing = _MISSING_RE.search(message)
    if missing:
        field = missing.group("field")
        return f"{path}.{field}" if path else field
    return path or None


Refusals = dict[str, Callable[[object], bool]]
"""Fields a dialect defines that this server does not implement, each with a
test of the values that ask for nothing (a client sending those loses
nothing). Any other value is a 400 naming the field: a client that asked for
something and got an answer without it could not tell it was ignored."""


REFUSE_NOTHING: Refusals = {}
"""For bodies with no field to refuse."""


def never(value: object) -> bool:
    """For ``Refusals``: no value of the field is harmless."""
    return False


def decode(body: bytes, cls: type[_S], refusals: Refusals, where: str) -> _S:
    """Decode a JSON request body into ``cls``. Top-level ``null`` fields count
    as absent (clients send e.g. ``"n": null``); a field of ``refusals`` with a
    value that asks for something is refused; unknown fields are ignored (logged
    at debug level). Raises ``InvalidRequest`` naming the field; ``where`` (the
    endpoint) goes into the refusal's message."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"Request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("Request body is not valid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"Request body must be a JSON object, got {type(raw).__name__}")
    raw = {k: v for k, v in raw.items() if v is not None}
    for name, harmless in refusals.items():
        if name in raw and not harmless(raw[name]):
            raise InvalidRequest(
                f"'{name}' is not supported by this server on {where} yet; it is refused rather than "
                "ignored so that the answer never silently differs from what was asked",
                param=name,
            )
    try:
        req = msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        param = param_of(str(e))
        at = f" (parameter '{param}')" if param else ""
        raise InvalidRequest(f"Invalid request{at}: {e}", param=param) from None
    if log.isEnabledFor(logging.DEBUG):
        unknown = sorted(set(raw) - set(cls.__struct_fields__))
        if unknown:
            log.debug("ignoring unknown request fields: %s", ", ".join(unknown))
    return req


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as strings) with integer keys. Raises
    ``InvalidRequest`` for a key that is not a token id."""
    if not raw:
        return None
    out: dict[int, float] = {}
    for key, value in raw.items():
        # int() also takes " 1", "1_0" and non-ASCII digits: only plain digits are ids.
        if not (key.isascii() and key.isdigit()):
            raise InvalidRequest(
                f"'logit_bias' keys must be token ids (integers as strings), got {key!r}", param="logit_bias"
            )
        token = int(key)
        if not 0 <= token <= INT32_MAX:
            raise InvalidRequest(
                f"'logit_bias' token ids must be in 0..{INT32_MAX}, got {token}", param="logit_bias"
            )
        out[token] = value
    return out


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as a string or a list, as a tuple."""
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's ``content`` list; only ``type == "text"`` is supported."""

    type: str
    text: str | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: ``schema`` is the JSON schema the output
    must match; ``strict`` is accepted (the output always matches when the
    grammar can express the schema; one it cannot is refused with a 400)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, object] | bool | None = None
    strict: bool | None = None


class ResponseFormatIn(msgspec.Struct, kw_only=True):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def json_output(rf: ResponseFormatIn | None, param: str = "response_format") -> JsonOutput | None:
    """The JSON output ``response_format`` asks for, ``None`` for none. Raises
    ``InvalidRequest`` for ``json_schema`` without a schema."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return JsonOutput(ANY_JSON_OBJECT, param)
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise InvalidRequest(
            f"'{param}' of type 'json_schema' needs 'json_schema.schema'", param=f"{param}.json_schema"
        )
    return JsonOutput(rf.json_schema.schema, f"{param}.json_schema", bool(rf.json_schema.strict))


class SamplingFields(msgspec.Struct, kw_only=True):
    """The fields chat and text completions share: the model, limits, sampling,
    streaming and this server's extras (``return_progress``, llama.cpp's
    ``timings_per_token``; vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
    ``min_tokens``, ``ignore_eos``, ``stop_token_ids``)."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Prob | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    logit_bias: dict[str, Bias] | None = None
    n: Count = 1  # capped by ProxySettings.max_n where the request is served
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_progress: bool = False
    response_format: ResponseFormatIn | None = None
    timings_per_token: bool = False  # llama.cpp: its ``timings`` object on every chunk
    cache_salt: Salt | None = None  # vLLM's

    @property
    def include_usage(self) -> bool:
        """Streaming: send the usage chunk at the end."""
        return self.stream and self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Streaming: running usage on every chunk (vLLM's extension)."""
        return (
            self.include_usage
            and self.stream_options is not None
            and bool(self.stream_options.continuous_usage_stats)
        )

    @property
    def progress(self) -> bool:
        """``prompt_progress`` chunks are sent (stream and return_progress only)."""
        return self.stream and self.return_progress

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> Sampling:
        """The neutral sampling of this request with its completion limit and logprobs."""
        return Sampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=stop_strings(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logit_bias=logit_bias(self.logit_bias),
            logprobs=logprobs,
        )


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


# ---------------------------------------------------------------- progress


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


# ---------------------------------------------------------------- chunks and bodies (chat, text)


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


# ---------------------------------------------------------------- stream encoder (chat, text)


class ChunkFrames:
    """The stream encoder chat and text completions share: one ``data:`` event
    per chunk (``StreamChunk``), ``prompt_progress``/``queue_progress`` on
    chunks of their own, usage per ``stream_options``, llama.cpp's ``timings``
    with ``timings_per_token``; then the usage chunk (with ``include_usage``) and
    ``data: [DONE]``; an error after the headers is one ``data: {"error": ...}``
    event and ``[DONE]``. Subclasses give the ``object`` name and the choices."""

    __slots__ = ("_continuous", "_include_usage", "_object", "_timings", "gen", "header")

    ping = sse.PING
    progress_choice: ClassVar[StreamChoice]
    """Choice 0 of a progress or queue chunk (no text yet): the subclass's."""

    def __init__(
        self,
        gen: Generation,
        header: Header,
        object_: str,
        *,
        include_usage: bool,
        continuous_usage: bool,
        timings: bool,
    ) -> None:
        self.gen = gen
        self.header = header
        self._object = object_
        self._include_usage = include_usage
        self._continuous = continuous_usage
        self._timings = timings

    def timings_now(self) -> Timings:
        """Final ``timings`` once the response is done, running ones before."""
        gen = self.gen
        if gen.done:
            return Timings.final(gen.final_counts())
        c = gen.running_counts()
        return Timings.of(
            c.cached_tokens,
            c.prompt_tokens - c.cached_tokens,
            gen.prefill_seconds(),
            c.completion_tokens,
            gen.decode_seconds(),
        )

    def chunk(self, choice: StreamChoice) -> StreamChunk:
        usage: Usage | UnsetType | None = UNSET
        if self._continuous:
            usage = usage_of(self.gen.running_counts(), final=False)
        elif self._include_usage:
            usage = None
        h = self.header
        chunk = StreamChunk(h.id, self._object, h.created, h.model, [choice], UNSET, usage)
        if self._timings:
            chunk.timings = self.timings_now()
        return chunk

    def queue(self, ev: QueueProgress, out: list[bytes]) -> None:
        self.gen.choices[0].first_sent = True
        chunk = self.chunk(self.progress_choice)
        chunk.queue_progress = QueuePosition.of(ev)
        out.append(sse.event(chunk))

    def progress(self, ev: PrefillProgress, out: list[bytes]) -> None:
        self.gen.choices[0].first_sent = True
        chunk = self.chunk(self.progress_choice)
        chunk.prompt_progress = PromptProgress.of(ev)
        out.append(sse.event(chunk))

    def open(self, out: list[bytes]) -> None:
        pass

    def close(self, out: list[bytes]) -> None:
        if self._include_usage:
            h = self.header
            usage = usage_of(self.gen.final_counts())
            out.append(sse.event(StreamChunk(h.id, self._object, h.created, h.model, [], usage=usage)))
        out.append(sse.DONE)

    def error(self, exc: ProxyError, out: list[bytes]) -> None:
        out.append(sse.event(envelope(exc)))
        out.append(sse.DONE)
