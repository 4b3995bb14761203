"""Token selection for one sequence: logit processors, filters and sampling.

Order of operations on one position's logits (``[vocab]``), following the common
OpenAI-compatible servers (vLLM, llama.cpp):

1. ``logit_bias`` is added.
2. ``repetition_penalty`` (the CTRL paper's rule, as in transformers and vLLM):
   for tokens seen in the prompt or output, positive logits are divided by it and
   negative ones multiplied.
3. ``presence_penalty``/``frequency_penalty`` (OpenAI's definition): subtract
   ``frequency * count + presence * (count > 0)`` over the output tokens.
4. Before ``min_tokens`` output tokens, end-of-sequence and stop token ids are
   masked.
5. ``temperature == 0`` takes the argmax. Otherwise divide by the temperature,
   keep the ``top_k`` largest, the smallest set whose probability reaches
   ``top_p``, and tokens with probability at least ``min_p`` times the largest,
   then draw from the renormalised distribution with the sequence's own
   ``torch.Generator`` (seeded from ``seed``, so a seed reproduces the output).

Every operation is ``O(vocab)`` per position and independent of the sequence
length; the penalty state is updated incrementally by ``observe``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import torch

from protocol.messages import SamplingParams


class TokenSampler:
    """Selects tokens for one sequence and tracks what it has generated.

    ``vocab_size`` is the width of the model's logits; ``end_ids`` are the token
    ids that end generation (masked until ``min_tokens`` tokens were generated).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Iterable[int],
        vocab_size: int,
        end_ids: Iterable[int],
    ) -> None:
        self.params = params
        self.greedy = params.temperature == 0.0
        self.num_generated = 0
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
        if params.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool)
            ids = torch.tensor(list(prompt_ids), dtype=torch.long)
            if ids.numel():
                self._seen[ids] = True

        self._counts: torch.Tensor | None = None
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32)

        self._suppressed: torch.Tensor | None = None
        if params.min_tokens > 0:
            self._suppressed = torch.tensor(sorted(set(end_ids)), dtype=torch.long)

    def observe(self, token: int) -> None:
        """Record a generated token (it affects the penalties of later positions)."""
        self.num_generated += 1
        if self._seen is not None:
            self._seen[token] = True
        if self._counts is not None:
            self._counts[token] += 1.0

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Steps 1-4 above on ``logits`` (``[vocab]``, left unchanged); returns float32
        logits (``logits`` itself when nothing applies)."""
        p = self.params
        # Copy only when a step below writes in place: `logits` may be a view of the model output.
        in_place = self._bias_ids is not None or self._suppressed is not None
        x = logits.to(dtype=torch.float32, copy=in_place)
        if self._bias_ids is not None and self._bias_values is not None:
            x.index_add_(0, self._bias_ids, self._bias_values)
        if self._seen is not None:
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(self._seen, penalised, x)
        if self._counts is not None:
            x -= p.frequency_penalty * self._counts + p.presence_penalty * (self._counts > 0)
        if self._suppressed is not None and self.num_generated < p.min_tokens and self._suppressed.numel():
            x[self._suppressed] = float("-inf")
        return x

    def sample(self, logits: torch.Tensor) -> int:
        """The next token for one position's raw ``logits`` (``[vocab]``)."""
        x = self.process(logits)
        if self.greedy:
            return int(torch.argmax(x))
        probs = filtered_probs(
            x, self.params.temperature, self.params.top_k, self.params.top_p, self.params.min_p
        )
        return int(torch.multinomial(probs, 1, generator=self._generator))


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Probabilities (``[vocab]``, summing to 1) after temperature, top-k, top-p and
    min-p; filtered-out tokens get probability 0. The most likely token always
    survives. ``temperature`` must be > 0."""
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
