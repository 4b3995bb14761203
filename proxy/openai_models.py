"""OpenAI request bodies at the HTTP edge and their conversion into ``protocol.Submit``.

Two type layers: these structs are tolerant (unknown fields are ignored and
logged at debug level, never an error), the wire messages are strict. Each
request is validated once here and converted once (``to_submit``).

Shapes follow the OpenAI API reference for ``POST /v1/chat/completions`` and
``POST /v1/completions``, plus extras other local servers accept:
``return_progress`` and ``timings_per_token`` (llama.cpp), ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``add_generation_prompt`` and
``stream_options.continuous_usage_stats`` (vLLM).

Every validation failure raises ``proxy.errors.InvalidRequest`` (400) whose
message and ``param`` name the offending field, e.g. ``max_tokens``,
``messages[0].content``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal, TypeVar

import msgspec

from protocol.messages import ChatMessage, SamplingParams, Submit
from proxy.constraints import response_schema
from proxy.errors import InvalidRequest
from proxy.tools import (
    FormatChoice,
    HistoryMessage,
    ToolCall,
    ToolCallFormat,
    ToolChoiceIn,
    ToolConfig,
    ToolIn,
    ToolSpecError,
    check_history,
    render_fallback,
    resolve_tools,
    tool_call_grammar,
    tools_or_answer_grammar,
)

log = logging.getLogger(__name__)


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds one last chunk with ``choices: []``
    and the usage; ``continuous_usage_stats`` (vLLM) adds running usage to every
    chunk (only together with ``include_usage``)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's ``content`` list; only ``type == "text"`` is supported."""

    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """One chat turn as clients send it; ``content`` may be a string, a list of
    text parts, or ``null`` (an assistant turn that only called tools).
    ``tool_calls`` (assistant), ``tool_call_id`` (tool) and ``name`` carry the
    tool side of the conversation (``proxy.tools``)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


_Prob = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# Token counts and ids travel as MessagePack integers and are used as tensor
# indices: anything beyond int32 is a client error, not an overflow in the worker.
_INT32_MAX = 2**31 - 1
_Count = Annotated[int, msgspec.Meta(ge=1, le=_INT32_MAX)]
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)]
_Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily: dividing logits by them overflows."""
_Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


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


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: _Count | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=_INT32_MAX)] | None = None
    min_p: _Prob | None = None
    # Multiplicative: below ~0.01 it scales logits past float32's range.
    repetition_penalty: Annotated[float, msgspec.Meta(ge=0.01, le=100.0)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    seed: _Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[_TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0, le=_INT32_MAX)] = 0
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    n: _Count = 1  # capped by ProxySettings.max_n where the request is served
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_progress: bool = False
    response_format: ResponseFormatIn | None = None
    timings_per_token: bool = False  # llama.cpp: its ``timings`` object on every chunk

    def logprobs_k(self) -> int | None:
        """Alternatives per token the client asked for, ``None`` for no logprobs."""
        return None

    @property
    def include_usage(self) -> bool:
        """Streaming: send the usage chunk at the end."""
        return self.stream_options is not None and bool(self.stream_options.include_usage)

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

    def completion_limit(self) -> int | None:
        """The requested completion length in tokens, or ``None`` when absent."""
        return self.max_tokens


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions`` body. ``max_completion_tokens`` wins over the
    deprecated ``max_tokens``."""

    messages: list[ChatMessageIn]
    max_completion_tokens: _Count | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None

    def logprobs_k(self) -> int | None:
        """``top_logprobs`` (0 when absent) when ``logprobs`` is true, else ``None``."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def completion_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else ``None``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat has none)."""


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions`` body: a text prompt, or a list of them (each gets
    ``n`` choices, indexed across prompts); token-id prompts are refused. ``logprobs``
    (0..20) asks for that many alternatives per token; ``echo`` puts the prompt
    before each choice's text. A missing ``max_tokens`` is 16, as OpenAI's."""

    prompt: str | list[str]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def completion_limit(self) -> int | None:
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens


_R = TypeVar("_R", bound=_SamplingFields)

_PATH_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING_RE = re.compile(r"missing required field `(?P<field>[^`]+)`")


def _param_of(message: str) -> str | None:
    """The JSON path msgspec names in a validation message, as OpenAI's ``param``
    (``$.messages[0].content`` -> ``messages[0].content``)."""
    m = _PATH_RE.search(message)
    # msgspec writes a dict value's path as "name[...]"; the parameter is "name".
    path = m.group("path").replace("[...]", "") if m else ""
    missing = _MISSING_RE.search(message)
    if missing:
        field = missing.group("field")
        return f"{path}.{field}" if path else field
    return path or None


def _never(value: object) -> bool:
    return False


# Fields the OpenAI API defines that this server does not implement yet, each with
# the values that ask for nothing (a client sending those loses nothing). Any other
# value is a 400 naming the field: a client that asked for a tool call, JSON or
# logprobs and got plain text with a 200 could not tell it was ignored.
_NOT_SUPPORTED: dict[str, Callable[[object], bool]] = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "prediction": _never,
    "modalities": lambda v: v == ["text"],
    "audio": _never,
    "web_search_options": _never,
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
}


def _refuse_unsupported(raw: dict[str, object], cls: type) -> None:
    for name, harmless in _NOT_SUPPORTED.items():
        if name in raw and not harmless(raw[name]):
            where = "/v1/chat/completions" if cls is ChatCompletionRequest else "/v1/completions"
            raise InvalidRequest(
                f"'{name}' is not supported by this server on {where} yet; it is refused rather than "
                "ignored so that the answer never silently differs from what was asked",
                param=name,
            )


def _decode(body: bytes, cls: type[_R]) -> _R:
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"Request body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest("Request body is not valid JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise InvalidRequest(f"Request body must be a JSON object, got {type(raw).__name__}")
    # OpenAI treats a top-level null as "not given"; clients send e.g. "n": null.
    raw = {k: v for k, v in raw.items() if v is not None}
    _refuse_unsupported(raw, cls)
    try:
        req = msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        param = _param_of(str(e))
        where = f" (parameter '{param}')" if param else ""
        raise InvalidRequest(f"Invalid request{where}: {e}", param=param) from None
    if log.isEnabledFor(logging.DEBUG):
        unknown = sorted(set(raw) - set(cls.__struct_fields__))
        if unknown:
            log.debug("ignoring unknown request fields: %s", ", ".join(unknown))
    return req


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    """Decode and validate a chat completions body. Raises ``InvalidRequest``."""
    req = _decode(body, ChatCompletionRequest)
    if not req.messages:
        raise InvalidRequest("'messages' must contain at least one message", param="messages")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    return req


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Decode and validate a text completions body. Raises ``InvalidRequest``."""
    req = _decode(body, CompletionRequest)
    if req.echo and req.logprobs is not None:
        raise InvalidRequest(
            "'echo' with 'logprobs' would need the prompt tokens' log-probabilities, which this server "
            "does not compute; ask for one or the other",
            param="echo",
        )
    if isinstance(req.prompt, list) and not req.prompt:
        raise InvalidRequest("'prompt' must be a string or a non-empty list of strings", param="prompt")
    return req


def _flatten_content(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            param = f"messages[{i}].content[{j}]"
            problem = "a text part without 'text'" if part.type == "text" else f"type '{part.type}'"
            raise InvalidRequest(
                f"Only text content parts are supported; '{param}' is {problem}", param=param
            )
        texts.append(part.text)
    # Parts are joined with a newline, as vLLM does for text-only content.
    return "\n".join(texts)


def chat_messages(req: ChatCompletionRequest, tools: ToolPlan | None = None) -> tuple[ChatMessage, ...]:
    """The request's turns with ``content`` flattened to text. OpenAI's
    ``developer`` role becomes ``system``, which chat templates know. With
    tools, or tool turns in the history, the history is checked
    (``proxy.tools.check_history``) and then either kept structured for a
    template that renders tools (``ToolPlan.native``) or rendered by
    ``proxy.tools.render_fallback``: the tool schemas in the system prompt and
    calls and results as text, in the plan's format."""
    if tools is None and not any(m.tool_calls or m.role in ("tool", "function") for m in req.messages):
        return tuple(
            ChatMessage(
                role="system" if m.role == "developer" else m.role, content=_flatten_content(m.content, i)
            )
            for i, m in enumerate(req.messages)
        )
    history = [
        HistoryMessage(
            role=m.role,
            content=None if m.content is None else _flatten_content(m.content, i),
            tool_calls=tuple(m.tool_calls or ()),
            tool_call_id=m.tool_call_id,
            name=m.name,
        )
        for i, m in enumerate(req.messages)
    ]
    try:
        check_history(history)
    except ToolSpecError as e:
        raise InvalidRequest(e.message, param=e.param) from None
    if tools is not None and tools.native:
        return _native_messages(req)
    config = tools.config if tools is not None else None
    fmt = tools.format if tools is not None else None
    pairs = render_fallback(config, history) if fmt is None else render_fallback(config, history, fmt)
    return tuple(ChatMessage(role, content) for role, content in pairs)


def _native_messages(req: ChatCompletionRequest) -> tuple[ChatMessage, ...]:
    """Turns with their tool fields for a template that renders tools: the
    calls' ``arguments`` decoded to objects (templates index into them)."""
    out: list[ChatMessage] = []
    for i, m in enumerate(req.messages):
        calls_json = None
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = msgspec.json.decode(c.function.arguments)
                except msgspec.DecodeError:
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise InvalidRequest(f"'{param}' is not valid JSON", param=param) from None
                calls.append(
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                )
            calls_json = msgspec.json.encode(calls).decode()
        role = "system" if m.role == "developer" else m.role
        content = "" if m.content is None else _flatten_content(m.content, i)
        out.append(ChatMessage(role, content, calls_json, m.tool_call_id, m.name))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools are served: ``config`` (functions, choice,
    parallel calls), the call ``format`` the output is parsed in, and whether
    the model's chat template renders the tools itself (``native``: they go to
    the worker as ``Submit.tools_json`` with structured tool turns) or the
    generic tools prompt does (``proxy.tools.render_fallback``)."""

    config: ToolConfig
    format: ToolCallFormat
    native: bool = False

    def tools_json(self) -> str:
        """OpenAI's ``tools`` array for the template: the callable functions."""
        tools = [
            {
                "type": "function",
                # ``strict`` is for the grammar, not for the template.
                "function": {
                    k: v for k, v in msgspec.structs.asdict(t).items() if v is not None and k != "strict"
                },
            }
            for t in self.config.callable_tools()
        ]
        return msgspec.json.encode(tools).decode()


def tool_plan(req: ChatCompletionRequest | CompletionRequest, choice: FormatChoice) -> ToolPlan | None:
    """The request's ``ToolPlan`` (``None`` without tools), the format from
    ``choice`` (``proxy.tools.choose_format``). Raises ``InvalidRequest``
    naming ``tools``/``tool_choice`` for a bad spec, ``logprobs`` asked
    together with tool calls (not honoured on an answer that may be a call),
    and ``stop`` with a forced call. A forced
    call is one call, several only for ``required`` with
    ``parallel_tool_calls: true``."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    try:
        config = resolve_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolSpecError as e:
        raise InvalidRequest(e.message, param=e.param) from None
    if config is None:
        return None
    if config.forced:
        # A forced answer is one call unless the client asked for several:
        # always for a named function (as OpenAI's), and for "required" unless
        # parallel_tool_calls is true. Otherwise a grammar that allows "another
        # call" lets a small model repeat calls until max_tokens.
        if config.mode == "function" or req.parallel_tool_calls is None:
            config = msgspec.structs.replace(config, parallel=False)
        if req.stop:
            # A stop string can match inside the call's markup (Hermes' "\n")
            # and cut the call short: refused rather than silently breaking it.
            raise InvalidRequest(
                "'stop' cannot be combined with a forced tool call ('tool_choice' required or a function)",
                param="stop",
            )
    rf = req.response_format
    if config.mode == "auto" and rf is not None and rf.type != "text" and req.parallel_tool_calls is None:
        # The grammar is a call or the JSON answer: one call, as for a forced one.
        config = msgspec.structs.replace(config, parallel=False)
    if config.active and req.logprobs:
        raise InvalidRequest(
            "'logprobs' cannot be combined with tool calls ('tool_choice' is not 'none')",
            param="logprobs",
        )
    return ToolPlan(config, choice.format, choice.native)


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
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
        if not 0 <= token <= _INT32_MAX:
            raise InvalidRequest(
                f"'logit_bias' token ids must be in 0..{_INT32_MAX}, got {token}", param="logit_bias"
            )
        out[token] = value
    return out


def _temperature(t: float | None) -> float:
    if t is None:
        return 1.0
    return 0.0 if t < GREEDY_BELOW_TEMPERATURE else t


def sampling_params(
    req: _SamplingFields, max_context_tokens: int, tools: ToolPlan | None = None
) -> SamplingParams:
    """Wire sampling parameters. An absent completion limit becomes
    ``max_context_tokens`` on chat (the worker stops at the end of the context);
    ``top_k == -1`` (vLLM's "disabled") becomes 0; a temperature below
    ``GREEDY_BELOW_TEMPERATURE`` becomes 0 (greedy); empty stop strings are dropped.
    The grammar: a forced call's (``response_format`` ignored), else with tools
    a call or the ``response_format`` JSON, else that JSON; not checked here
    (``proxy.constraints.validate``). Raises ``InvalidRequest`` for a bad
    ``logit_bias`` key or a ``json_schema`` without its schema."""
    limit = req.completion_limit()
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    answer = response_schema(req.response_format)
    grammar, grammar_param = (answer.grammar(), answer.param) if answer is not None else (None, None)
    # Not lenient: a keyword llguidance cannot enforce is a 400, not ignored.
    if tools is not None and tools.config.forced:  # the call, whatever response_format says
        grammar, grammar_param = tool_call_grammar(tools.format, tools.config, lenient=False), "tool_choice"
    elif tools is not None and tools.config.active and answer is not None:  # a call or the JSON answer
        grammar = tools_or_answer_grammar(
            tools.format, tools.config, answer.schema, answer.param, lenient=False
        )
        grammar_param = "tools"
    return SamplingParams(
        max_tokens=limit if limit is not None else max_context_tokens,
        temperature=_temperature(req.temperature),
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        seed=req.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=req.logprobs_k(),
        grammar=grammar,
        grammar_param=grammar_param,
    )


def to_submit(
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    max_context_tokens: int,
    tools: ToolPlan | None = None,
) -> Submit:
    """The one ``Submit`` of a request, ``n`` choices included: the worker runs them
    as the engine requests ``protocol.choice_ids(request_id, n)`` and derives each
    choice's seed from the request's own (``protocol.choice_seed``). ``tools``
    (``tool_plan``) renders the tools into the messages and, for a forced call,
    constrains the output to one. Raises ``InvalidRequest``."""
    params = sampling_params(req, max_context_tokens, tools)
    if isinstance(req, ChatCompletionRequest):
        return Submit(
            request_id,
            params,
            tools_json=tools.tools_json()
            if tools is not None and tools.native and tools.config.active
            else None,
            messages=chat_messages(req, tools),
            add_generation_prompt=req.add_generation_prompt,
            n=req.n,
        )
    return Submit(request_id, params, prompt=prompts(req)[0], n=req.n)


def prompts(req: CompletionRequest) -> list[str]:
    """The request's prompts: one for a string, each entry of a list."""
    return [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)


def to_submits(
    req: ChatCompletionRequest | CompletionRequest,
    request_id: str,
    max_context_tokens: int,
    tools: ToolPlan | None = None,
) -> list[Submit]:
    """The ``Submit``s of a request: one (``to_submit``), or for a
    ``/v1/completions`` prompt list one per prompt, with ids
    ``f"{request_id}-p{i}"``; choice ``j`` of prompt ``i`` is the response's
    choice ``i * n + j`` (OpenAI's order). Raises ``InvalidRequest``."""
    first = to_submit(req, request_id, max_context_tokens, tools)
    if not isinstance(req, CompletionRequest) or isinstance(req.prompt, str) or len(req.prompt) == 1:
        return [first]
    return [
        msgspec.structs.replace(first, request_id=f"{request_id}-p{i}", prompt=text)
        for i, text in enumerate(req.prompt)
    ]


def prompt_chars(submit: Submit) -> tuple[int, str]:
    """Characters of the prompt text (chat: the contents of every message,
    without the template the worker adds) and the parameter holding it."""
    if submit.prompt is not None:
        return len(submit.prompt), "prompt"
    return sum(len(m.content) for m in submit.messages), "messages"
