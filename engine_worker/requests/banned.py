"""Banned strings (TabbyAPI's ``banned_strings``) as ExLlamaV3 1.6.5's ``Job``
enforces them, for the CPU engine: text that may be the start of a banned
string is held back; when a banned string is complete, the sequence is rewound
to the token where the match began and that position is sampled again with
every token already tried there banned.

The rule, read in ``exllamav3/generator/job.py`` (``set_checkpoint``,
``rewind_checkpoint`` and the ``partial_strings_match`` branch of the token
loop) and ``exllamav3_ext/generator/strings.cpp`` (``partial_strings_match``):

- matching is case-insensitive (both sides lowercased) over the text held back;
- if a banned string starts in the held text and runs off its end before any
  complete one starts, the text is held and a checkpoint is set at the token
  that began the hold (the text held before it and the token, "explored");
- if a complete banned string starts first, the sequence goes back to the
  checkpoint: the text held before it is released, the tokens since are
  dropped, and the next token (at the checkpoint's position) may not be any
  explored one; the checkpoint stays, so a second failure there bans one more;
- otherwise the held text is released and the checkpoint dropped.

``BannedStrings.feed`` applies it to one token's text; the engine does the
rewind (``engine_worker.cpu.backend``). Every rewind bans one more token at a
position, so a request makes progress; ``MAX_REWINDS`` bounds the total anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_REWINDS = 4096
"""Most rewinds of one sequence; beyond it the sequence ends (``BannedStrings.exhausted``)."""


@dataclass(slots=True)
class Checkpoint:
    """Where a possible banned string began: ``position`` (output tokens before
    it), the held text before it, the detokenizer's state before it
    (``state``, opaque here), the tokens tried at that position (``explored``)
    and how many tokens were taken since (``offset``, 0 right after a rewind)."""

    position: int
    held: str
    state: Any
    explored: list[int] = field(default_factory=list)
    offset: int = 1


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do after one token: emit ``emit``; with ``rewind``, first go
    back to ``rewind.position`` output tokens (restoring ``rewind.state``)."""

    emit: str
    rewind: Checkpoint | None = None


def match(text: str, strings: tuple[str, ...]) -> int:
    """``partial_strings_match``: the start of the earliest complete match in
    ``text``, ``-2`` when a match that runs off the end of ``text`` starts
    earlier than any complete one, ``-1`` for neither."""
    best_full = best_partial = len(text) + 1
    for s in strings:
        limit = min(best_full, best_partial)
        for start in range(min(len(text), limit)):
            k = 0
            while start + k < len(text) and k < len(s) and text[start + k] == s[k]:
                k += 1
            if k == len(s):
                best_full = start
                break
            if start + k == len(text):
                best_partial = start
                break
    if best_partial < best_full:
        return -2
    return best_full if best_full <= len(text) else -1


class BannedStrings:
    """The banned-string state of one sequence (module docstring)."""

    def __init__(self, strings: tuple[str, ...]) -> None:
        self._strings = tuple(s.lower() for s in strings if s)
        self._held = ""
        self.checkpoint: Checkpoint | None = None
        self.rewinds = 0

    @property
    def exhausted(self) -> bool:
        return self.rewinds >= MAX_REWINDS

    def blocked(self) -> list[int]:
        """Tokens the next position may not take: those explored at a checkpoint
        just rewound to."""
        cp = self.checkpoint
        return cp.explored if cp is not None and cp.offset == 0 else []

    def feed(self, text: str, token: int, position: int, state: Any) -> Verdict:
        """One output token: its ``text`` (may be empty), id, index in the output
        and the detokenizer's state before it."""
        before = self._held
        self._held += text
        found = match(self._held.lower(), self._strings)
        if found == -1:
            self.checkpoint = None
            out, self._held = self._held, ""
            return Verdict(out)
        cp = self.checkpoint
        if cp is None:
            cp = self.checkpoint = Checkpoint(position, before, state, [token])
        else:
            cp.offset += 1
            if cp.offset == 1:
                cp.explored.append(token)
        if found == -2:
            return Verdict("")
        self.rewinds += 1
        released, self._held = cp.held, ""
        cp.held, cp.offset = "", 0
        return Verdict(released, cp)

    def flush(self) -> str:
        """The held text, when the sequence ends (no banned string is complete in it)."""
        out, self._held = self._held, ""
        return out
