"""``SamplingParams`` -> ExLlamaV3 sampler and job arguments.

Every keyword produced here exists in the exllamav3 1.6.5 signatures
(``ComboSampler.__init__`` has no ``**kwargs`` and would raise ``TypeError`` on
a typo, ``generator/sampler/presets.py:86-106``; ``Job.__init__`` and
``Generator.__init__`` silently accept unknown names, so a typo there would
simply do nothing):

- ``ComboSampler(rep_p, freq_p, pres_p, temperature, min_p, top_k, top_p, logit_bias)``
  (``generator/sampler/presets.py``, class ``ComboSampler``). Its stack is
  logit bias -> repetition penalty -> presence/frequency penalty -> temperature ->
  min-p -> top-k -> top-p -> sample; ``temperature == 0`` or ``top_k == 1`` is argmax.
- ``Job(max_new_tokens, min_new_tokens, seed, stop_conditions, ...)``
  (``generator/job.py:54-75``).
- The local-LLM fields: ``penalty_range``/``repetition_decay`` are
  ``ComboSampler``'s ``rep_sustain_range``/``rep_decay_range`` (``presets.py:91-92``;
  -1, the whole context, is its default ``int(10e7)``), which ``SS_RepP`` and
  ``SS_PresFreqP`` both take (``presets.py:112-113``) and the kernels weigh by
  distance (``exllamav3_ext/generator/rep_pen.cu:49-69``); ``temperature_last`` is
  ``temp_last`` (``presets.py:102``, the stack of ``122-128``); ``banned_tokens``
  and ``ban_eos_token`` are logit biases of ``-inf``, which ``LogitBias`` keeps as
  a hard ban (``custom.py:595-624``); ``skip_special_tokens`` is
  ``decode_special_tokens=False``; ``banned_strings`` is ``Job``'s own (``generator/job.py:70``,
  lowercased by ``_init_banned_strings``, ``615-623``): text that may start one is held, a
  complete one rewinds the job to the token where it began and bans that token there
  (``set_checkpoint``/``rewind_checkpoint``, ``1023-1128``).
- DRY is ``ComboSampler``'s ``dry_*`` arguments (``presets.py:93-97``, ``SS_DRY`` at
  ``114``); ``dry_sequence_breakers`` are strings on the wire and token ids there
  (``breaker_ids``); ``None`` leaves ExLlamaV3 its default set, derived from the
  tokenizer when sampling.
- XTC (``xtc_probability``) has no ``ComboSampler`` argument: ``xtc_sampler`` builds
  ``ComboSampler``'s own stack as a ``CustomSampler`` with ``SS_XTC`` before the final
  ``SS_Sample`` (where TabbyAPI puts it), its protected tokens the tokenizer's default
  (newline pieces and special tokens, ``xtc_default_protected_token_ids``). At
  temperature 0 (or ``top_k == 1``) the stack is an argmax, on which XTC has no effect
  (``presets.py:117-120``), so it is left out.

Semantics that differ from OpenAI's, documented rather than hidden:

- presence/frequency/repetition penalties look at the whole context (prompt
  included), as ExLlamaV3's ``SS_PresFreqP``/``SS_RepP`` do over their sustain range;
  OpenAI counts only generated tokens.
- ``min_tokens`` maps to ``min_new_tokens``: stop *tokens* (EOS, ``stop_token_ids``)
  are masked until then, but a stop *string* can still end the completion earlier
  (``generator/job.py:461-462``).
- stop strings are matched by 1.6.5 itself, not by ``engine_worker.requests.stops``: ``Job``
  packs them once into one UTF-32 buffer (``_strings_to_utf32``, ``generator/job.py:28-50``,
  ``252-253``) and after every token scans its held text against all of them in C++
  (``ext.partial_strings_match``, ``generator/job.py:1162-1166``), a cost that grows with
  the number and length of the stops. The worker bounds both (``MAX_STOP_STRINGS`` 64,
  ``MAX_STOP_CHARS`` 256, ``engine_worker.admission``), which bounds that scan. The one
  exception: while a reasoning model may think, the backend passes ``params`` without
  ``stop`` here and matches the client's stops in the answer only
  (``grammar.answer_filter_factory``, ``results.AnswerText``).
- ``seed`` seeds the job's own RNG; ExLlamaV3 does not promise bitwise determinism.
- special tokens the model emits that are not stop conditions (``<think>``, tool-call
  markers) are streamed as their text: ``decode_special_tokens=True``, as TabbyAPI does.
  With ``False`` a special token's text is whatever the tokenizer's plain decode gives
  it, empty for some tokenizers and literal for others (``tokenizer/tokenizer.py:704-725``
  against ``727-736``).
- ``ignore_eos`` also drops the chat template's turn-end stop conditions.
- ``logprobs`` (``k``) sets ``Job(return_probs=True, return_top_tokens=k)``
  (``generator/job.py:64-66``); what 1.6.5 returns is described in
  ``engine_worker.exllamav3.logprobs``.

Parameters are validated before they get here, by the worker loop
(``engine_worker.admission.validate_request``) with this engine's limits from its
``ModelInfo``: ``logit_bias`` within float32 (``FLOAT32_MAX``) or ``-inf``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.messages import SamplingParams

FULL_RANGE = int(10e7)
"""``ComboSampler``'s default ``rep_sustain_range`` (``presets.py:91``): the whole context."""

FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: ExLlamaV3's bias vector is float32 (``generator/sampler/custom.py:604-611``).
``LogitBias`` silently drops nan and anything above it, ``+inf`` included, and a
finite bias below ``-FLOAT32_MAX`` would become ``-inf``, a ban nobody asked for;
``-inf`` itself is a deliberate ban (``ModelInfo.logit_bias_ban``)."""


@dataclass(frozen=True, slots=True)
class JobSettings:
    """Keyword arguments for ``ComboSampler`` and for ``Job`` (besides ``input_ids``,
    ``sampler`` and ``identifier``, which the backend adds)."""

    sampler_kwargs: dict[str, Any]
    job_kwargs: dict[str, Any]
    xtc: tuple[float, float] | None = None
    """``(probability, threshold)`` when the sampler must be ``xtc_sampler``'s stack."""


def job_settings(
    params: SamplingParams,
    *,
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    stop_strings: tuple[str, ...] = (),
    dry_breakers: frozenset[int] | None = None,
) -> JobSettings:
    """Translate ``params`` (already validated).

    ``dry_breakers``: the token ids of ``params.dry_sequence_breakers``
    (``breaker_ids``), ``None`` for ExLlamaV3's default set.
    ``max_new_tokens`` is the completion budget after clamping to the context
    (``Prepared.max_new_tokens``, >= 1). Stop conditions are the stop strings,
    ``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS ids and
    ``stop_strings`` (the chat template's turn end).
    """
    p = params
    logit_bias = {int(token_id): float(bias) for token_id, bias in (p.logit_bias or {}).items()}
    banned = set(p.banned_tokens) | (set(eos_token_ids) if p.ban_eos_token else set())
    for token_id in banned:
        logit_bias[token_id] = -math.inf

    stop_conditions: list[int | str] = [s for s in p.stop if s]
    if not p.ignore_eos:
        stop_conditions += [s for s in stop_strings if s and s not in stop_conditions]
    stop_ids: list[int] = [] if p.ignore_eos else list(eos_token_ids)
    stop_ids += [t for t in p.stop_token_ids if t not in stop_ids]
    stop_conditions += stop_ids

    sampler_kwargs: dict[str, Any] = {
        "rep_p": p.repetition_penalty,
        "freq_p": p.frequency_penalty,
        "pres_p": p.presence_penalty,
        "temperature": p.temperature,
        "min_p": p.min_p,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "logit_bias": logit_bias or None,
        "rep_sustain_range": FULL_RANGE if p.penalty_range < 0 else p.penalty_range,
        "rep_decay_range": p.repetition_decay,
        "temp_last": p.temperature_last,
        "dry_multiplier": p.dry_multiplier,
        "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length,
        "dry_range": max(p.dry_range, 0),
        "dry_sequence_breakers": dry_breakers,
    }
    job_kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": min(p.min_tokens, max_new_tokens),
        "seed": p.seed,
        "stop_conditions": stop_conditions,
        "decode_special_tokens": p.skip_special_tokens is not True,
    }
    if p.banned_strings:
        job_kwargs["banned_strings"] = list(p.banned_strings)
    if p.logprobs is not None:
        job_kwargs["return_probs"] = True
        job_kwargs["return_top_tokens"] = p.logprobs
    argmax = p.temperature == 0.0 or p.top_k == 1
    # SS_XTC.alt: no-op at probability 0 or a threshold above 0.5 (custom.py:745-750).
    xtc = (
        None
        if argmax or p.xtc_probability == 0.0 or p.xtc_threshold > 0.5
        else (p.xtc_probability, p.xtc_threshold)
    )
    return JobSettings(sampler_kwargs, job_kwargs, xtc)


def breaker_ids(pieces: Sequence[str], strings: tuple[str, ...]) -> frozenset[int]:
    """Every token whose piece contains one of ``strings``: ExLlamaV3's
    ``dry_sequence_breaker_tokens`` (``generator/sampler/custom.py:878-892``) over
    ``EngineHandle.pieces``."""
    wanted = tuple(s for s in strings if s)
    return frozenset(t for t, piece in enumerate(pieces) if any(s in piece for s in wanted))


def xtc_sampler(ex: Any, tokenizer: Any, xtc_probability: float, xtc_threshold: float, **combo: Any) -> Any:
    """``ComboSampler(**combo)``'s stack (``generator/sampler/presets.py:110-137``, the
    non-argmax branch, no DRY or Adaptive-P) as a ``CustomSampler`` with
    ``SS_XTC(xtc_probability, xtc_threshold, tokenizer=tokenizer)`` before the final
    ``SS_Sample``. ``ex`` is the ``exllamav3`` module (its ``generator.sampler``
    classes are exported at the top, ``exllamav3/__init__.py:70``); ``combo`` the
    ``JobSettings.sampler_kwargs``."""
    t, last = combo["temperature"], combo["temp_last"]
    sustain, decay = combo["rep_sustain_range"], combo["rep_decay_range"]
    stack = [
        ex.SS_LogitBias(combo["logit_bias"] or {}),
        ex.SS_RepP(combo["rep_p"], sustain, decay),
        ex.SS_PresFreqP(combo["pres_p"], combo["freq_p"], sustain, decay),
        ex.SS_DRY(
            combo["dry_multiplier"],
            combo["dry_base"],
            combo["dry_allowed_length"],
            combo["dry_range"],
            combo["dry_sequence_breakers"],
        ),
        ex.SS_Temperature(1.0 if last else t),
        ex.SS_MinP(combo["min_p"]),
        ex.SS_TopK(combo["top_k"]),
        ex.SS_TopP(combo["top_p"]),
        ex.SS_Temperature(t if last else 1.0),
        ex.SS_XTC(xtc_probability, xtc_threshold, tokenizer=tokenizer),
        ex.SS_Sample(),
    ]
    return ex.CustomSampler(stack)
