"""The CPU engine's steps: which sequences one forward pass carries, and what its
logits mean for each.

Each sequence owns a ``SequenceKV``. One step is one forward pass over every
running sequence (batched decode; each sequence attends over its own KV length):

- prefill: chunks of the prompt, at most ``chunk_size`` prompt tokens per pass
  shared by the sequences in prefill (oldest first), after seeding the KV cache
  with the longest matching prefix from the ``PrefixCache`` (at most
  ``prompt_tokens - 1`` positions: the last prompt token is always fed, to get the
  logits of the first completion token). Decoding sequences ride in the same
  pass, so a long prompt holds them up by one chunk's compute per token;
- decode: the last token, plus, with n-gram drafting, up to ``num_draft_tokens``
  drafted tokens verified in the same pass. Each position's logits go through
  the sequence's ``TokenSampler`` in order and a draft token is accepted while it
  equals the target's own choice, so the output is exactly what plain decoding
  would produce (greedy: identical tokens; sampling: the target distribution).
  The KV of rejected positions is cropped.

With a grammar, each position's logits are masked by the sequence's matcher before
sampling and the chosen token is consumed by it (``SequenceOutput``), positions of
a verify pass included, so drafted tokens are judged under the same mask plain
decoding would use; drafts are first cut to the prefix the grammar allows.

Choices of one request share one prefill (``engine_worker.requests.choices``): the
later ones start, at the end of the first one's prefill and in that same step, from
a copy of its prompt KV and the logits of its last prompt position, from which each
samples its first token with its own sampler. That is bitwise what their own
prefill would have computed (chunks at the same multiples of ``chunk_size``, rows
computed as alone: ``docs/performance.md#batch-invariance``), so greedy output is
unchanged, and ``cached_tokens`` is then the whole prompt.

A finished or aborted sequence's valid KV goes into the prefix cache; a failed
one's is dropped (its KV may be half-written).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine_worker.backend import RequestRejected
from engine_worker.cpu.kv_cache import SequenceKV
from engine_worker.cpu.llama import LlamaRunner, Segment
from engine_worker.cpu.ngram import NgramDrafter
from engine_worker.cpu.prefix_cache import PrefixCache
from engine_worker.cpu.sampling import TokenSampler
from engine_worker.requests.choices import startable
from engine_worker.requests.events import opening
from engine_worker.requests.logprobs import Scored
from engine_worker.requests.output import SequenceOutput
from protocol.messages import ErrorCode, Event, Finished, FinishReason, PrefillProgress, RequestError

logger = logging.getLogger(__name__)

# First KV allocation beyond the prompt, tokens; the cache grows when needed.
INITIAL_DECODE_ROOM = 256


@dataclass(eq=False)
class Sequence:
    """One admitted sequence: its output pipeline and its engine state."""

    request_id: str
    source: object  # the prepared prompt; choices of one request share it (and one prefill)
    prompt_ids: list[int]
    t_added: float
    sampler: TokenSampler
    drafter: NgramDrafter | None
    reservation: int  # KV tokens reserved for it out of kv_cache_mb
    out: SequenceOutput
    cache_salt: str | None = None  # prefix-cache entries are shared within one salt only
    kv: SequenceKV | None = None  # tokens[:kv.length] have KV
    processed: int = 0
    cached: int = 0
    draft_accepted: int = 0
    draft_rejected: int = 0
    t_start: float = 0.0
    t_prefill_end: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        """Prompt + output."""
        return self.out.tokens


@dataclass(frozen=True, slots=True)
class _Work:
    """One sequence's part of a step's pass: a prompt chunk (``drafts`` is
    ``None``) or its last token followed by ``drafts``."""

    seq: Sequence
    segment: Segment
    drafts: list[int] | None


class Scheduler:
    """The running sequences of one ``CpuBackend`` and their steps (module docstring).

    ``block``: the unit prefix-cache hits and entries end at (``reusable``)."""

    def __init__(
        self,
        runner: LlamaRunner,
        prefix_cache: PrefixCache,
        *,
        chunk_size: int,
        num_draft_tokens: int,
        max_context: int,
        block: int,
        vocab_size: int,
    ) -> None:
        self._runner = runner
        self._prefix_cache = prefix_cache
        self._chunk_size = chunk_size
        self._num_draft_tokens = num_draft_tokens
        self._max_context = max_context
        self._block = block
        self._vocab_size = vocab_size
        self.sequences: dict[str, Sequence] = {}
        self._prefill_turn = 0  # which sequence in prefill goes first in the next pass

    def add(self, seq: Sequence) -> None:
        self.sequences[seq.request_id] = seq

    def abort(self, request_id: str) -> None:
        """Drop the sequence now; its valid KV (prompt processed so far, fed output
        tokens) is kept in the prefix cache."""
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self._release(seq, keep_kv=True)

    def close(self) -> None:
        self.sequences.clear()

    def step(self) -> list[Event]:
        """One forward pass over every running sequence; the events produced, in order.

        A step that admits new sequences (prefix-cache lookup, ``Started`` and the
        first ``PrefillProgress``) runs no forward pass, so those events reach the
        client at once instead of after a pass. When the batched pass raises, each
        of its sequences is run alone, so only the one that fails gets an error."""
        if not self.sequences:
            return []
        events: list[Event] = []
        with torch.inference_mode():
            waiting = startable(
                self.sequences.values(),
                group=lambda s: id(s.source),
                waiting=lambda s: s.kv is None,
                prefilled=lambda s: s.processed == s.prompt_len,
            )
            if waiting:
                for seq in waiting:
                    self._guarded(seq, events, self._start, seq, events)
                return events
            work = self._plan()
            for item, logits in self._run(work, events):
                self._guarded(item.seq, events, self._apply, item, logits, events)
        return events

    def _plan(self) -> list[_Work]:
        """This step's segments: every decoding sequence (its drafts proposed and
        cut to the grammar), and prompt chunks within ``chunk_size`` tokens.

        Chunks end at multiples of ``chunk_size`` (``reusable``). Sequences in
        prefill take turns at going first, so a short prompt behind a long one
        waits one chunk, not the whole long prefill."""
        work: list[_Work] = []
        prefilling: list[Sequence] = []
        for seq in self.sequences.values():
            if seq.kv is None:
                continue  # a later choice waiting for its first one's prefill
            if seq.processed < seq.prompt_len:
                prefilling.append(seq)
                continue
            drafts = self._propose(seq)
            inputs = [seq.tokens[-1], *drafts]
            work.append(_Work(seq, Segment(seq.kv, inputs, len(inputs)), drafts))
        if not prefilling:
            return work
        first = self._prefill_turn % len(prefilling)
        self._prefill_turn = first + 1
        budget = self._chunk_size
        for seq in prefilling[first:] + prefilling[:first]:
            begin = seq.processed // self._chunk_size * self._chunk_size  # where this chunk starts
            end = min(begin + self._chunk_size, seq.prompt_len)
            if end - seq.processed <= budget:
                assert seq.kv is not None
                budget -= end - seq.processed
                chunk = seq.prompt_ids[seq.processed : end]
                logits = 1 if end == seq.prompt_len else 0
                # After a prefix-cache hit inside a chunk only its tail runs, on the
                # path the whole chunk takes (Segment.chunk_tokens).
                segment = Segment(seq.kv, chunk, logits, chunk_tokens=end - begin)
                work.append(_Work(seq, segment, None))
        return work

    def _run(self, work: list[_Work], events: list[Event]) -> list[tuple[_Work, torch.Tensor | None]]:
        """The pass over ``work``; each item with its logits. A failing batched pass
        is retried item by item, and the items that fail alone get an error."""
        try:
            logits = self._runner.forward([item.segment for item in work])
            return list(zip(work, logits, strict=True))
        except Exception:
            if len(work) == 1:
                self._fail(work[0].seq, events)
                return []
            logger.warning("a batched pass of %d sequences failed; running them one by one", len(work))
        results: list[tuple[_Work, torch.Tensor | None]] = []
        for item in work:
            try:
                results.append((item, self._runner.forward([item.segment])[0]))
            except Exception:
                self._fail(item.seq, events)
        return results

    def _fail(self, seq: Sequence, events: list[Event]) -> None:
        """End ``seq`` with an internal error after its pass raised; its KV is
        dropped (it may be half-written)."""
        logger.exception("request %s failed", seq.request_id)
        if self.sequences.pop(seq.request_id, None) is not None:
            self._release(seq, keep_kv=False)
        exc = sys.exc_info()[1]
        events.append(
            RequestError(
                request_id=seq.request_id,
                code=ErrorCode.INTERNAL,
                message=f"CPU engine error: {type(exc).__name__}: {exc}",
            )
        )

    def _guarded(self, seq: Sequence, events: list[Event], action: Callable[..., None], *args: Any) -> None:
        """Run ``action(*args)`` for ``seq``; an exception ends ``seq`` alone."""
        try:
            action(*args)
        except RequestRejected as exc:  # the request's own fault (its grammar failed): its KV is sound
            logger.info("request %s rejected while decoding: %s", seq.request_id, exc.message)
            if self.sequences.pop(seq.request_id, None) is not None:
                self._release(seq, keep_kv=True)
            events.append(RequestError(seq.request_id, exc.code, exc.message, exc.param))
        except Exception:  # one request's failure must not end the others
            self._fail(seq, events)

    def _new_kv(self, seq: Sequence) -> SequenceKV:
        room = min(seq.out.max_new, INITIAL_DECODE_ROOM) + self._num_draft_tokens + 1
        # Positions never exceed the context: drafts are limited to fit in it.
        return self._runner.new_kv(min(seq.prompt_len + room, self._max_context))

    def _start(self, seq: Sequence, events: list[Event]) -> None:
        seq.t_start = time.perf_counter()
        seq.kv = self._new_kv(seq)
        cached = 0
        if self._prefix_cache.capacity_bytes > 0:
            hit = self._prefix_cache.lookup(seq.prompt_ids, seq.prompt_len - 1, seq.cache_salt)
            if hit is not None and self.reusable(hit.length):
                cached = self.reusable(hit.length)  # hit.length already is: whole blocks
                seq.kv.seed(hit.entry.kv, cached)
        seq.cached = seq.processed = cached
        events += opening(seq.request_id, seq.prompt_len, cached, 0)

    def _apply(self, item: _Work, logits: torch.Tensor | None, events: list[Event]) -> None:
        """What a pass's logits mean for one sequence: progress, tokens, finish."""
        seq = item.seq
        if item.drafts is None:
            self._prefilled(seq, len(item.segment.tokens), logits, events)
        else:
            assert logits is not None
            self._verify(seq, item.drafts, logits, events)

    def _prefilled(self, seq: Sequence, count: int, logits: torch.Tensor | None, events: list[Event]) -> None:
        seq.processed += count
        now = time.perf_counter()
        events.append(
            PrefillProgress(
                seq.request_id, seq.prompt_len, seq.cached, seq.processed, int((now - seq.t_start) * 1000)
            )
        )
        if seq.processed == seq.prompt_len:
            assert logits is not None
            seq.t_prefill_end = now
            for later in [s for s in self.sequences.values() if s.source is seq.source and s.kv is None]:
                self._guarded(later, events, self._follow, later, seq, logits[-1], events)
            token, scored = self._choose(seq, logits[-1])
            text, reason = seq.out.append(token, scored)
            self._settle_rewind(seq)
            self._report(seq, text, reason, events)

    def _follow(self, seq: Sequence, first: Sequence, logits: torch.Tensor, events: list[Event]) -> None:
        """Start ``seq``, a later choice, from ``first``, which has just prefilled
        their prompt: its prompt KV copied, its last prompt ``logits`` sampled with
        ``seq``'s own sampler (module docstring)."""
        assert first.kv is not None and first.kv.length == seq.prompt_len
        seq.t_start = seq.t_prefill_end = time.perf_counter()
        seq.kv = self._new_kv(seq)
        seq.kv.seed(first.kv.view(), seq.prompt_len)
        seq.cached = seq.processed = seq.prompt_len
        events += opening(seq.request_id, seq.prompt_len, seq.cached, 0)
        token, scored = self._choose(seq, logits.clone())  # the sampler may work in place
        text, reason = seq.out.append(token, scored)
        self._settle_rewind(seq)
        self._report(seq, text, reason, events)

    def _propose(self, seq: Sequence) -> list[int]:
        """Drafted tokens to verify after ``seq``'s last token (n-gram drafting),
        within its completion budget (so within the context) and the grammar."""
        if seq.drafter is None:
            return []
        out = seq.out
        room = min(self._num_draft_tokens, out.max_new - out.num_output - 1)
        drafts = seq.drafter.propose(room)
        if drafts and out.constraint is not None and (out.splitter is None or not out.splitter.free):
            drafts = drafts[: out.constraint.valid_prefix(drafts)]
        return drafts

    def _verify(self, seq: Sequence, drafts: list[int], logits: torch.Tensor, events: list[Event]) -> None:
        """Sample each fed position in order; a draft is accepted while it equals
        the target's own choice. ``logits``: ``[1 + len(drafts), vocab]``."""
        assert seq.kv is not None
        out = seq.out
        history_len = len(seq.tokens)
        pieces: list[str] = []
        reason: FinishReason | None = None
        accepted = 0
        for position in range(len(drafts) + 1):
            token, scored = self._choose(seq, logits[position])
            is_draft = position < len(drafts) and token == drafts[position]
            text, reason = out.append(token, scored)
            pieces.append(text)
            if not is_draft:
                break  # the target's own token: correction or bonus
            accepted += 1
            if reason is not None:
                break  # drafts past a stop are rejected
        seq.draft_accepted += accepted
        seq.draft_rejected += len(drafts) - accepted
        # Positions fed: tokens[-1] and the drafts; keep the last token and the accepted drafts.
        # After a banned string's rewind, all but the last kept token (it is fed next).
        seq.kv.truncate(len(seq.tokens) - 1 if out.rewound else history_len + accepted)
        out.rewound = False
        self._report(seq, "".join(pieces), reason, events)

    def _choose(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, Scored | None]:
        """The token for one position's logits, within the grammar, and its score
        when the request asked for logprobs."""
        out = seq.out
        forbidden = self._forbidden(out)
        if out.banned is not None and out.banned.blocked():
            # After a banned string's rewind: its first token may not come again here.
            forbidden = (
                torch.zeros(self._vocab_size, dtype=torch.bool) if forbidden is None else forbidden.clone()
            )
            forbidden[torch.tensor(out.banned.blocked(), dtype=torch.long)] = True
        if out.trail is None:
            return seq.sampler.sample(logits, forbidden), None
        assert out.params.logprobs is not None
        scored = seq.sampler.sample_scored(logits, out.params.logprobs, forbidden)
        return scored.token, scored

    def _forbidden(self, out: SequenceOutput) -> torch.Tensor | None:
        """``[vocab]`` bool, the tokens the sequence may not sample next (``None``: any):
        the grammar's, on the answer only; with a reasoning splitter, all but the forced
        token once the thinking budget is spent (``engine_worker.reasoning``)."""
        splitter = out.splitter
        if splitter is None:
            return out.constraint.forbidden() if out.constraint is not None else None
        forced = splitter.forced()
        if forced is not None:
            only = torch.ones(self._vocab_size, dtype=torch.bool)
            only[forced] = False
            return only
        forbidden = None
        if out.constraint is not None and not splitter.free:
            forbidden = out.constraint.forbidden()
            allowed = splitter.allow_with_grammar
            if allowed is not None:
                forbidden[allowed] = False
        banned = splitter.banned()
        if banned is not None:
            if forbidden is None:
                forbidden = torch.zeros(self._vocab_size, dtype=torch.bool)
            forbidden[banned] = True
        return forbidden

    def _settle_rewind(self, seq: Sequence) -> None:
        """The KV after a first token's rewind: the prompt but its last token, which
        the next pass feeds again."""
        if seq.out.rewound:
            assert seq.kv is not None
            seq.kv.truncate(len(seq.tokens) - 1)
            seq.out.rewound = False

    def _report(self, seq: Sequence, text: str, reason: FinishReason | None, events: list[Event]) -> None:
        """Emit the deltas for ``text`` and, when ``reason`` is set, finish the sequence."""
        deltas, reason = seq.out.deltas(text, reason)
        events += deltas
        if reason is not None:
            self._finish(seq, reason, events)

    def _finish(self, seq: Sequence, reason: FinishReason, events: list[Event]) -> None:
        now = time.perf_counter()
        drafting = seq.drafter is not None
        events.append(
            Finished(
                request_id=seq.request_id,
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
                cached_tokens=seq.cached,
                completion_tokens=seq.out.num_output,
                draft_accepted=seq.draft_accepted if drafting else None,
                draft_rejected=seq.draft_rejected if drafting else None,
                time_queued=seq.t_start - seq.t_added,
                time_prefill=seq.t_prefill_end - seq.t_start,
                time_decode=now - seq.t_prefill_end,
                reasoning_tokens=seq.out.reasoning_tokens,
            )
        )
        del self.sequences[seq.request_id]
        self._release(seq, keep_kv=True)

    def _release(self, seq: Sequence, keep_kv: bool) -> None:
        """Drop ``seq``'s KV; with ``keep_kv``, its prompt's whole blocks go into
        the prefix cache (``reusable``)."""
        kv, seq.kv = seq.kv, None
        if kv is None or not keep_kv or self._prefix_cache.capacity_bytes == 0:
            return
        length = self.reusable(min(seq.processed, kv.length))
        if length:
            kv.truncate(length)
            self._prefix_cache.insert(seq.prompt_ids[:length], kv.export(), seq.cache_salt)

    def reusable(self, positions: int) -> int:
        """How many of a prompt's first ``positions`` computed positions a later
        prompt may reuse: whole blocks (``BLOCK_TOKENS`` positions, or the chunk
        when ``chunk_size`` is smaller).

        A prompt is cut into chunks at multiples of ``chunk_size`` from its first
        token, whatever is cached, and the dense weights cut a chunk's rows at
        block boundaries (``llama.BLOCK_TOKENS``), so the positions after a hit
        meet the same kernels as without it; their bits may still differ in the
        last place where a kernel's row depends on the rows beside it
        (``docs/performance.md#batch-invariance``;
        ``tests/unit/engine_worker/cpu/test_cpu_engine.py`` checks the output of
        a hit inside a chunk of the embedded model's shape). Generated tokens are
        never reused: their KV came from decode, not prefill."""
        return positions // self._block * self._block
