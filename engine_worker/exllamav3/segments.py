"""The pages ExLlamaV3 1.6.5 allocates for a job, segment by segment: what the
worker reserves for it, so that a job the loop admits finds its pages free.

A job's first segment is its prompt and its completion; with output chunking
(``max_rq_tokens``) 1.6.5 re-queues a long completion with the sequence so far as
the new prompt (``job.py:1240-1261``), and each such segment takes pages anew.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_worker.options.exllamav3 import PAGE_SIZE


@dataclass(frozen=True, slots=True)
class Segment:
    """What the engine reserves for a job's current segment: its prompt (the
    client's, or the sequence so far after a re-queue), the completion tokens it may
    still produce, the ``max_rq_tokens`` passed (``None``: no re-queue)."""

    prompt: int
    max_new: int
    rq: int | None


def pages(tokens: int) -> int:
    """``tokens`` rounded up to whole pages, in tokens."""
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


@dataclass(frozen=True, slots=True)
class SegmentSizes:
    """The engine's numbers a segment's size depends on: ``max_rq_tokens`` (``None``
    without output chunking), the draft window, the re-queue boundary (a page, or the
    recurrent checkpoint interval) and the cache, tokens."""

    max_rq_tokens: int | None
    draft_tokens: int
    rq_boundary: int
    cache_tokens: int

    def first(self, prompt_tokens: int, max_new: int) -> Segment:
        """The first segment of a job: ``max_rq_tokens`` only where it makes the engine
        reserve less than the whole completion does."""
        rq = self.max_rq_tokens
        if rq is not None and self.tokens(Segment(prompt_tokens, max_new, rq)) >= (
            self.tokens(Segment(prompt_tokens, max_new, None))
        ):
            rq = None
        return Segment(prompt_tokens, max_new, rq)

    def tokens(self, seg: Segment) -> int:
        """The pages, in tokens, 1.6.5 allocates for a job segment when it starts
        (``Job.prepare_for_queue``, ``job.py:1288-1324``; ``Sequence.prepare``,
        ``pagetable.py:240-248``): the prompt plus, with ``max_rq_tokens``, its budget
        (``budget``), else the whole completion plus one token; plus the draft window
        either way. Prompt pages that other running jobs
        hold count too (1.6.5 shares them), so this is an upper bound."""
        window = seg.max_new + 1 if seg.rq is None else self.budget(seg)
        return pages(seg.prompt + window + self.draft_tokens)

    def budget(self, seg: Segment) -> int:
        """Completion tokens of a segment with ``max_rq_tokens`` before it re-queues: up to
        the next boundary (a page, or the recurrent checkpoint interval) past
        ``prompt - 1 + max_rq_tokens``, at most the cache minus the draft window
        (``job.py:1295-1306``)."""
        assert seg.rq is not None
        step = self.rq_boundary
        end = min(-(-(seg.prompt - 1 + seg.rq) // step) * step, self.cache_tokens - self.draft_tokens)
        return max(1, end - seg.prompt)

    def requeued(self, seg: Segment) -> Segment:
        """The segment after a re-queue: 1.6.5 re-queues a job once it has sampled one
        token past its segment's budget (``job.py:815``), with everything so far as the
        new prompt and the same ``max_rq_tokens`` (``job.py:1240-1261``). A job without
        ``max_rq_tokens`` never re-queues (its budget is its whole completion plus the draft
        window, ``job.py:1318-1322``)."""
        if seg.rq is None:
            return seg
        budget = self.budget(seg)
        return Segment(seg.prompt + budget + 1, max(1, seg.max_new - budget - 1), seg.rq)
