"""The numbers ``exl3-sidecar chat`` shows, and the plain lines that carry them.

Units: tokens, seconds, tokens per second. Lines are meant for people and for
``grep``; both views (plain and terminal) use the same words.
"""

from __future__ import annotations

import dataclasses

from launcher.chat.wire import PromptProgress, QueueProgress


@dataclasses.dataclass(frozen=True)
class Prefill:
    """Where prefill stands, from one ``prompt_progress``.

    ``rate_tok_s`` counts only the timed part, the tokens computed rather than
    taken from the prefix cache: ``(processed - cache) / time``; ``None`` until
    some time has passed and a token was computed. ``eta_s`` is the rest of the
    prompt at that rate; ``None`` without a rate or once done.
    """

    total: int
    cache: int
    processed: int
    time_s: float
    rate_tok_s: float | None
    eta_s: float | None

    @property
    def done(self) -> bool:
        return self.processed >= self.total

    @classmethod
    def of(cls, p: PromptProgress) -> Prefill:
        time_s = p.time_ms / 1000
        computed = p.processed - p.cache
        rate = computed / time_s if time_s > 0 and computed > 0 else None
        done = p.processed >= p.total
        eta = (p.total - p.processed) / rate if rate is not None and not done else None
        return cls(p.total, p.cache, p.processed, time_s, rate, eta)


@dataclasses.dataclass(frozen=True)
class Counts:
    """A usage in one vocabulary, whichever API reported it (``apis`` maps each).

    ``prompt_tokens``: the whole prompt, cached part included; ``cached_tokens``:
    its part read from the prefix cache, ``None`` when not reported;
    ``drafts_accepted`` / ``drafts_rejected``: speculative decoding, ``None``
    when not reported (OpenAI reports 0 and 0 on every answer).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    drafts_accepted: int | None = None
    drafts_rejected: int | None = None


@dataclasses.dataclass(frozen=True)
class Summary:
    """The end of one answer.

    ``prompt_tokens`` (cached part included), ``cached_tokens``,
    ``completion_tokens``: from the server's usage, ``None`` when not reported.
    ``drafts_accepted`` of ``drafts_verified`` (accepted + rejected): speculative
    decoding, ``None`` when the server drafted nothing. ``ttft_s``: measured here,
    from sending the request to the first content token. ``decode_tok_s``:
    completion tokens after the first over the time from the first content token
    to the last, ``None`` when that time is zero or there is one token.
    """

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    drafts_accepted: int | None = None
    drafts_verified: int | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    finish_reason: str | None = None


def summarize(
    counts: Counts | None,
    sent_at: float,
    first_token_at: float | None,
    last_token_at: float | None,
    finish_reason: str | None,
) -> Summary:
    """Times are from one monotonic clock, in seconds."""
    ttft = first_token_at - sent_at if first_token_at is not None else None
    if counts is None:
        return Summary(ttft_s=ttft, finish_reason=finish_reason)
    decode = None
    if first_token_at is not None and last_token_at is not None:
        span = last_token_at - first_token_at
        if span > 0 and counts.completion_tokens > 1:
            decode = (counts.completion_tokens - 1) / span
    accepted = verified = None
    a, r = counts.drafts_accepted or 0, counts.drafts_rejected or 0
    # OpenAI reports 0 and 0 on every answer: no drafting, nothing to show.
    if a + r > 0:
        accepted, verified = a, a + r
    return Summary(
        prompt_tokens=counts.prompt_tokens,
        cached_tokens=counts.cached_tokens,
        completion_tokens=counts.completion_tokens,
        drafts_accepted=accepted,
        drafts_verified=verified,
        ttft_s=ttft,
        decode_tok_s=decode,
        finish_reason=finish_reason,
    )


def queue_text(q: QueueProgress, waited_s: float | None = None) -> str:
    """``position 2 of 3, waited 0.4 s[, eta 1.2 s]``; ``waited_s`` overrides the server's
    ``time_ms`` (the terminal view adds the time since the chunk came)."""
    waited = q.time_ms / 1000 if waited_s is None else waited_s
    text = f"position {q.position} of {q.queued}, waited {waited:.1f} s"
    if q.eta_ms is not None:
        text += f", eta {q.eta_ms / 1000:.1f} s"
    return text


def prefill_text(p: Prefill) -> str:
    """``512/1024 tokens (cached 256), 830 tok/s, eta 0.3 s``; once done the eta becomes
    the prefill time: ``…, 853 tok/s, in 0.90 s``."""
    text = f"{p.processed}/{p.total} tokens (cached {p.cache})"
    if p.rate_tok_s is not None:
        text += f", {p.rate_tok_s:.0f} tok/s"
    if p.done:
        text += f", in {p.time_s:.2f} s"
    elif p.eta_s is not None:
        text += f", eta {p.eta_s:.1f} s"
    return text


def usage_text(s: Summary) -> str:
    """``prompt 1024 (cached 256, 25%), completion 64, drafts accepted 40/50 (80%),
    ttft 1.23 s, decode 55.1 tok/s``; parts the server did not report are left out,
    and a finish other than ``stop`` is named (``finish length``)."""
    parts: list[str] = []
    if s.prompt_tokens is None:
        parts.append("not reported by the server")
    else:
        prompt = f"prompt {s.prompt_tokens}"
        if s.cached_tokens is not None:
            share = _percent(s.cached_tokens, s.prompt_tokens)
            prompt += f" (cached {s.cached_tokens}, {share})" if share else f" (cached {s.cached_tokens})"
        parts += [prompt, f"completion {s.completion_tokens}"]
    if s.drafts_accepted is not None and s.drafts_verified is not None:
        rate = _percent(s.drafts_accepted, s.drafts_verified)
        parts.append(f"drafts accepted {s.drafts_accepted}/{s.drafts_verified} ({rate})")
    if s.ttft_s is not None:
        parts.append(f"ttft {s.ttft_s:.2f} s")
    if s.decode_tok_s is not None:
        parts.append(f"decode {s.decode_tok_s:.1f} tok/s")
    if s.finish_reason not in (None, "stop"):
        parts.append(f"finish {s.finish_reason}")
    return ", ".join(parts)


def _percent(part: int, whole: int) -> str | None:
    return f"{100 * part / whole:.0f}%" if whole > 0 else None
