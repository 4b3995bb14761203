"""Token selection for one sequence: logit processors, filters and sampling.

Order of operations on one position's logits (``[vocab]``), following the common
OpenAI-compatible servers (vLLM, llama.cpp):

1. ``logit_bias`` is added.
2. ``repetition_penalty`` (the CTRL paper's rule, as in transformers and vLLM):
   for tokens seen in the prompt or output, positive logits are divided by it and
   negative ones multiplied.
3. ``presence_penalty``/``frequency_penalty`` (OpenAI's definition): subtract
   ``frequency * count + presence * (count > 0)`` over the output tokens.
   With a ``penalty_range`` (not -1) both penalties weigh each occurrence by its
   distance from the end, as ExLlamaV3's ``apply_rep_pens``/``apply_pres_freq_pens``
   kernels do (``exllamav3_ext/generator/rep_pen.cu``): weight 1 within the last
   ``penalty_range`` tokens of the context, fading linearly to 0 over the
   ``repetition_decay`` tokens before them, 0 beyond; a token takes its largest
   weight (repetition, presence) or the sum of them (frequency), and the
   repetition penalty blends ``v * (1 - w) + penalised * w``. Then DRY
   (``dry_multiplier``), as ExLlamaV3's ``SS_DRY`` (``TokenSampler._dry_penalty``).
4. ``banned_tokens`` (and with ``ban_eos_token`` the model's end-of-sequence ids)
   and a grammar's forbidden tokens (``engine_worker.constraints``) are masked.
5. Before ``min_tokens`` output tokens, end-of-sequence and stop token ids are
   masked, unless the grammar allows nothing else (a complete grammar ends the
   sequence whatever ``min_tokens`` asks).
6. ``temperature == 0`` takes the argmax. Otherwise divide by the temperature,
   keep the ``top_k`` largest, the smallest set whose probability reaches
   ``top_p``, and tokens with probability at least ``min_p`` times the largest
   (with ``temperature_last`` the filters see temperature 1 and the temperature
   then raises the surviving probabilities to ``1 / temperature``), then XTC
   (``xtc_probability``, ExLlamaV3's ``SS_XTC`` rule: of the tokens at or above
   ``xtc_threshold`` that are not protected, all but the least likely are
   scaled by ``(1 - p) / (1 + p * m / (1 - m))`` for their mass ``m``, which
   is the average over the roll of excluding them or not), then draw from the
   renormalised distribution with the sequence's own ``torch.Generator``
   (seeded from ``seed``, so a seed reproduces the output).

Every operation is ``O(vocab)`` per position and independent of the sequence
length (a windowed penalty: ``O(penalty_range + repetition_decay)``); the
penalty state is updated incrementally by ``observe``.

``sample_scored`` draws the same token as ``sample`` (same generator, same
probabilities) and also returns log-probabilities of the distribution it drew
from: the logits of step 5, divided by the temperature (1 when greedy), with the
tokens that top-k/top-p/min-p removed left out.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import torch

from engine_worker.requests.logprobs import Scored
from protocol.messages import SamplingParams


class TokenSampler:
    """Selects tokens for one sequence and tracks what it has generated.

    ``vocab_size`` is the width of the model's logits; ``end_ids`` are the token
    ids that end generation (masked until ``min_tokens`` tokens were generated);
    ``eos_ids`` the model's end-of-sequence ids (banned with ``ban_eos_token``);
    ``protected`` a ``[vocab]`` bool mask of the tokens XTC never excludes
    (newline and special tokens, as ExLlamaV3's ``xtc_default_protected_token_ids``).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Iterable[int],
        vocab_size: int,
        end_ids: Iterable[int],
        *,
        eos_ids: Iterable[int] = (),
        protected: torch.Tensor | None = None,
        breakers: torch.Tensor | None = None,
    ) -> None:
        self.params = params
        self.greedy = params.temperature == 0.0
        self.num_generated = 0
        prompt_ids = list(prompt_ids)
        banned = set(params.banned_tokens) | (set(eos_ids) if params.ban_eos_token else set())
        self._banned = torch.tensor(sorted(banned), dtype=torch.long) if banned else None
        self._protected = protected
        # An XTC above threshold 0.5 can never find two tokens to choose between (SS_XTC.alt).
        self._xtc = params.xtc_probability > 0.0 and params.xtc_threshold <= 0.5
        # Windowed penalties (penalty_range != -1) weigh occurrences by distance: keep the history.
        penalising = params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
        penalising = penalising or params.frequency_penalty != 0.0
        self._window = params.penalty_range + params.repetition_decay if params.penalty_range >= 0 else -1
        self._history: list[int] | None = None
        self._prompt_len = len(prompt_ids)
        self._windowed = penalising and self._window >= 0
        # DRY (SS_DRY.alt: off at multiplier 0 or a base below 1); its values rounded to float32 as there.
        self._dry = params.dry_multiplier > 0.0 and params.dry_base >= 1.0
        self._breakers = breakers
        self._dry_multiplier = self._dry_base = 0.0
        self._dry_max_exponent = 0
        if self._dry:  # not on the plain path: a request without DRY pays nothing here
            self._dry_multiplier = float(torch.tensor(params.dry_multiplier, dtype=torch.float32))
            self._dry_base = float(torch.tensor(params.dry_base, dtype=torch.float32))
            self._dry_max_exponent = dry_max_exponent(params.dry_base)
        if self._windowed or self._dry:
            self._history = prompt_ids
        self._generator: torch.Generator | None = None
        if not self.greedy:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            self._generator = torch.Generator().manual_seed(seed)

        self._bias_ids: torch.Tensor | None = None
        self._bias_values: torch.Tensor | None = None
        if params.logit_bias:
            self._bias_ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.long)
            self._bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

        self._seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0 and not self._windowed:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool)
            ids = torch.tensor(list(prompt_ids), dtype=torch.long)
            if ids.numel():
                self._seen[ids] = True

        self._counts: torch.Tensor | None = None
        if (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0) and not self._windowed:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32)

        self._suppressed: torch.Tensor | None = None
        if params.min_tokens > 0:
            self._suppressed = torch.tensor(sorted(set(end_ids)), dtype=torch.long)

    def observe(self, token: int) -> None:
        """Record a generated token (it affects the penalties of later positions)."""
        self.num_generated += 1
        if self._history is not None:
            self._history.append(token)
        if self._seen is not None:
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1.0

    def rewind(self, prompt_ids: list[int], output: list[int]) -> None:
        """Forget the generated tokens after ``output`` (the ones kept): the
        penalty state is rebuilt from ``prompt_ids`` and ``output`` (banned
        strings rewind the sequence). The generator is not rewound: the
        resampled position draws fresh numbers, as ExLlamaV3's does."""
        self.num_generated = len(output)
        if self._history is not None:
            self._history = [*prompt_ids, *output]
        if self._seen is not None:
            self._seen.zero_()
            ids = torch.tensor([*prompt_ids, *output], dtype=torch.long)
            if ids.numel():
                self._seen[ids] = True
        if self._counts is not None:
            self._counts.zero_()
            if output:
                self._counts.index_add_(
                    0, torch.tensor(output, dtype=torch.long), torch.ones(len(output), dtype=torch.float32)
                )

    def process(self, logits: torch.Tensor, forbidden: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 1-5 above on ``logits`` (``[vocab]``, left unchanged); ``forbidden``
        is a grammar's ``[vocab]`` bool mask. Returns float32 logits (``logits``
        itself when nothing applies)."""
        p = self.params
        suppress = self._suppressed is not None and self.num_generated < p.min_tokens
        # Copy only when a step below writes in place: `logits` may be a view of the model output.
        in_place = self._bias_ids is not None or suppress or forbidden is not None or self._banned is not None
        x = logits.to(dtype=torch.float32, copy=in_place)
        if self._bias_ids is not None and self._bias_values is not None:
            x.index_add_(0, self._bias_ids, self._bias_values)
        if self._seen is not None:
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(self._seen, penalised, x)
        if self._counts is not None:
            x -= p.frequency_penalty * self._counts + p.presence_penalty * (self._counts > 0)
        if self._windowed:
            x = self._windowed_penalties(x)
        if self._dry:
            x = self._dry_penalty(x)
        if self._banned is not None:
            x[self._banned] = float("-inf")
        if forbidden is not None:
            x.masked_fill_(forbidden, float("-inf"))
        if suppress and self._suppressed is not None and self._suppressed.numel():
            kept = x[self._suppressed] if forbidden is not None else None
            x[self._suppressed] = float("-inf")
            if kept is not None and bool(torch.isneginf(x).all()):
                x[self._suppressed] = kept  # the grammar allows only an end token: it wins
        return x

    def _windowed_penalties(self, x: torch.Tensor) -> torch.Tensor:
        """Step 3 with a ``penalty_range``: weights by distance from the end of the
        context (``rep_pen.cu``'s rule, module docstring). ``x`` float32 ``[vocab]``."""
        p, history = self.params, self._history
        assert history is not None
        if self._window <= 0:
            return x  # nothing in range: SS_RepP/SS_PresFreqP are no-ops (custom.py's alt())
        start = max(0, len(history) - self._window)
        ids = torch.tensor(history[start:], dtype=torch.long)
        if not ids.numel():
            return x
        dist = torch.arange(ids.numel(), 0, -1, dtype=torch.float32)  # the last token: distance 1
        if p.repetition_decay > 0:
            weight = (1.0 - (dist - p.penalty_range) / p.repetition_decay).clamp(0.0, 1.0)
        else:
            weight = torch.ones_like(dist)
        if p.repetition_penalty != 1.0:
            w = torch.zeros_like(x).scatter_reduce_(0, ids, weight, reduce="amax")
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = x * (1.0 - w) + penalised * w
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            # Output tokens only, as without a range (OpenAI's definition; module docstring).
            first_output = max(0, self._prompt_len - start)
            out_ids, out_w = ids[first_output:], weight[first_output:]
            if out_ids.numel():
                freq = torch.zeros_like(x).index_add_(0, out_ids, out_w)
                presence = torch.zeros_like(x).scatter_reduce_(0, out_ids, out_w, reduce="amax")
                x = x - p.frequency_penalty * freq - p.presence_penalty * presence
        return x

    def _dry_penalty(self, x: torch.Tensor) -> torch.Tensor:
        """DRY as ExLlamaV3's ``dry_penalty`` kernel computes it
        (``exllamav3_ext/generator/dry.cu``, llama.cpp's rule with single-token
        breakers): in the last ``dry_range`` tokens (0: all), read backwards, a
        repeat may not reach past the nearest breaker; for every earlier position
        ``k`` the run the context's suffix shares with the sequence ending ``k``
        tokens back (at most the exponent clamp past ``dry_allowed_length``, or
        2048) charges the token that followed that sequence; a charged token that
        is no breaker loses ``multiplier * base ** min(run - allowed, max_exponent)``."""
        p, history = self.params, self._history
        assert history is not None
        allowed = p.dry_allowed_length
        m = len(history) if p.dry_range <= 0 else min(len(history), p.dry_range)
        if m <= allowed:
            return x
        rev = torch.tensor(history[len(history) - m :][::-1], dtype=torch.long)
        rep_limit = m
        if self._breakers is not None:
            hits = torch.nonzero(self._breakers[rev]).flatten()
            if hits.numel():
                rep_limit = int(hits[0])
        if rep_limit < allowed:
            return x
        cap = allowed + self._dry_max_exponent if self._dry_max_exponent > 0 else DRY_MATCH_CAP
        cap = min(cap, rep_limit)
        k = torch.arange(1, m)
        run = torch.zeros(m - 1, dtype=torch.long)
        alive = torch.ones(m - 1, dtype=torch.bool)
        for j in range(cap):
            alive &= (j + k < m) & (rev[j] == rev[(j + k).clamp(max=m - 1)])
            if not bool(alive.any()):
                break
            run += alive
        charged = run >= allowed
        if not bool(charged.any()):
            return x
        longest = torch.full(x.shape, -1, dtype=torch.long)
        longest.scatter_reduce_(0, rev[k - 1][charged], run[charged], reduce="amax")
        hit = longest >= allowed
        if self._breakers is not None:
            hit &= ~self._breakers
        exponent = (longest - allowed).clamp(min=0)
        if self._dry_max_exponent > 0:
            exponent = exponent.clamp(max=self._dry_max_exponent)
        # The kernel computes the penalty in double and rounds it once to float.
        penalty = self._dry_multiplier * torch.pow(
            torch.tensor(self._dry_base, dtype=torch.float64), exponent
        )
        return x - torch.where(hit, penalty.to(torch.float32), torch.zeros_like(x))

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """Step 6's distribution (before the draw) for processed logits ``x``."""
        p = self.params
        probs = filtered_probs(
            x, p.temperature, p.top_k, p.top_p, p.min_p, temperature_last=p.temperature_last
        )
        if self._xtc:
            probs = xtc(probs, p.xtc_probability, p.xtc_threshold, self._protected)
        return probs

    def sample(self, logits: torch.Tensor, forbidden: torch.Tensor | None = None) -> int:
        """The next token for one position's raw ``logits`` (``[vocab]``), never one
        ``forbidden`` marks."""
        x = self.process(logits, forbidden)
        if self.greedy:
            return int(torch.argmax(x))
        return int(torch.multinomial(self.probs(x), 1, generator=self._generator))

    def sample_scored(self, logits: torch.Tensor, top: int, forbidden: torch.Tensor | None = None) -> Scored:
        """``sample``, and the log-probabilities of the distribution sampled from:
        the chosen token's and the ``top`` most likely."""
        p = self.params
        x = self.process(logits, forbidden)
        filtering = 0 < p.top_k < x.shape[-1] or p.top_p < 1.0 or p.min_p > 0.0
        probs: torch.Tensor | None = None
        if self.greedy:
            token = int(torch.argmax(x))
            scaled = x
            if filtering:  # the argmax always survives the filters
                probs = filtered_probs(x, 1.0, p.top_k, p.top_p, p.min_p)
        else:
            probs = self.probs(x)
            token = int(torch.multinomial(probs, 1, generator=self._generator))
            scaled = x / p.temperature
        if not self.greedy and (self._xtc or p.temperature_last):
            # The distribution is no longer a softmax of scaled logits: take it as it is.
            assert probs is not None
            logprobs = torch.log(probs)
        else:
            if filtering and probs is not None:
                scaled = scaled.masked_fill(probs == 0.0, float("-inf"))
            # Log-space normalisation rather than log(probs): exact for unlikely tokens too.
            logprobs = scaled - torch.logsumexp(scaled, dim=-1)
        alternatives: list[tuple[int, float]] = []
        if top > 0:
            values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
            alternatives = [
                (i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != float("-inf")
            ]
        return Scored(token, float(logprobs[token]), alternatives)


def filtered_probs(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    *,
    temperature_last: bool = False,
) -> torch.Tensor:
    """Probabilities (``[vocab]``, summing to 1) after temperature, top-k, top-p and
    min-p; filtered-out tokens get probability 0. The most likely token always
    survives. ``temperature`` must be > 0. With ``temperature_last`` the filters
    run at temperature 1 and the temperature then raises the surviving
    probabilities to ``1 / temperature`` (ExLlamaV3's ``SS_Temperature`` on
    probabilities, ``probs.pow_(1.0 / self.temperature)``)."""
    if temperature_last:
        probs = filtered_probs(logits, 1.0, top_k, top_p, min_p)
        if temperature != 1.0:
            probs = probs.pow(1.0 / temperature)
            probs = probs / probs.sum()
        return probs
    x = logits / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        sorted_probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


DRY_MATCH_CAP = 2048
"""ExLlamaV3's ``_DRY_MATCH_CAP``: the longest run DRY scans when the exponent is not clamped."""

_DRY_FLOAT_MAX_LOG = 88.7228391  # ln of the largest float32 (llama.cpp's FLOAT_MAX_LOG)


def dry_max_exponent(base: float) -> int:
    """ExLlamaV3's ``_dry_max_exponent``: llama.cpp's exponent clamp,
    ``FLOAT_MAX_LOG / log(base)`` in float32, truncated; 0 (none) for a base of
    at most 1.000001."""
    base_f = torch.tensor(base, dtype=torch.float32)
    if not bool(base_f > torch.tensor(1.000001, dtype=torch.float32)):
        return 0
    return int(torch.tensor(_DRY_FLOAT_MAX_LOG, dtype=torch.float32) / base_f.log())


def xtc(
    probs: torch.Tensor, probability: float, threshold: float, protected: torch.Tensor | None
) -> torch.Tensor:
    """ExLlamaV3's ``SS_XTC`` on normalised ``probs`` (``[vocab]``): of the tokens
    with probability at least ``threshold`` that ``protected`` (a ``[vocab]``
    bool mask, or ``None``) does not hold out, all but the least likely are
    excluded with ``probability``. As there, the roll is averaged: the excluded
    tokens are scaled by ``(1 - p) / (1 + p * m / (1 - m))`` for their mass
    ``m``, which is the mixture of "excluded" and "kept" once renormalised.
    Returns renormalised probabilities."""
    order = torch.argsort(probs, descending=True)
    sorted_probs = probs[order]
    k = probs.shape[-1] if threshold <= 0.0 else min(probs.shape[-1], int(1.0 / threshold) + 1)
    head = sorted_probs[:k]
    qualifies = head >= threshold
    if protected is not None:
        qualifies &= ~protected[order[:k]]
    count = int(qualifies.sum())
    if count < 2:
        return probs
    excluded = qualifies & (torch.cumsum(qualifies.to(torch.int64), dim=-1) < count)
    mass = float((head * excluded).sum())
    scale = (1.0 - probability) / (1.0 + probability * mass / (1.0 - mass)) if mass < 1.0 else 0.0
    out = probs.clone()
    ids = order[:k][excluded]
    out[ids] = out[ids] * scale
    return out / out.sum()
