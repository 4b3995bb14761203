"""A splitter for engines that hand back text, not tokens (ExLlamaV3's ``Job``
streams decoded text, held back for stop strings and UTF-8, together with the
ids it came from): the ids go through the ``Splitter``, the text is cut where
the ids' channel changes.

Where a change falls in the text is the length of the decoded output up to
that token (``decode``, special tokens as their text, as the job decodes);
it is computed at changes only (a request has one or two), so the cost is a
decode or two per request. Text past the last settled token is held while the
splitter holds a possible marker. A marker's text is dropped, never shown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine_worker.reasoning.base import Splitter
from protocol.messages import Channel

Piece = tuple[Channel, str, int]
"""Text of one channel and the tokens it is credited with."""


class TextSplitter:
    """One sequence's split over (ids, text) results; ``decode`` decodes ids as the
    engine's text does."""

    def __init__(self, splitter: Splitter, decode: Callable[[Sequence[int]], str]) -> None:
        self.splitter = splitter
        self._decode = decode
        self._ids: list[int] = []
        self._settled = 0  # tokens of _ids the splitter has settled
        self._state: Channel | bool | None = False  # channel of the last settled token; False: none yet
        self._cuts: list[tuple[int, Channel | None]] = []  # (char position, channel from there)
        self._released = 0  # chars of the engine's text consumed
        self._held = ""  # engine text past the settled tokens, waiting for the splitter
        self._uncredited: dict[Channel, int] = {Channel.CONTENT: 0, Channel.REASONING: 0}
        self._extras: list[object] = []  # what came with each token the splitter has not settled
        self._answer_extras: list[object] = []

    def feed(
        self, ids: Sequence[int], text: str, final: bool = False, extras: Sequence[object] | None = None
    ) -> list[Piece]:
        """The pieces of one result (``ids`` sampled, ``text`` released by the engine);
        ``final`` at the sequence's end (held tokens settle as they are). ``extras``, one
        per id (its logprob entry), are kept for the answer's tokens (``answer_extras``)."""
        for i, token in enumerate(ids):
            self._ids.append(token)
            self._extras.append(extras[i] if extras is not None and i < len(extras) else None)
            self._settle(self.splitter.feed(token))
        if final:
            self._settle(self.splitter.flush())
        text = self._held + text
        start = self._released - len(self._held)
        limit = len(text)
        if not final and len(self._ids) > self._settled:
            # Text of tokens not settled yet may be a marker's: hold it.
            limit = max(0, min(limit, len(self._decode(self._ids[: self._settled])) - start))
        self._held = text[limit:]
        self._released = start + len(text)
        return self._pieces(text[:limit], start)

    def _settle(self, settled: list[tuple[Channel | None, int]]) -> None:
        for channel, _ in settled:
            if channel != self._state:
                at = len(self._decode(self._ids[: self._settled])) if self._settled else 0
                self._cuts.append((at, channel))
                self._state = channel
            self._settled += 1
            self._uncredited[channel or Channel.REASONING] += 1
            extra = self._extras.pop(0) if self._extras else None
            if channel is Channel.CONTENT and extra is not None:
                self._answer_extras.append(extra)

    def answer_extras(self) -> list[object]:
        """The ``extras`` of the answer's tokens settled since the last call, in order
        (thinking and marker tokens' are dropped)."""
        out, self._answer_extras = self._answer_extras, []
        return out

    def _pieces(self, text: str, start: int) -> list[Piece]:
        out: list[Piece] = []
        end = start + len(text)
        for i, (at, channel) in enumerate(self._cuts):
            until = self._cuts[i + 1][0] if i + 1 < len(self._cuts) else end
            a, b = max(at, start), min(until, end)
            if a < b and channel is not None:
                part = text[a - start : b - start]
                out.append((channel, part, self._uncredited[channel]))
                self._uncredited[channel] = 0
        # Cuts wholly before this text are done with (keep the last: it continues).
        while len(self._cuts) > 1 and self._cuts[1][0] <= end:
            self._cuts.pop(0)
        merged: list[Piece] = []
        for p in out:
            if merged and merged[-1][0] is p[0]:
                merged[-1] = (p[0], merged[-1][1] + p[1], merged[-1][2] + p[2])
            else:
                merged.append(p)
        return merged
