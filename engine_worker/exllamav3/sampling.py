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

Semantics that differ from OpenAI's, documented rather than hidden:

- presence/frequency/repetition penalties look at the whole context (prompt
  included), as ExLlamaV3's ``SS_PresFreqP``/``SS_RepP`` do over their sustain range;
  OpenAI counts only generated tokens.
- ``min_tokens`` maps to ``min_new_tokens``: stop *tokens* (EOS, ``stop_token_ids``)
  are masked until then, but a stop *string* can still end the completion earlier
  (``generator/job.py:461-462``).
- stop strings are matched by 1.6.5 itself, not by ``engine_worker.stops``: ``Job``
  packs them once into one UTF-32 buffer (``_strings_to_utf32``, ``generator/job.py:28-50``,
  ``252-253``) and after every token scans its held text against all of them in C++
  (``ext.partial_strings_match``, ``generator/job.py:1162-1166``), a cost that grows with
  the number and length of the stops. The worker bounds both (``MAX_STOP_STRINGS`` 64,
  ``MAX_STOP_CHARS`` 256, ``engine_worker.admission``), which bounds that scan; matching
  outside ``Job`` would mean holding back text (and its logprobs) here as well.
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

from dataclasses import dataclass
from typing import Any

from protocol.messages import SamplingParams

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


def job_settings(
    params: SamplingParams,
    *,
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...],
    stop_strings: tuple[str, ...] = (),
) -> JobSettings:
    """Translate ``params`` (already validated).

    ``max_new_tokens`` is the completion budget after clamping to the context
    (``Prepared.max_new_tokens``, >= 1). Stop conditions are the stop strings,
    ``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS ids and
    ``stop_strings`` (the chat template's turn end).
    """
    p = params
    logit_bias = {int(token_id): float(bias) for token_id, bias in (p.logit_bias or {}).items()}

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
    }
    job_kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": min(p.min_tokens, max_new_tokens),
        "seed": p.seed,
        "stop_conditions": stop_conditions,
        "decode_special_tokens": True,
    }
    if p.logprobs is not None:
        job_kwargs["return_probs"] = True
        job_kwargs["return_top_tokens"] = p.logprobs
    return JobSettings(sampler_kwargs, job_kwargs)
