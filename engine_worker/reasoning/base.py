"""What every reasoning family shares: the vocabulary view, the per-request plan,
and the splitter that sorts a sequence's tokens into thinking and answer.

A family's markers are token-id sequences of the model's own vocabulary (one id
each where the tokenizer has the marker as a token: ``<think>`` 151667 in
Qwen3, ``[THINK]`` in Magistral's tekken; several ids where it does not, e.g.
``</think>`` on a model without that token). Splitting compares ids, never text:
a marker the model writes as its token is recognised even when a stream cuts
it across deltas (its ids are held until the match resolves and never shown),
and a client or a model spelling ``</think>`` out in other tokens is just text.

``Splitter.feed`` takes each sampled token and returns the tokens it is done
with, in order, each with its ``Channel``, or ``None`` for a marker token it
swallowed (counted as a reasoning token, ``reasoning_tokens``). ``forced``
names the token the engine must emit next (the budget is spent: the end
marker is written for the model), ``banned`` one it must not (no thinking:
the opening marker), and ``free`` says whether a grammar must stay off (the
thinking is never constrained).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.messages import Channel

Released = list[tuple[Channel | None, int]]
"""Tokens a splitter is done with, in the order fed, each with its channel, or
``None`` for a marker token it swallowed (never shown, counted as reasoning)."""

_BLANK_TAIL = 4
"""Trailing blank tokens (newlines) skipped when reading where a prompt leaves the span."""


class Vocab(Protocol):
    """The model's vocabulary as a family needs it."""

    def token_id(self, text: str) -> int | None:
        """The id of the one token whose text is ``text``, ``None`` when there is none."""
        ...

    def encode(self, text: str) -> list[int]:
        """``text`` as ids, special-token strings matched as tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens as their text."""
        ...


class VocabFromTables:
    """A ``Vocab`` over an engine's own tables: ``pieces`` (id -> the token's text),
    an ``encode`` and a ``decode``."""

    def __init__(
        self,
        pieces: Sequence[str],
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        specials: dict[str, int] | None = None,
    ) -> None:
        self._ids: dict[str, int] = dict(specials or {})
        for i, piece in enumerate(pieces):
            # Markers are ASCII without spaces: only such pieces need a reverse entry.
            if piece and piece.isascii() and not piece.isspace() and piece[0] in "<[":
                self._ids.setdefault(piece, i)
        self._encode = encode
        self._decode = decode

    def token_id(self, text: str) -> int | None:
        return self._ids.get(text)

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(ids)


class Mode(enum.Enum):
    OPEN = 1  # before any output: the model may open the span
    INSIDE = 2  # in the span: tokens are thinking
    AFTER = 3  # the span is closed (or never opened): tokens are the answer


class Splitter(abc.ABC):
    """One sequence's thinking/answer split (module docstring)."""

    reasoning_tokens: int = 0

    @abc.abstractmethod
    def feed(self, token: int) -> Released:
        """The tokens ``token`` settles (itself, held ones, or none while a marker may be starting)."""

    @abc.abstractmethod
    def flush(self) -> Released:
        """Held tokens at the end of the sequence (a marker that never completed)."""

    @abc.abstractmethod
    def forced(self) -> int | None:
        """The token the engine must emit next, ``None`` when the model chooses."""

    @abc.abstractmethod
    def banned(self) -> int | None:
        """A token the model may not emit next, ``None`` for none."""

    @property
    @abc.abstractmethod
    def free(self) -> bool:
        """The next token is (or may open) thinking: no grammar applies to it."""

    @property
    def allow_with_grammar(self) -> int | None:
        """A token allowed next beside what a grammar allows (the opening marker while the
        model may still open the span), ``None`` for none."""
        return None


@dataclass(frozen=True, slots=True)
class Markers:
    """A span family's markers in one vocabulary: ``start`` opens the span, ``end``
    closes it; an ``exits`` sequence closes it too and is the answer's own text
    (Qwen3's ``<tool_call>``)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    exits: tuple[tuple[int, ...], ...] = ()


class Parser(abc.ABC):
    """A family bound to one vocabulary: plans requests, makes splitters."""

    name: str
    not_stops: frozenset[int] = frozenset()
    """Ids the engine must not treat as the end of the turn (Harmony's ``<|end|>``
    ends a message, not the answer)."""

    @abc.abstractmethod
    def plan(self, prompt_ids: list[int], budget: int | None) -> Plan:
        """Where ``prompt_ids`` leaves the model and what a ``budget`` of thinking tokens
        (``None``: no limit; ``0``: none) changes in it."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One request's reasoning: its prompt (the span closed in it when thinking is
    off), and a maker of each choice's splitter."""

    prompt_ids: list[int]
    new_splitter: Callable[[], Splitter] = field(repr=False)


def prompt_state(
    prompt_ids: Sequence[int], markers: Markers, decode: Callable[[Sequence[int]], str]
) -> Mode | None:
    """Whether the prompt ends inside the span (the template opened it at the
    generation prompt: ``INSIDE``), after it (the template closed it, as Qwen3's
    ``enable_thinking=false`` writes ``<think>\\n\\n</think>\\n\\n``: ``AFTER``), or
    neither (``None``); trailing blank tokens are skipped."""
    end = len(prompt_ids)
    for _ in range(_BLANK_TAIL):
        if end and not decode(prompt_ids[end - 1 : end]).strip():
            end -= 1
        else:
            break
    tail = tuple(prompt_ids[:end])
    if markers.start and tail[-len(markers.start) :] == markers.start:
        return Mode.INSIDE
    if markers.end and tail[-len(markers.end) :] == markers.end:
        return Mode.AFTER
    return None


class SpanParser(Parser):
    """A family that thinks in one span at the start of its output
    (``<think>``...``</think>``, ``[THINK]``...``[/THINK]``). ``starts_inside``: a
    prompt that does not say otherwise leaves the model in the span (DeepSeek-R1,
    whose templates and models do not always write ``<think>``)."""

    def __init__(
        self, name: str, markers: Markers, decode: Callable[[Sequence[int]], str], starts_inside: bool
    ) -> None:
        self.name = name
        self.markers = markers
        self._decode = decode
        self._starts_inside = starts_inside

    def plan(self, prompt_ids: list[int], budget: int | None) -> Plan:
        state = prompt_state(prompt_ids, self.markers, self._decode)
        mode = state or (Mode.INSIDE if self._starts_inside else Mode.OPEN)
        if budget == 0 and mode is Mode.INSIDE:
            # No thinking: the span the prompt opened is closed in the prompt, before
            # the first token (no completion token is spent on it).
            prompt_ids = [*prompt_ids, *self.markers.end]
            mode = Mode.AFTER
        markers = self.markers
        return Plan(prompt_ids, lambda: SpanSplitter(markers, mode, budget))


class SpanSplitter(Splitter):
    """``SpanParser``'s splitter: markers matched as id sequences, a partial match held."""

    def __init__(self, markers: Markers, mode: Mode, budget: int | None) -> None:
        self._m = markers
        self._mode = mode
        self._budget = budget
        self._pending: list[int] = []
        self._fresh = True  # nothing released yet: an opening marker is still the span's
        self._spent = 0  # thinking tokens inside the span, markers not counted
        self.reasoning_tokens = 0

    @property
    def free(self) -> bool:
        return self._mode is Mode.INSIDE

    @property
    def allow_with_grammar(self) -> int | None:
        if self._mode is Mode.OPEN and self._budget != 0 and not self._pending and self._m.start:
            return self._m.start[0]
        return None

    def _candidates(self) -> list[tuple[tuple[int, ...], Mode, bool]]:
        """(sequence, mode after it, kept as answer text)."""
        m = self._m
        if self._mode is Mode.OPEN:
            return [(m.start, Mode.INSIDE, False)] if self._fresh and m.start else []
        if self._mode is Mode.INSIDE:
            out = [(m.end, Mode.AFTER, False)] + [(e, Mode.AFTER, True) for e in m.exits]
            if self._fresh and m.start:
                out.append((m.start, Mode.INSIDE, False))  # a model that writes the opening the prompt wrote
            return out
        return []

    def feed(self, token: int) -> Released:
        self._pending.append(token)
        out: Released = []
        while self._pending:
            pending = tuple(self._pending)
            candidates = self._candidates()
            full = next((c for c in candidates if c[0] == pending), None)
            if full is not None:
                seq, mode, kept = full
                self._pending.clear()
                self._fresh = False
                if kept:
                    out += [(Channel.CONTENT, t) for t in seq]
                else:
                    out += [(None, t) for t in seq]
                    self.reasoning_tokens += len(seq)
                self._mode = mode
                break
            if any(c[0][: len(pending)] == pending for c in candidates):
                break  # may still become a marker: hold
            out.append(self._release(self._pending.pop(0)))
        return out

    def _release(self, token: int) -> tuple[Channel, int]:
        self._fresh = False
        if self._mode is Mode.OPEN:
            self._mode = Mode.AFTER  # the model answered without thinking
        if self._mode is Mode.INSIDE:
            self.reasoning_tokens += 1
            self._spent += 1
            return Channel.REASONING, token
        return Channel.CONTENT, token

    def flush(self) -> Released:
        out: Released = [self._release(t) for t in self._pending]
        self._pending.clear()
        return out

    def forced(self) -> int | None:
        if self._mode is not Mode.INSIDE or self._budget is None or self._spent < self._budget:
            return None
        end = self._m.end
        k = len(self._pending)
        return end[k] if k < len(end) and tuple(self._pending) == end[:k] else end[0]

    def banned(self) -> int | None:
        if self._mode is Mode.OPEN and self._budget == 0 and len(self._m.start) == 1:
            return self._m.start[0]
        return None


class VocabFromHF:
    """A ``Vocab`` over a ``transformers`` tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: dict[str, int] = dict(tokenizer.get_vocab())

    def token_id(self, text: str) -> int | None:
        return self._ids.get(text)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))
