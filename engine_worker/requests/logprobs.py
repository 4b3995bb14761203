"""Per-token log-probabilities aligned with the text a sequence emits.

A ``TokenDelta`` carries one ``TokenLogprob`` per token whose text it holds, and
their ``token`` strings join to exactly its ``text``. Text reaches a delta
through two hold-backs (``detokenize``): the detokenizer releases nothing while
a UTF-8 character is incomplete, and the stop-string matcher holds a tail that
may begin a stop string. ``LogprobTrail`` follows both:

- each token is given the text the detokenizer released when it was added;
  tokens it held get ``""`` and the token that completes them the whole text
  (``TokenLogprob``'s contract);
- the released text is a stream; each token owns a span of it. A token is
  reported once the stop matcher has emitted its whole span, and tokens with
  an empty span together with the next token that has text. A delta's text
  is cut at the last reported token's end, so text the matcher emitted past it
  waits for the next delta;
- at the end, a stop string cuts the stream: tokens that start before the cut
  keep the part before it, the rest are dropped; without one, every token left
  is reported.

Stop tokens (EOS, ``stop_token_ids``) add no text and get no entry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from protocol.messages import TokenLogprob, TopLogprob


@dataclass(frozen=True, slots=True)
class Scored:
    """A chosen token with its log-probability and the ``top`` most likely
    ``(token, logprob)`` of the same distribution, most likely first (tokens with
    probability 0 are never listed, so there may be fewer than asked)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


TokenInfo = Callable[[int], tuple[str, bytes]]
"""A token id to its text (its bytes decoded, invalid UTF-8 replaced) and raw bytes."""


@dataclass(eq=False, slots=True)
class _Entry:
    scored: Scored
    start: int = 0  # its span of the released text stream, in characters
    end: int = 0


class LogprobTrail:
    """The scored tokens of one sequence, waiting to be reported with their text.

    Call ``add`` for every token that goes through the detokenizer, with the text
    it released; ``released_tail`` with the detokenizer's ``flush``; ``emitted``
    with all text the stop matcher emits; ``take`` when a delta is built.
    """

    def __init__(self, info: TokenInfo) -> None:
        self._info = info
        self._held: list[_Entry] = []  # tokens whose text the detokenizer still holds
        self._fed: deque[_Entry] = deque()  # tokens with a span, not reported yet
        self._released = 0  # characters of the stream so far
        self._emitted = 0  # characters of the stream the stop matcher has emitted
        self._reported = 0  # characters of the stream reported in deltas
        self._pending = ""  # the stream from _reported to _emitted

    def add(self, scored: Scored, released: str) -> None:
        """A token whose addition made the detokenizer release ``released``."""
        self._held.append(_Entry(scored))
        if released:
            self._assign(released)

    def released_tail(self, text: str) -> None:
        """What the detokenizer released at the end of generation (``flush``)."""
        self._assign(text)

    def emitted(self, text: str) -> None:
        """Text the stop matcher let through, in order."""
        self._pending += text
        self._emitted += len(text)

    def take(self, final: bool = False, cut: bool = False) -> tuple[str, tuple[TokenLogprob, ...]]:
        """The text and entries of the next delta. ``final``: generation ended, so
        everything emitted is reported; ``cut``: it ended on a stop string, which
        starts where the emitted text ends."""
        if final:
            self._assign("")  # tokens still held released nothing
            # With a stop string, the tokens at or past it are dropped.
            count = sum(1 for e in self._fed if e.start < self._emitted) if cut else len(self._fed)
        else:
            # Up to the last token with text that was emitted whole.
            count = 0
            for i, entry in enumerate(self._fed):
                if entry.end > self._emitted:
                    break
                if entry.end > entry.start:
                    count = i + 1
        entries: list[TokenLogprob] = []
        boundary = self._reported
        for _ in range(count):
            entry = self._fed.popleft()
            end = min(entry.end, self._emitted)
            text = self._pending[entry.start - self._reported : end - self._reported]
            entries.append(self._entry(entry.scored, text))
            boundary = end
        if final:
            self._fed.clear()
        text = self._pending[: boundary - self._reported]
        self._pending = self._pending[boundary - self._reported :]
        self._reported = boundary
        return text, tuple(entries)

    def _assign(self, text: str) -> None:
        """Spans for the held tokens: ``""`` for all but the last, which gets ``text``."""
        for entry in self._held:
            entry.start = entry.end = self._released
            self._fed.append(entry)
        if self._held:
            self._held[-1].end += len(text)
        self._released += len(text)
        self._held.clear()

    def _entry(self, scored: Scored, text: str) -> TokenLogprob:
        _, token_bytes = self._info(scored.token)
        top = tuple(TopLogprob(*self._top(token, logprob)) for token, logprob in scored.top)
        return TokenLogprob(text, scored.logprob, token_bytes, top)

    def _top(self, token: int, logprob: float) -> tuple[str, float, bytes]:
        text, token_bytes = self._info(token)
        return text, logprob, token_bytes
