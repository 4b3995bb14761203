"""What every dialect's request becomes: one neutral task, converted once into ``Submit``s.

A dialect (``proxy.dialects``) decodes and validates its own request body and
builds a ``ChatTask`` (a conversation: turns, tools, a JSON output format,
sampling) or a ``TextTask`` (raw prompts); this module turns either into the
worker's ``protocol.Submit`` messages: the tools plan (``ToolPlan``: native
template or the generic tools prompt, grammar of a forced call), the grammar of
a JSON output, the sampling defaults. The same conversation therefore reaches
the worker the same way whichever wire dialect carried it (llama.cpp converts
its Responses and Messages requests into its one chat task the same way).

Errors are ``proxy.errors.InvalidRequest`` naming the field by its wire (chat
completions') name; the core renames it into the dialect's terms
(``proxy.core.dialect.FieldNames``).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from protocol.messages import ChatMessage, PromptPiece, SamplingParams, Submit
from proxy.errors import InvalidRequest
from proxy.grammar.check import json_schema_grammar
from proxy.tools import (
    FormatChoice,
    HistoryMessage,
    ToolCallFormat,
    ToolConfig,
    ToolSpecError,
    check_history,
    render_fallback,
    tool_call_grammar,
    tools_or_answer_grammar,
)
from proxy.tools.grammar import json_rule_schema, named_call_grammar, named_call_prefix

GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily: dividing logits by them overflows."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """Sampling and limits as the client asked, ``None`` where it said nothing.
    ``max_tokens`` ``None``: up to the end of the context. ``top_k`` 0 or -1:
    off. ``logprobs``: alternatives per token, ``None`` for no logprobs."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    temperature_last: bool = False
    penalty_range: int = -1
    repetition_decay: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    banned_tokens: tuple[int, ...] = ()
    ban_eos_token: bool = False
    skip_special_tokens: bool | None = None
    banned_strings: tuple[str, ...] = ()
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_range: int = 0
    dry_sequence_breakers: tuple[str, ...] | None = None
    add_bos_token: bool | None = None
    """``None``: the model's own choice; with messages the worker refuses any other."""
    reasoning_budget: int | None = None
    """Most tokens the model may think (``SamplingParams.reasoning_budget``); 0: none."""


@dataclass(frozen=True, slots=True)
class JsonOutput:
    """The answer must be JSON valid against ``schema`` (``{"type": "object"}``
    for any object), strict JSON when ``strict`` (no properties beyond the
    schema's, bounded numbers, compact whitespace:
    ``proxy.tools.grammar.json_rule_schema``); ``param`` names the field holding
    the schema (in errors about it, before and while decoding)."""

    schema: dict[str, object] | bool
    param: str
    strict: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatTask:
    """A conversation to continue: ``messages`` with their content as text
    (``HistoryMessage``: roles ``system``, ``developer``, ``user``,
    ``assistant``, ``tool``), the resolved ``tools`` (``None``: none),
    ``json_output`` and ``sampling``, ``n`` choices; ``cache_salt`` (vLLM's):
    prefix-cache entries are shared only within one salt."""

    messages: tuple[HistoryMessage, ...]
    sampling: Sampling
    tools: ToolConfig | None = None
    json_output: JsonOutput | None = None
    n: int = 1
    add_generation_prompt: bool = True
    parallel_asked: bool = False
    """The client said explicitly whether calls may be parallel."""
    cache_salt: str | None = None
    template_kwargs: dict[str, object] | None = None
    """Extra chat-template variables (``chat_template_kwargs``, ``reasoning_effort``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TextTask:
    """Raw prompts to continue (the caller's own template): ``n`` choices each."""

    prompts: tuple[str, ...]
    sampling: Sampling
    json_output: JsonOutput | None = None
    n: int = 1
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools are served: ``config`` (functions, choice,
    parallel calls), the call ``format`` the output is parsed in, and whether
    the model's chat template renders the tools itself (``native``: they go to
    the worker as ``Submit.tools_json`` with structured tool turns) or the
    generic tools prompt does (``proxy.tools.render_fallback``). ``prefix``:
    for a named function, the call's opening the server writes after the
    template (``proxy.tools.grammar.named_call_prefix``; the model generates
    only the arguments), else empty."""

    config: ToolConfig
    format: ToolCallFormat
    native: bool = False
    prefix: tuple[PromptPiece, ...] = ()

    @property
    def primer(self) -> str:
        """``prefix`` as the text the output parser reads first."""
        return "".join(p.text for p in self.prefix)

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


def tool_plan(task: ChatTask, choice: FormatChoice) -> ToolPlan | None:
    """The task's ``ToolPlan`` (``None`` without tools), the format from
    ``choice`` (``proxy.tools.choose_format``). Raises ``InvalidRequest``
    for logprobs asked together with tool calls (not honoured on an answer
    that may be a call), for stop strings with a
    forced call, and for a forced call or tools with a JSON output in a format
    with no call grammar (``ToolCallFormat.grammar_calls``: Harmony). With
    ``auto`` tools and a JSON output the answer is a call or that JSON (one
    grammar for both), and one call unless parallel calls were asked for
    explicitly. A forced call is one call: always for a named function (as
    OpenAI's), and for ``required`` unless the client asked for parallel calls
    explicitly; otherwise a grammar that allows "another call" lets a small
    model repeat calls until ``max_tokens``. A named function's call is opened
    by the server (``ToolPlan.prefix``) when the prompt ends with the
    generation prompt (``add_generation_prompt``), as it does unless the
    client continues a turn of its own."""
    config = task.tools
    if config is None:
        return None
    if config.forced and (config.mode == "function" or not task.parallel_asked):
        config = msgspec.structs.replace(config, parallel=False)
    if config.forced and task.sampling.stop:
        # A stop string can match inside the call's markup (Hermes' "\n")
        # and cut the call short: refused rather than silently breaking it.
        raise InvalidRequest(
            "'stop' cannot be combined with a forced tool call ('tool_choice' required or a function)",
            param="stop",
        )
    if config.mode == "auto" and task.json_output is not None and not task.parallel_asked:
        # The grammar is a call or the JSON answer: one call, as for a forced one.
        config = msgspec.structs.replace(config, parallel=False)
    grammar_needed = config.forced or (config.mode == "auto" and task.json_output is not None)
    if grammar_needed and not choice.format.grammar_calls:
        # The call would have to be forced by a grammar this format has none of:
        # refused rather than served unconstrained.
        param = "tool_choice" if config.forced else "response_format"
        raise InvalidRequest(
            f"'{param}' with tools needs a grammar of the model's tool calls, which the "
            f"{choice.format.name} format has none of yet; use tool_choice 'auto' without a JSON output",
            param=param,
        )
    if config.active and task.sampling.logprobs is not None:
        raise InvalidRequest(
            "'logprobs' cannot be combined with tool calls ('tool_choice' is not 'none')",
            param="logprobs",
        )
    prefix: tuple[PromptPiece, ...] = ()
    if config.mode == "function" and task.add_generation_prompt and choice.format.grammar_rules is None:
        # A format with its own grammar forces the named call through it (the
        # only callable function) instead of a prefix the server writes.
        prefix = named_call_prefix(choice.format, config)
    return ToolPlan(config, choice.format, choice.native, prefix)


def _temperature(t: float | None) -> float:
    if t is None:
        return 1.0
    return 0.0 if t < GREEDY_BELOW_TEMPERATURE else t


def sampling_params(
    s: Sampling,
    max_context_tokens: int,
    json_output: JsonOutput | None = None,
    tools: ToolPlan | None = None,
) -> SamplingParams:
    """Wire sampling parameters. An absent completion limit becomes
    ``max_context_tokens`` (the worker stops at the end of the context);
    ``top_k == -1`` (vLLM's "disabled") becomes 0; a temperature below
    ``GREEDY_BELOW_TEMPERATURE`` becomes 0 (greedy); empty stop strings are
    dropped. The grammar: a forced call's (the JSON output does not apply;
    for a named function opened by the server, only its arguments and close),
    else with tools a call or the JSON output, else that JSON; not checked here
    (``proxy.grammar.check.validate``, awaited by the request path)."""
    grammar: str | None = None
    grammar_param: str | None = None
    # Not lenient: a keyword llguidance cannot enforce is a 400, not ignored.
    if tools is not None and tools.prefix:
        # The server wrote the call up to its arguments: the model writes the rest.
        grammar, grammar_param = named_call_grammar(tools.format, tools.config, lenient=False), "tool_choice"
    elif tools is not None and tools.config.forced:
        grammar, grammar_param = tool_call_grammar(tools.format, tools.config, lenient=False), "tool_choice"
    elif json_output is not None:
        if tools is not None and tools.config.active:
            rule = json_rule_schema(json_output.schema, strict=json_output.strict)
            grammar = tools_or_answer_grammar(
                tools.format, tools.config, rule, json_output.param, lenient=False
            )
            grammar_param = "tools"
        else:
            grammar = json_schema_grammar(json_output.schema, strict=json_output.strict)
            grammar_param = json_output.param
    return SamplingParams(
        max_tokens=s.max_tokens if s.max_tokens is not None else max_context_tokens,
        temperature=_temperature(s.temperature),
        top_p=1.0 if s.top_p is None else s.top_p,
        top_k=0 if s.top_k is None or s.top_k == -1 else s.top_k,
        min_p=0.0 if s.min_p is None else s.min_p,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
        presence_penalty=0.0 if s.presence_penalty is None else s.presence_penalty,
        frequency_penalty=0.0 if s.frequency_penalty is None else s.frequency_penalty,
        seed=s.seed,
        stop=tuple(x for x in s.stop if x),
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        logit_bias=s.logit_bias or None,
        logprobs=s.logprobs,
        grammar=grammar,
        grammar_param=grammar_param,
        temperature_last=s.temperature_last,
        penalty_range=s.penalty_range,
        repetition_decay=s.repetition_decay,
        xtc_probability=s.xtc_probability,
        xtc_threshold=s.xtc_threshold,
        banned_tokens=s.banned_tokens,
        ban_eos_token=s.ban_eos_token,
        skip_special_tokens=s.skip_special_tokens,
        banned_strings=tuple(x for x in s.banned_strings if x),
        dry_multiplier=s.dry_multiplier,
        dry_base=s.dry_base,
        dry_allowed_length=s.dry_allowed_length,
        dry_range=s.dry_range,
        dry_sequence_breakers=s.dry_sequence_breakers,
        reasoning_budget=s.reasoning_budget,
    )


def chat_messages(task: ChatTask, tools: ToolPlan | None = None) -> tuple[ChatMessage, ...]:
    """The task's turns as the worker takes them. ``developer`` becomes
    ``system``, which chat templates know. With tools, or tool turns in the
    history, the history is checked (``proxy.tools.check_history``) and then
    either kept structured for a template that renders tools
    (``ToolPlan.native``) or rendered by ``proxy.tools.render_fallback``: the
    tool schemas in the system prompt and calls and results as text, in the
    plan's format."""
    history = task.messages
    if tools is None and not any(m.tool_calls or m.role in ("tool", "function") for m in history):
        return tuple(
            ChatMessage(
                role="system" if m.role == "developer" else m.role,
                content=m.content or "",
                reasoning=m.reasoning if m.role == "assistant" else None,
                images=m.images,
            )
            for m in history
        )
    try:
        check_history(history)
    except ToolSpecError as e:
        raise InvalidRequest(e.message, param=e.param) from None
    if tools is not None and tools.native:
        return _native_messages(history, as_text=tools.format.history_arguments == "text")
    config = tools.config if tools is not None else None
    fmt = tools.format if tools is not None else None
    turns = render_fallback(config, history) if fmt is None else render_fallback(config, history, fmt)
    return tuple(ChatMessage(t.role, t.content, images=t.images) for t in turns)


def _native_messages(history: tuple[HistoryMessage, ...], as_text: bool = False) -> tuple[ChatMessage, ...]:
    """Turns with their tool fields for a template that renders tools: the
    calls' ``arguments`` decoded to objects (templates index into them), or,
    ``as_text``, checked and kept as JSON text (DeepSeek's templates concatenate
    them, ``ToolCallFormat.history_arguments``)."""
    out: list[ChatMessage] = []
    for i, m in enumerate(history):
        calls_json = None
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = msgspec.json.decode(c.function.arguments)
                except msgspec.DecodeError:
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise InvalidRequest(f"'{param}' is not valid JSON", param=param) from None
                if as_text:
                    args = c.function.arguments
                calls.append(
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                )
            calls_json = msgspec.json.encode(calls).decode()
        role = "system" if m.role == "developer" else m.role
        reasoning = m.reasoning if m.role == "assistant" else None
        content = m.content or ""
        out.append(ChatMessage(role, content, calls_json, m.tool_call_id, m.name, reasoning, m.images))
    return tuple(out)


def chat_submit(task: ChatTask, request_id: str, max_context_tokens: int, tools: ToolPlan | None) -> Submit:
    """The one ``Submit`` of a conversation, ``n`` choices included: the worker
    runs them as the engine requests ``protocol.choice_ids(request_id, n)``.
    ``tools`` (``tool_plan``) renders the tools into the messages and, for a
    forced call, constrains the output to one. Raises ``InvalidRequest``."""
    params = sampling_params(task.sampling, max_context_tokens, task.json_output, tools)
    return Submit(
        request_id,
        params,
        tools_json=tools.tools_json() if tools is not None and tools.native and tools.config.active else None,
        messages=chat_messages(task, tools),
        add_generation_prompt=task.add_generation_prompt,
        n=task.n,
        cache_salt=task.cache_salt,
        forced_prefix=tools.prefix if tools is not None else (),
        add_bos=task.sampling.add_bos_token,
        template_kwargs_json=msgspec.json.encode(task.template_kwargs).decode()
        if task.template_kwargs
        else None,
    )


def text_submits(task: TextTask, request_id: str, max_context_tokens: int) -> list[Submit]:
    """One ``Submit`` per prompt (ids ``f"{request_id}-p{i}"`` when there are
    several); choice ``j`` of prompt ``i`` is the response's choice ``i * n + j``
    (OpenAI's order). Raises ``InvalidRequest``."""
    params = sampling_params(task.sampling, max_context_tokens, task.json_output)
    salt, bos = task.cache_salt, task.sampling.add_bos_token
    if len(task.prompts) == 1:
        return [Submit(request_id, params, prompt=task.prompts[0], n=task.n, cache_salt=salt, add_bos=bos)]
    return [
        Submit(f"{request_id}-p{i}", params, prompt=p, n=task.n, cache_salt=salt, add_bos=bos)
        for i, p in enumerate(task.prompts)
    ]


def prompt_chars(submit: Submit) -> tuple[int, str]:
    """Characters of the prompt text (chat: the contents of every message, its
    tool calls and the tools, all of which the template writes into the prompt,
    without the template's own text) and the parameter holding it."""
    if submit.prompt is not None:
        return len(submit.prompt), "prompt"
    prefix = sum(len(p.text) for p in submit.forced_prefix)
    chars = sum(len(m.content) + len(m.tool_calls_json or "") for m in submit.messages)
    return chars + len(submit.tools_json or "") + prefix, "messages"
