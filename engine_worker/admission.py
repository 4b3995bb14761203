"""Checks every backend makes before admitting a request.

The proxy already validates OpenAI requests; these checks hold the wire
contract for any client of the worker socket and for limits only the worker
knows (vocabulary size, context length). Engine-specific limits stay with the
engine (e.g. ExLlamaV3's float32 logit-bias range).
"""

from __future__ import annotations

import math

from engine_worker.backend import RequestRejected
from protocol.messages import ErrorCode, SamplingParams


def _reject(param: str, message: str) -> RequestRejected:
    return RequestRejected(ErrorCode.INVALID_REQUEST, message, param=param)


def validate_sampling(p: SamplingParams, vocab_size: int) -> None:
    """Raises ``RequestRejected`` (``INVALID_REQUEST``, ``param`` = the field)
    for a value no engine can honour: non-positive ``max_tokens``, a negative or
    non-finite temperature, ``top_p`` outside (0, 1], a negative ``top_k``,
    ``min_p`` outside [0, 1], a non-positive repetition penalty, non-finite
    presence/frequency penalties outside [-2, 2], ``min_tokens`` outside [0, max_tokens], or a
    token id (``stop_token_ids``, ``logit_bias`` keys) outside the vocabulary."""
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
    for param, ids in (("stop_token_ids", p.stop_token_ids), ("logit_bias", (p.logit_bias or {}).keys())):
        for token_id in ids:
            if not 0 <= token_id < vocab_size:
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


def full_reservation(prompt_tokens: int, max_tokens: int, max_context: int) -> int:
    """KV tokens a sequence can come to hold when its cache grows with every
    token: its prompt plus every completion token it may produce within the
    context."""
    return prompt_tokens + min(max_tokens, max_context - prompt_tokens)
