"""Request fields every dialect shares: tolerant body decoding, field types, the
sampler fields and the one sampling builder, the one JSON-output builder.

``decode`` turns a JSON body into a dialect's request struct: unknown fields
are ignored, a top-level ``null`` is "not given", and a field the dialect
defines but this server cannot honour is refused (``Refusals``) with a 400
naming it. Numeric field types carry the ranges the OpenAI API reference gives
(and the int32 bound of a token count or id, since they travel as MessagePack
integers and index tensors in the worker).

``SamplerFields`` is the sampler vocabulary each dialect's request struct
inherits (temperature, nucleus and top-k, min-p, penalties, seed, stop token
ids, logit bias, ``min_tokens``, ``ignore_eos``; this server's
``return_progress``; vLLM's ``cache_salt``; the local-LLM fields of
``proxy.core.samplers.TABLE``, whose aliases, neutral values and refusals
``decode`` applies to every body decoded into one); ``SamplerFields.sampling`` is the
only place a ``proxy.core.task.Sampling`` is built from a request, whatever
the dialect's names for the completion limit and the stop strings.
``json_output`` is the only place a structured-output field becomes a
``proxy.core.task.JsonOutput``. Errors: ``proxy.errors.InvalidRequest``
naming the field.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import Annotated, ClassVar, Literal, TypeVar

import msgspec

from protocol.messages import MAX_STOP_CHARS, MAX_STOP_STRINGS
from proxy.core import samplers
from proxy.core.task import JsonOutput, Sampling
from proxy.errors import InvalidRequest, quoted
from proxy.grammar.check import ANY_JSON_OBJECT
from proxy.tools import (
    FunctionIn,
    NamedToolChoiceIn,
    ToolChoiceIn,
    ToolConfig,
    ToolIn,
    ToolSpecError,
    resolve_tools,
)
from proxy.tools.spec import FunctionName

log = logging.getLogger(__name__)

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
PenaltyRange = Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)]
"""Tokens the penalties look at: -1 for the whole context (TabbyAPI's ``penalty_range``)."""
Decay = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
MAX_BANNED_TOKENS = 4096
"""Most ``banned_tokens`` of one request (a bounded mask the worker builds per sequence)."""
MAX_BANNED_STRINGS = 64
"""Most ``banned_strings`` of one request (each one is searched in the held text per token)."""
BannedString = Annotated[str, msgspec.Meta(max_length=256)]
Salt = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
"""vLLM's ``cache_salt``: prefix-cache entries are shared only within one salt."""


_S = TypeVar("_S", bound=msgspec.Struct)

_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
"""A JSON ``\\uD800``-``\\uDBFF`` escape not followed by a low surrogate's (RFC 8259 §7)."""

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
        lone = _LONE_HIGH_SURROGATE.search(body)
        if lone is not None and "truncated" in str(e):
            # msgspec reads a high surrogate escape as the start of a pair and, finding
            # no low one after it, reports the input as truncated.
            raise InvalidRequest(
                "Request body is not valid JSON: a lone UTF-16 surrogate escape "
                f"({lone.group(0).decode()} without a low surrogate after it) at byte {lone.start()}"
            ) from None
        raise InvalidRequest(f"Request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("Request body is not valid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"Request body must be a JSON object, got {type(raw).__name__}")
    raw = {k: v for k, v in raw.items() if v is not None}
    if issubclass(cls, SamplerFields):
        raw = samplers.resolve(raw, where)
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
                f"'logit_bias' keys must be token ids (integers as strings), got {quoted(key)}",
                param="logit_bias",
            )
        token = int(key)
        if not 0 <= token <= INT32_MAX:
            raise InvalidRequest(
                f"'logit_bias' token ids must be in 0..{INT32_MAX}, got {token}", param="logit_bias"
            )
        out[token] = value
    return out


OPENAI_MAX_STOPS = 4
"""OpenAI's limit of ``stop`` ("Up to 4 sequences", the chat and completions
references), held by the dialects that follow its API."""

MESSAGES_MAX_STOPS = MAX_STOP_STRINGS
"""Anthropic's Messages reference gives ``stop_sequences`` no count limit;
this server takes up to ``protocol.messages.MAX_STOP_STRINGS`` (64)."""


def stop_strings(stop: str | list[str] | None, limit: int = MAX_STOP_STRINGS) -> tuple[str, ...]:
    """``stop`` as a string or a list, as a tuple: at most ``limit`` strings
    (at most ``protocol.messages.MAX_STOP_STRINGS``), each at most
    ``MAX_STOP_CHARS`` characters. Raises ``InvalidRequest`` naming ``stop``
    (the core renames it into the dialect's term: ``stop_sequences``)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    limit = min(limit, MAX_STOP_STRINGS)
    if len(stops) > limit:
        raise InvalidRequest(f"'stop' takes at most {limit} sequences, got {len(stops)}", param="stop")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            message = f"'stop' sequences are at most {MAX_STOP_CHARS} characters; number {i} has {len(s)}"
            raise InvalidRequest(message, param=where)
    return stops


def json_output(
    kind: str | None,
    schema: dict[str, object] | bool | None,
    *,
    param: str,
    schema_param: str,
    strict: bool = False,
    kinds: tuple[str, ...] = ("text", "json_object", "json_schema"),
) -> JsonOutput | None:
    """The JSON output a structured-output field asks for, ``None`` for none.

    ``kind`` is the field's ``type``: absent or ``text`` (no constraint),
    ``json_object`` (any JSON object) or ``json_schema`` (``schema``, held at
    ``schema_param``); ``kinds`` lists those the dialect defines. ``param``
    names the field itself (OpenAI chat: ``response_format``; Responses:
    ``text.format``; Messages: ``output_config.format``). Raises
    ``InvalidRequest`` for a kind the dialect does not define (naming
    ``param.type``) and for ``json_schema`` without a schema (naming
    ``schema_param``)."""
    if kind is None or (kind == "text" and "text" in kinds):
        return None
    if kind not in kinds:
        expected = ", ".join(repr(k) for k in kinds)
        raise InvalidRequest(f"'{param}.type' is {quoted(kind)}; expected {expected}", param=f"{param}.type")
    if kind == "json_object":
        return JsonOutput(ANY_JSON_OBJECT, param)
    if schema is None:
        raise InvalidRequest(f"'{param}' of type 'json_schema' needs '{schema_param}'", param=schema_param)
    return JsonOutput(schema, schema_param, strict)


class SamplerFields(msgspec.Struct, kw_only=True):
    """The sampler fields every dialect's request takes, under the names the
    OpenAI API and the local servers (vLLM, llama.cpp) give them; a dialect's
    struct inherits them and adds its own limit, stop and structured-output
    fields. ``return_progress`` (this server's, llama.cpp's name) asks for
    ``prompt_progress``/``queue_progress`` on a stream; the core decides it
    once (``proxy.core.dialect.Job.return_progress``). ``MAX_STOPS`` is the
    dialect's limit of stop strings (``stop_strings``): OpenAI's 4 unless the
    dialect's struct says otherwise."""

    MAX_STOPS: ClassVar[int] = OPENAI_MAX_STOPS

    model: str | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Prob | None = None
    repetition_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None = None
    ignore_eos: bool = False
    min_tokens: MinTokens = 0
    logit_bias: dict[str, Bias] | None = None
    return_progress: bool = False
    cache_salt: Salt | None = None
    # The local-LLM vocabulary (proxy.core.samplers.TABLE has each one's aliases and meaning).
    temperature_last: bool = False
    penalty_range: PenaltyRange = -1
    repetition_decay: Decay = 0
    xtc_probability: Prob = 0.0
    xtc_threshold: Prob = 0.1
    banned_tokens: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_BANNED_TOKENS)] | None = None
    ban_eos_token: bool = False
    skip_special_tokens: bool | None = None
    add_bos_token: bool | None = None
    banned_strings: Annotated[list[BannedString], msgspec.Meta(max_length=MAX_BANNED_STRINGS)] | None = None
    dry_multiplier: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    dry_base: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.75
    dry_allowed_length: Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)] = 2
    dry_range: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] = 0
    dry_sequence_breakers: (
        Annotated[list[BannedString], msgspec.Meta(max_length=MAX_BANNED_STRINGS)] | None
    ) = None
    thinking_budget_tokens: MinTokens | None = None
    """llama.cpp's per-request thinking budget (tokens; 0: no thinking)."""
    thinking_token_budget: MinTokens | None = None
    """vLLM's name for it."""
    reasoning_budget_tokens: MinTokens | None = None
    """TabbyAPI's and llama.cpp's older name for it."""

    def thinking_budget(self) -> int | None:
        """The thinking budget under whichever name it came. Raises ``InvalidRequest``
        when two names give different values."""
        names = ("thinking_budget_tokens", "thinking_token_budget", "reasoning_budget_tokens")
        given = [(n, getattr(self, n)) for n in names if getattr(self, n) is not None]
        for name, value in given[1:]:
            if value != given[0][1]:
                raise InvalidRequest(
                    f"'{name}' ({value}) contradicts '{given[0][0]}' ({given[0][1]})", param=name
                )
        return given[0][1] if given else None

    def sampling(
        self, *, max_tokens: int | None, stop: str | list[str] | None, logprobs: int | None
    ) -> Sampling:
        """The neutral sampling of this request with the dialect's completion
        limit (``None``: up to the end of the context), stop strings and
        logprobs (alternatives per token, ``None`` for none). Raises
        ``InvalidRequest`` for a ``logit_bias`` key that is not a token id and
        for stop strings beyond ``MAX_STOPS`` or ``MAX_STOP_CHARS``."""
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
            stop=stop_strings(stop, self.MAX_STOPS),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logit_bias=logit_bias(self.logit_bias),
            logprobs=logprobs,
            temperature_last=self.temperature_last,
            penalty_range=self.penalty_range,
            repetition_decay=self.repetition_decay,
            xtc_probability=self.xtc_probability,
            xtc_threshold=self.xtc_threshold,
            banned_tokens=tuple(sorted(set(self.banned_tokens or ()))),
            ban_eos_token=self.ban_eos_token,
            skip_special_tokens=self.skip_special_tokens,
            add_bos_token=self.add_bos_token,
            banned_strings=tuple(self.banned_strings or ()),
            dry_multiplier=self.dry_multiplier,
            dry_base=self.dry_base,
            dry_allowed_length=self.dry_allowed_length,
            dry_range=self.dry_range,
            dry_sequence_breakers=None
            if self.dry_sequence_breakers is None
            else tuple(self.dry_sequence_breakers),
            reasoning_budget=self.thinking_budget(),
        )


MAX_TOOLS = 128
"""Most tools of one request: OpenAI's limit ("A max of 128 functions are
supported", the chat reference's ``tools``), held by every dialect."""


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
"""OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses)."""


def thinking(
    sampling: Sampling, effort: str | None, template_kwargs: dict[str, object] | None
) -> tuple[Sampling, dict[str, object] | None]:
    """A request's thinking switches as one budget and the template's variables:
    ``effort`` ``none`` is a budget of 0 (no thinking) unless a budget was given;
    another effort goes to the template as ``reasoning_effort`` (GPT-OSS's template
    reads it), with the client's ``template_kwargs`` (``chat_template_kwargs``)."""
    kwargs = dict(template_kwargs or {})
    if effort == "none":
        if sampling.reasoning_budget is None:
            sampling = dataclasses.replace(sampling, reasoning_budget=0)
    elif effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    return sampling, kwargs or None


def function_tool(
    name: str | None,
    description: str | None,
    parameters: dict[str, object] | None,
    strict: bool | None = None,
) -> ToolIn:
    """A dialect's function tool (Responses' flat ``{"type": "function", "name",
    ...}``, Anthropic's ``{"name", "input_schema"}``) as chat's ``tools[i]``."""
    fn = FunctionIn(name=name, description=description, parameters=parameters, strict=strict)
    return ToolIn(type="function", function=fn)


def named_choice(name: str | None) -> NamedToolChoiceIn:
    """A forced call of the function ``name`` as chat's ``tool_choice``."""
    return NamedToolChoiceIn(type="function", function=FunctionName(name=name))


def tool_config(
    tools: list[ToolIn] | None, choice: ToolChoiceIn | None, parallel: bool | None
) -> ToolConfig | None:
    """``proxy.tools.resolve_tools`` with its errors as ``InvalidRequest``
    naming the field (``tools[i].function.parameters``, ``tool_choice``); at
    most ``MAX_TOOLS`` tools."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    try:
        return resolve_tools(tools, choice, parallel)
    except ToolSpecError as e:
        raise InvalidRequest(e.message, param=e.param) from None
