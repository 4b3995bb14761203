"""One sequence's output pipeline: sampled token ids in, ``TokenDelta`` text out.

Each token goes, in order, through the end-of-sequence ids, the reasoning
``Splitter`` (thinking to its own detokenizer and ``Channel.REASONING`` deltas,
markers nowhere), and for the answer: the grammar's matcher, the incremental
detokenizer, banned strings (which may rewind the sequence), the logprob trail and
the client's stop strings (from ``min_tokens`` on). ``SequenceOutput.deltas`` then
says what reaches the client: thinking first, then the answer text held back by
none of them, and at the end of the sequence what they still hold.

The backend owns sampling and the KV cache: it feeds ``append`` the token it chose
(with its ``Scored`` when the request asked for logprobs), learns from
``rewound`` that a banned string rolled the sequence back (then its KV follows),
and reads ``constraint``/``splitter`` to mask the next token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine_worker.constraints import TokenConstraint
from engine_worker.reasoning import Splitter
from engine_worker.requests.banned import BannedStrings
from engine_worker.requests.detokenize import IncrementalDetokenizer
from engine_worker.requests.logprobs import LogprobTrail, Scored
from engine_worker.requests.stops import StopMatcher
from protocol.messages import Channel, FinishReason, SamplingParams, TokenDelta


@dataclass(eq=False)
class SequenceOutput:
    """The output state of one sequence. ``tokens`` is the prompt and the output
    so far (``tokens[prompt_len:]`` the output); ``observe(token)`` tells the
    sampler and drafter of each appended token, ``restart(output)`` the sampler of
    a rewind (the output it goes on from)."""

    request_id: str
    params: SamplingParams
    prompt_len: int
    max_new: int  # completion budget (Prepared.max_new_tokens)
    stop_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    stopper: StopMatcher
    observe: Callable[[int], None]
    restart: Callable[[list[int]], None]
    tokens: list[int]
    constraint: TokenConstraint | None = None  # the grammar, when the request has one
    trail: LogprobTrail | None = None  # when the request asked for logprobs
    banned: BannedStrings | None = None  # when the request has banned strings
    splitter: Splitter | None = None  # thinking vs answer, with a reasoning parser
    thinker: IncrementalDetokenizer | None = None  # the thinking's own text, with a splitter
    rewound: bool = False  # a banned string rewound it during the last token
    unreported: int = 0  # output tokens not yet counted in a TokenDelta
    thinking: list[str] = field(default_factory=list)  # thinking text not yet in a TokenDelta
    unreported_thinking: int = 0  # of `unreported`, thinking tokens (markers included)
    unsplit: list[Scored | None] = field(default_factory=list)  # scores of tokens the splitter holds

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def reasoning_tokens(self) -> int:
        return self.splitter.reasoning_tokens if self.splitter is not None else 0

    def append(self, token: int, scored: Scored | None = None) -> tuple[str, FinishReason | None]:
        """Add one generated token (``scored`` when logprobs are on); returns its
        emittable answer text and the finish reason if generation ends with it
        (thinking text waits in ``thinking`` for ``deltas``)."""
        self.tokens.append(token)
        self.unreported += 1
        self.observe(token)
        if token in self.stop_ids:
            # Stop and end-of-sequence tokens contribute no text.
            return "", FinishReason.STOP
        if self.splitter is None:
            emit, stopped = self._answer(token, scored)
        else:
            self.unsplit.append(scored)
            emit, stopped = self._split(self.splitter.feed(token))
        if stopped:
            return emit, FinishReason.STOP
        if self.num_output >= self.max_new:
            return emit, FinishReason.LENGTH
        return emit, None

    def deltas(self, text: str, reason: FinishReason | None) -> tuple[list[TokenDelta], FinishReason | None]:
        """The deltas for ``text`` (after one for the thinking, if any) and the finish
        reason, which a stop string in the released tail turns into ``stop``; with
        ``reason`` set, everything held back is released or dropped."""
        out: list[TokenDelta] = []
        if self.splitter is not None:
            if reason is not None and not self.stopper.stopped:
                held, _ = self._split(self.splitter.flush())  # a marker that never completed
                text += held
            if reason is not None and self.thinker is not None:
                self.thinking.append(self.thinker.flush())
            thinking = "".join(self.thinking)
            self.thinking.clear()
            if thinking:
                out.append(
                    TokenDelta(self.request_id, thinking, self.unreported_thinking, channel=Channel.REASONING)
                )
                self.unreported -= self.unreported_thinking
                self.unreported_thinking = 0
        if reason is not None and not self.stopper.stopped:
            # Generation ended without a stop string: release held-back text.
            tail = (self.banned.flush() if self.banned is not None else "") + self.detokenizer.flush()
            emit, stopped = self.stopper.feed(tail) if tail else ("", False)
            released = emit if stopped else emit + self.stopper.flush()
            text += released
            if self.trail is not None:
                self.trail.released_tail(tail)
                self.trail.emitted(released)
            if stopped:
                reason = FinishReason.STOP
        if self.trail is not None:
            # Cut at a token boundary: the rest of `text` comes with the next delta.
            text, logprobs = self.trail.take(final=reason is not None, cut=self.stopper.stopped)
            if text or logprobs:
                out.append(
                    TokenDelta(self.request_id, text, self.unreported - self.unreported_thinking, logprobs)
                )
                self.unreported = self.unreported_thinking
        elif text:
            out.append(TokenDelta(self.request_id, text, self.unreported - self.unreported_thinking))
            self.unreported = self.unreported_thinking
        return out, reason

    def _split(self, settled: list[tuple[Channel | None, int]]) -> tuple[str, bool]:
        """Route the tokens a splitter settled: thinking to ``thinking``, markers
        nowhere, the answer through ``_answer``; ``(answer text, stopped)``."""
        emit = ""
        for channel, token in settled:
            scored = self.unsplit.pop(0) if self.unsplit else None
            if channel is Channel.CONTENT:
                text, stopped = self._answer(token, scored)
                emit += text
                if stopped:
                    return emit, True
                continue
            self.unreported_thinking += 1
            if channel is Channel.REASONING:
                assert self.thinker is not None
                if text := self.thinker.add(token):
                    self.thinking.append(text)
        return emit, False

    def _answer(self, token: int, scored: Scored | None) -> tuple[str, bool]:
        """One answer token through the grammar, the detokenizer, logprobs and stop
        strings: ``(emittable text, stopped)`` (a stop string, or the grammar complete)."""
        complete = False
        if self.constraint is not None:
            self.constraint.consume(token)
            complete = self.constraint.stopped
        if self.banned is not None:
            state = self.detokenizer.state()
            verdict = self.banned.feed(self.detokenizer.add(token), token, self.num_output - 1, state)
            text = verdict.emit
            if verdict.rewind is not None:
                self._rewind(verdict.rewind.position, verdict.rewind.state)
                if self.banned.exhausted:
                    emit, _ = self.stopper.feed(text) if text else ("", False)
                    return emit, True
        else:
            text = self.detokenizer.add(token)
        if self.trail is not None:
            assert scored is not None
            self.trail.add(scored, text)
        emit, stopped = (
            self.stopper.feed(text, check=self.num_output >= self.params.min_tokens) if text else ("", False)
        )
        if self.trail is not None:
            self.trail.emitted(emit)
        return emit, stopped or complete

    def _rewind(self, position: int, state: Any) -> None:
        """Back to ``position`` output tokens (a banned string began after them):
        the tokens since dropped, the sampler and detokenizer as they were then;
        the backend's KV follows (``rewound``)."""
        dropped = self.num_output - position
        del self.tokens[self.prompt_len + position :]
        self.unreported = max(0, self.unreported - dropped)
        self.restart(self.tokens[self.prompt_len :])
        self.detokenizer.restore(state)
        self.rewound = True
