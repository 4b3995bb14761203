"""Log-probabilities from ExLlamaV3 1.6.5's result dicts, lined up with the text.

A job created with ``return_probs=True`` and ``return_top_tokens=k``
(``generator/job.py:64-66``) buffers, for every sampled token, the values
``Job.receive_logits`` computed (``job.py:764-778``) and sends them with the
held tokens they belong to: ``token_probs`` ``(1, n)``, ``top_k_tokens`` and
``top_k_probs`` ``(1, n, k)``, aligned with ``token_ids`` in the same dict
(``job.py:902-907``), or in ``held`` when a stop token ends the job
(``job.py:949-961``).

Which distribution that is: ``softmax(logits.float())`` of the position's own
output logits, after the sampler has drawn the token. The sampler changes those
logits in place only to set the padded vocabulary past
``Tokenizer.actual_vocab_size`` to ``-inf`` (``sampler/custom.py:1206-1207``);
the grammar mask is applied out of place (``custom.py:1247-1258``), and the
``ComboSampler`` stack runs as copying steps (logit bias, penalties:
``custom.py:638``, ``782``, ``845``) ahead of the fused kernel, which only reads
its input (``exllamav3_ext/generator/sampling_fused.cu``, ``const at::Tensor&
logits``). So 1.6.5 reports the model's distribution at temperature 1, before
``logit_bias``, the penalties, the grammar mask, the ``min_tokens`` stop-token
mask, the temperature and top-k/top-p/min-p. (With ``EXL3_FUSED_SAMPLER=0`` the
step-by-step stack may divide fp32 logits by the temperature in place,
``custom.py:369-370``; the worker leaves that variable alone.) That is the
distribution ``SamplingParams.logprobs`` asks for only when the request has no
logit bias, no penalties, no grammar and no truncation and samples at
temperature 1 or greedily; otherwise a chosen token's log-probability is what
the model alone gave it (a grammar-forced or biased token can be very
unlikely), and the alternatives may include tokens the sampler could not pick.

Entries: ``TokenLogprob.token`` is each token's share of the text its dict
released, so the entries of a ``TokenDelta`` join to its text
(``split_text``): normally the token's piece (what ``Job`` appends for it,
``job.py:971``); where ``Job`` repaired a character split across tokens by
decoding them together (``job.py:887-893``, ``1005-1016``), the token that
completes a character carries it and the ones before it ``""``; past a stop
string's start, tokens get no entry and the token it cuts keeps only its shown
part. Probabilities are turned into natural logs, ``LOGPROB_FLOOR`` for 0.
Alternatives with probability 0 or outside the vocabulary are left out.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from protocol.messages import TokenLogprob, TopLogprob

log = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0
"""Log-probability reported for probability 0 (JSON has no ``-inf``; OpenAI's own floor)."""


def logprob(p: float | None) -> float:
    if p is None or not p > 0.0:
        return LOGPROB_FLOOR
    return max(LOGPROB_FLOOR, math.log(p))


class TokenBytes:
    """Each token's own bytes, from the llguidance tokenizer 1.6.5's grammar filters
    use (``ll_tokenizer``, built on the first ``load``), falling back to the UTF-8
    of its piece where there is none. ``load`` runs on the prepare thread before any
    request with logprobs starts, so the engine thread never builds it."""

    def __init__(self, ll_tokenizer: Callable[[], Any] | None, pieces: Sequence[str]) -> None:
        self._factory = ll_tokenizer
        self._pieces = pieces
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._cache: dict[int, bytes] = {}

    def load(self) -> None:
        """Build the llguidance tokenizer once; if it cannot be built, log it and use
        the pieces' bytes from then on."""
        if self._factory is None or self._tokenizer is not None:
            return
        with self._lock:
            if self._tokenizer is None and self._factory is not None:
                try:
                    self._tokenizer = self._factory()
                except Exception:
                    log.exception("exllamav3: no llguidance tokenizer; token bytes from the pieces' text")
                    self._factory = None

    def __call__(self, token: int) -> bytes:
        got = self._cache.get(token)
        if got is not None:
            return got
        out: bytes | None = None
        tok = self._tokenizer
        if tok is not None and 0 <= token < int(tok.vocab_size):
            try:
                out = bytes(tok.decode_bytes([token]))
            except Exception:
                out = None
        if out is None:
            out = (self._pieces[token] if 0 <= token < len(self._pieces) else "").encode("utf-8")
        if len(self._cache) < 1 << 20:
            self._cache[token] = out
        return out


def split_text(
    ids: Sequence[int], text: str, pieces: Sequence[str], decode: Callable[[list[int]], str]
) -> list[str | None]:
    """Each token's share of ``text``, the text released by the result holding
    ``ids``: the shares that are not ``None`` join to ``text``; ``None`` for a
    token that starts past its end (a stop string cut the text there)."""
    if not ids:
        return []
    spans: list[str] | None = [pieces[t] if 0 <= t < len(pieces) else "" for t in ids]
    assert spans is not None
    if not "".join(spans).startswith(text):
        spans = _decoded_spans(ids, decode)
        if spans is None or not "".join(spans).startswith(text):
            # Nothing lines up (a tokenizer whose pieces and decode disagree): the text goes
            # to the last token, which keeps the contract that the shares join to it.
            return [*([""] * (len(ids) - 1)), text]
    if sum(len(s) for s in spans) == len(text):
        return list(spans)
    out: list[str | None] = []
    pos, end = 0, len(text)
    for s in spans:
        out.append(s[: end - pos] if pos < end else None)
        pos += len(s)
    return out


def _decoded_spans(ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[str] | None:
    """Shares from decoding growing prefixes: an incomplete character at the end of a
    prefix (U+FFFD) waits for the token that completes it."""
    out: list[str] = []
    prev = ""
    for i in range(1, len(ids) + 1):
        d = decode(list(ids[:i]))
        if i < len(ids):
            d = d.rstrip("\ufffd")
        if not d.startswith(prev):
            return None
        out.append(d[len(prev) :])
        prev = d
    return out


def _row(x: Any) -> list[Any]:
    """The first row of a ``(1, n)`` or ``(1, n, k)`` tensor as nested lists."""
    if x is None:
        return []
    rows = x.tolist()
    return list(rows[0]) if rows and isinstance(rows[0], list) else list(rows)


def entries(
    ids: Sequence[int],
    shares: Sequence[str | None],
    source: dict[str, Any],
    *,
    top: int,
    pieces: Sequence[str],
    token_bytes: Callable[[int], bytes],
) -> list[TokenLogprob]:
    """One ``TokenLogprob`` per token of ``ids`` whose share is not ``None``, from the
    ``token_probs``/``top_k_tokens``/``top_k_probs`` of ``source`` (a result dict or its
    ``held``), whose rows start with ``ids``; at most ``top`` alternatives each."""
    out = aligned_entries(ids, shares, source, top=top, pieces=pieces, token_bytes=token_bytes)
    return [e for e in out if e is not None]


def aligned_entries(
    ids: Sequence[int],
    shares: Sequence[str | None],
    source: dict[str, Any],
    *,
    top: int,
    pieces: Sequence[str],
    token_bytes: Callable[[int], bytes],
) -> list[TokenLogprob | None]:
    """``entries``, one per token of ``ids``: ``None`` where its share is ``None``."""
    probs = _row(source.get("token_probs"))
    k_tokens = _row(source.get("top_k_tokens"))
    k_probs = _row(source.get("top_k_probs"))
    vocab = len(pieces)
    out: list[TokenLogprob | None] = []
    for i, (token, share) in enumerate(zip(ids, shares, strict=True)):
        if share is None:
            out.append(None)
            continue
        alternatives: list[TopLogprob] = []
        if top > 0 and i < len(k_tokens) and i < len(k_probs):
            for t, p in zip(k_tokens[i], k_probs[i], strict=False):
                t = int(t)
                if p > 0.0 and 0 <= t < vocab and len(alternatives) < top:
                    alternatives.append(TopLogprob(pieces[t], logprob(float(p)), token_bytes(t)))
        p_token = float(probs[i]) if i < len(probs) else None
        out.append(TokenLogprob(share, logprob(p_token), token_bytes(token), tuple(alternatives)))
    return out
