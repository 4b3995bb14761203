"""Token and time accounting of one response, before any dialect names it.

``Counts`` is computed once per response from the worker's ``Finished`` events
(``final_counts``) or, while it runs, from ``Started`` and the deltas
(``running_counts``). Each dialect maps it to its own usage object (OpenAI's
``usage``, the Responses API's ``usage``, Anthropic's ``usage``), the request
log and the metrics read it as is, and llama.cpp's ``timings`` derive from it,
so every number a client, a log line and a counter show is the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.messages import Finished


@dataclass(frozen=True, slots=True)
class Counts:
    """Tokens and seconds of a response (all choices, all prompts).

    ``prompt_tokens`` is the whole prompt, ``cached_tokens`` of it came from the
    prefix cache; ``completion_tokens`` are summed over choices; ``draft_accepted``
    and ``draft_rejected`` are ``None`` when no choice drafted. Times (seconds, 0.0
    on running counts): ``prompt_time`` prefill, ``completion_time`` the longest
    decode over choices (they ran concurrently), ``total_time`` the longest
    queue + prefill + decode."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    draft_accepted: int | None = None
    draft_rejected: int | None = None
    prompt_time: float = 0.0
    completion_time: float = 0.0
    total_time: float = 0.0
    reasoning_tokens: int = 0
    """Of ``completion_tokens``, those spent thinking (``Finished.reasoning_tokens``)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def drafted(self) -> bool:
        """Some choice drafted: the draft counters are meaningful."""
        return self.draft_accepted is not None


def _seconds(x: float) -> float:
    return round(x, 6)


def final_counts(finished: Sequence[Finished], per_prompt: int = 0) -> Counts:
    """``Counts`` of a finished response from the ``Finished`` event of every
    choice, in choice order.

    Choices come in groups of ``per_prompt`` that share one prompt (0: all of
    them, the usual single prompt): prompt and cached tokens and prefill time are
    those of each group's first choice, summed over prompts. Completion tokens
    and draft counters are summed over choices; the draft counters are set when
    at least one choice drafted (non-``None`` counters)."""
    firsts = finished[:: per_prompt or len(finished)]
    drafted = [f for f in finished if f.draft_accepted is not None or f.draft_rejected is not None]
    return Counts(
        prompt_tokens=sum(f.prompt_tokens for f in firsts),
        cached_tokens=sum(f.cached_tokens for f in firsts),
        completion_tokens=sum(f.completion_tokens for f in finished),
        draft_accepted=sum(f.draft_accepted or 0 for f in drafted) if drafted else None,
        draft_rejected=sum(f.draft_rejected or 0 for f in drafted) if drafted else None,
        prompt_time=_seconds(sum(f.time_prefill for f in firsts)),
        completion_time=_seconds(max(f.time_decode for f in finished)),
        total_time=_seconds(max(f.time_queued + f.time_prefill + f.time_decode for f in finished)),
        reasoning_tokens=sum(f.reasoning_tokens for f in finished),
    )
