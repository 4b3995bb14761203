"""The checks of every request, made once by the worker loop for every backend.

The proxy already validates OpenAI requests; these checks hold the wire
contract for any client of the worker socket and for limits only the worker
knows (vocabulary size, context length). Engine-specific limits come from the
backend's ``ModelInfo`` (e.g. ExLlamaV3's float32 logit-bias range), so no
backend repeats a check: ``validate_request`` when a ``Submit`` arrives, before
it is prepared or queued; ``budget`` once it is tokenized, before it is queued.
``checked_prepare`` does both in a row, for callers without a loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from engine_worker.backend import ModelInfo, Prepared, RequestRejected
from engine_worker.requests.turns import thinking_budget
from protocol.messages import MAX_STOP_CHARS, MAX_STOP_STRINGS, ErrorCode, SamplingParams, Submit

if TYPE_CHECKING:
    from engine_worker.backend import Backend

MAX_LOGPROBS = 20
"""Most alternatives per token (``SamplingParams.logprobs``), OpenAI's ``top_logprobs`` limit."""

MAX_BANNED_TOKENS = 4096
"""Most ``banned_tokens`` of one request (the proxy's limit too)."""


def _reject(param: str, message: str) -> RequestRejected:
    return RequestRejected(ErrorCode.INVALID_REQUEST, message, param=param)


def validate_request(submit: Submit, info: ModelInfo) -> None:
    """Raises ``RequestRejected`` (``INVALID_REQUEST``, ``param`` = the field) for
    what ``info``'s backend cannot honour: a feature it lacks (``check_capabilities``),
    ``n`` outside ``[1, max_batch_size]``, ``check_prompt_size``, ``validate_sampling``, a
    ``logit_bias`` value beyond ``±info.max_logit_bias`` (``-inf`` only where
    ``info.logit_bias_ban``), ``logprobs`` outside ``[0, MAX_LOGPROBS]``, ``add_bos`` with ``messages`` (named
    ``add_bos_token``, the request field)."""
    check_capabilities(submit, info)
    if not 1 <= submit.n <= info.max_batch_size:
        message = (
            f"n={submit.n} choices can never run together: this worker runs at most "
            f"{info.max_batch_size} sequences at once (max_batch_size)"
            if submit.n > 1
            else f"n must be >= 1, got {submit.n}"
        )
        raise _reject("n", message)
    check_prompt_size(submit, info)
    p = submit.params
    validate_sampling(p, info.vocab_size)
    if submit.add_bos is not None and submit.prompt is None:
        raise _reject(
            "add_bos_token",
            "add_bos_token applies to a raw prompt; with messages the chat template places BOS",
        )
    for token_id, bias in (p.logit_bias or {}).items():
        ban = bias == -math.inf and info.logit_bias_ban
        if not (ban or -info.max_logit_bias <= bias <= info.max_logit_bias):
            allowed = f"[-{info.max_logit_bias:.4g}, {info.max_logit_bias:.4g}]"
            if info.logit_bias_ban:
                allowed += " or -inf"
            raise _reject("logit_bias", f"logit_bias: bias {bias} for token {token_id} is outside {allowed}")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        raise _reject("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")


def check_images(submit: Submit, info: ModelInfo) -> None:
    """Raises ``RequestRejected`` naming the first image part when the model reads text
    only (``ModelInfo.vision`` off); generation and ``/tokenize`` both check here."""
    image = next((im for m in submit.messages for im in m.images), None)
    if image is not None and not info.vision:
        raise _reject(
            image.param,
            f"'{image.param}' is an image; the model {info.model_id!r} on this engine reads text only",
        )


def check_capabilities(submit: Submit, info: ModelInfo) -> None:
    """Raises ``RequestRejected`` (``INVALID_REQUEST``) naming the field of a feature
    the backend declares it lacks in ``info`` (``ModelInfo.template_tools``,
    ``grammar``, ``logprobs``, ``cache_salt``, ``banned_strings``, ``vision``: an image
    named by its part): a backend never refuses for a missing capability on its own."""
    params = submit.params
    check_images(submit, info)
    if submit.tools_json is not None and not info.template_tools:
        raise _reject("tools", "this engine cannot pass 'tools' to its chat template")
    if params.grammar is not None and not info.grammar:
        param = params.grammar_param or "response_format"
        raise _reject(param, f"'{param}' (constrained decoding) is not supported by this engine")
    if params.logprobs is not None and not info.logprobs:
        raise _reject("logprobs", "'logprobs' are not supported by this engine")
    if submit.cache_salt is not None and not info.cache_salt:
        raise _reject(
            "cache_salt", "'cache_salt' (a prefix cache of its own) is not supported by this engine"
        )
    if params.banned_strings and not info.banned_strings:
        raise _reject("banned_strings", "banned_strings are not supported by this engine yet")
    if (
        params.banned_strings
        and info.banned_strings_alone
        and (params.grammar is not None or params.logprobs is not None)
    ):
        raise _reject(
            "banned_strings",
            "banned_strings cannot be combined with structured output or logprobs on this engine",
        )
    if params.xtc_probability > 0.0 and not info.xtc:
        raise _reject("xtc_probability", "XTC is not available on this engine")
    check_thinking(params, info)


def check_thinking(params: SamplingParams, info: ModelInfo) -> None:
    """Raises ``RequestRejected`` for what ``info``'s backend cannot do while a model
    may think (it has a reasoning parser and the request's budget is not 0): a
    grammar or logprobs it would apply to the thinking too, a budget above 0 it
    cannot end the thinking at. With a budget of 0 only the answer is generated."""
    if info.reasoning_parser is None:
        return
    budget = thinking_budget(params, info.reasoning_budget)
    if budget == 0:
        return
    off = "switch thinking off (reasoning_effort 'none', thinking_budget_tokens 0)"
    if params.grammar is not None and not info.grammar_while_thinking:
        message = f"constrained output with a model that thinks is not available on this engine yet; {off}"
        raise _reject(params.grammar_param or "response_format", message)
    if params.logprobs is not None and not info.logprobs_while_thinking:
        raise _reject(
            "logprobs", f"logprobs with a model that thinks are not available on this engine yet; {off}"
        )
    if budget is not None and not info.thinking_budget:
        raise _reject(
            "thinking_budget_tokens", "a thinking budget other than 0 is not available on this engine"
        )


def check_prompt_size(submit: Submit, info: ModelInfo) -> None:
    """Raises ``RequestRejected`` (``CONTEXT_LENGTH_EXCEEDED``) for a prompt that
    cannot fit the context whatever it tokenizes to, before any tokenizing: more
    turns than context tokens (a template writes at least one token per turn),
    or more characters than ``max_context_tokens * longest_token_chars`` (tools
    and tool calls counted). The proxy refuses these first; this holds the
    bound for any client of the socket, lookups (``Tokenize``) included."""
    context = info.max_context_tokens
    if len(submit.messages) > context:
        raise RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"{len(submit.messages)} messages cannot fit a context of {context} tokens",
            param="messages",
        )
    if info.longest_token_chars <= 0:
        return
    if submit.prompt is not None:
        chars, param = len(submit.prompt), "prompt"
    else:
        chars = sum(len(m.content) + len(m.tool_calls_json or "") for m in submit.messages)
        chars += len(submit.tools_json or "") + sum(len(p.text) for p in submit.forced_prefix)
        param = "messages"
    most = context * info.longest_token_chars
    if chars > most:
        raise RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"The prompt has {chars} characters; no text over {most} characters fits a context of "
            f"{context} tokens",
            param=param,
        )


def budget(prepared: Prepared, info: ModelInfo) -> Prepared:
    """``prepared`` with its completion budget (``Prepared.max_new_tokens``):
    ``max_tokens`` clamped to the room the context leaves after the prompt.
    Raises ``RequestRejected`` from ``check_prompt_fits``."""
    max_context = info.max_context_tokens
    check_prompt_fits(prepared.prompt_tokens, max_context, prepared.param, info.context_settings)
    max_new = min(prepared.submit.params.max_tokens, max_context - prepared.prompt_tokens)
    return dataclasses.replace(prepared, max_new_tokens=max_new)


def checked_prepare(backend: Backend, submit: Submit) -> Prepared:
    """``validate_request``, ``backend.prepare`` and ``budget`` in a row: what the
    loop does for a request before queueing it. Raises ``RequestRejected``."""
    validate_request(submit, backend.info)
    return budget(backend.prepare(submit), backend.info)


def validate_sampling(p: SamplingParams, vocab_size: int) -> None:
    """Raises ``RequestRejected`` (``INVALID_REQUEST``, ``param`` = the field)
    for a value no engine can honour: non-positive ``max_tokens``, a negative or
    non-finite temperature, ``top_p`` outside (0, 1], a negative ``top_k``,
    ``min_p`` outside [0, 1], a non-positive repetition penalty, non-finite
    presence/frequency penalties outside [-2, 2], ``min_tokens`` outside [0, max_tokens],
    more than ``MAX_STOP_STRINGS`` stop strings or one longer than ``MAX_STOP_CHARS`` (the
    stop automaton each sequence carries is bounded by them), ``penalty_range`` below -1,
    a negative ``repetition_decay``, XTC's probability or threshold outside [0, 1], more
    than ``MAX_BANNED_TOKENS`` banned tokens, or a token id (``stop_token_ids``,
    ``logit_bias`` keys, ``banned_tokens``) outside the vocabulary (``0 .. vocab_size - 1``;
    not checked when ``vocab_size`` is 0)."""
    if p.max_tokens < 1:
        raise _reject("max_tokens", f"max_tokens must be >= 1, got {p.max_tokens}")
    if not (p.temperature >= 0.0 and math.isfinite(p.temperature)):
        raise _reject("temperature", f"temperature must be a finite number >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise _reject("top_p", f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise _reject("top_k", f"top_k must be >= 0 (0 disables it), got {p.top_k}")
    if not 0.0 <= p.min_p <= 1.0:
        raise _reject("min_p", f"min_p must be in [0, 1], got {p.min_p}")
    if not (p.repetition_penalty > 0.0 and math.isfinite(p.repetition_penalty)):
        raise _reject("repetition_penalty", f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    for name, value in (("presence_penalty", p.presence_penalty), ("frequency_penalty", p.frequency_penalty)):
        if not -2.0 <= value <= 2.0:  # OpenAI's range
            raise _reject(name, f"{name} must be in [-2, 2], got {value}")
    if not 0 <= p.min_tokens <= p.max_tokens:
        raise _reject("min_tokens", f"min_tokens must be in [0, max_tokens], got {p.min_tokens}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise _reject("stop", f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(p.stop)}")
    for i, stop in enumerate(p.stop):
        if len(stop) > MAX_STOP_CHARS:
            raise _reject(
                "stop",
                f"stop: stop strings are at most {MAX_STOP_CHARS} characters, stop[{i}] has {len(stop)}",
            )
    if len(p.stop_token_ids) > MAX_STOP_STRINGS:
        raise _reject(
            "stop_token_ids", f"stop_token_ids: at most {MAX_STOP_STRINGS} ids, got {len(p.stop_token_ids)}"
        )
    if p.penalty_range < -1:
        raise _reject(
            "penalty_range", f"penalty_range must be >= -1 (-1: the whole context), got {p.penalty_range}"
        )
    if p.repetition_decay < 0:
        raise _reject("repetition_decay", f"repetition_decay must be >= 0, got {p.repetition_decay}")
    for name, value in (("xtc_probability", p.xtc_probability), ("xtc_threshold", p.xtc_threshold)):
        if not 0.0 <= value <= 1.0:  # ExLlamaV3's SS_XTC asserts both
            raise _reject(name, f"{name} must be in [0, 1], got {value}")
    if not (p.dry_multiplier >= 0.0 and math.isfinite(p.dry_multiplier)):  # SS_DRY asserts >= 0
        raise _reject(
            "dry_multiplier", f"dry_multiplier must be a finite number >= 0, got {p.dry_multiplier}"
        )
    if not math.isfinite(p.dry_base):
        raise _reject("dry_base", f"dry_base must be finite, got {p.dry_base}")
    if p.dry_allowed_length < 0:
        raise _reject("dry_allowed_length", f"dry_allowed_length must be >= 0, got {p.dry_allowed_length}")
    if p.dry_sequence_breakers is not None and len(p.dry_sequence_breakers) > MAX_BANNED_TOKENS:
        raise _reject("dry_sequence_breakers", "too many dry_sequence_breakers")
    if len(p.banned_tokens) > MAX_BANNED_TOKENS:
        raise _reject("banned_tokens", f"banned_tokens takes at most {MAX_BANNED_TOKENS} ids")
    for param, ids in (
        ("stop_token_ids", p.stop_token_ids),
        ("logit_bias", (p.logit_bias or {}).keys()),
        ("banned_tokens", p.banned_tokens),
    ):
        for token_id in ids:
            if vocab_size and not 0 <= token_id < vocab_size:
                raise _reject(
                    param, f"{param}: token id {token_id} is outside the vocabulary (0..{vocab_size - 1})"
                )


def check_prompt_fits(prompt_tokens: int, max_context: int, param: str, setting: str) -> None:
    """Raises ``RequestRejected`` (``INVALID_REQUEST`` for an empty prompt,
    ``CONTEXT_LENGTH_EXCEEDED`` when it leaves no room for one completion token
    within ``max_context`` tokens). ``setting`` names what controls the limit."""
    if prompt_tokens == 0:
        raise _reject(param, "the prompt is empty")
    if prompt_tokens >= max_context:
        raise RequestRejected(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_context} tokens for prompt and completion "
            f"together ({setting}), but the prompt has {prompt_tokens} tokens, leaving no room for a "
            "completion.",
            param=param,
        )


def full_reservation(prepared: Prepared) -> int:
    """KV tokens a sequence can come to hold when its cache grows with every
    token: its prompt plus its completion budget."""
    return prepared.prompt_tokens + prepared.max_new_tokens
