"""N-gram drafting: the per-job suffix automaton of the wheel's ``exllamav3_ext/sam.cpp``
(``BC_SAM``), which ``exllamav3/generator/ngram.py`` and the generator draft from."""

from __future__ import annotations

from collections.abc import Sequence


class _SuffixAutomaton:
    """The n-gram drafter's suffix automaton (``exllamav3_ext/sam.cpp``, ``BC_SAM``), built
    token by token over a job's sequence. ``accept(seq)`` adds the tokens it has not seen and
    returns ``(begin, end)`` (end exclusive) of the earliest earlier occurrence of the longest
    suffix of ``seq`` that occurred before, found by a match that follows the sequence as it
    grows (``advance_match``: a state's first end position, ``min_end``), or ``(-1, -1)``."""

    def __init__(self) -> None:
        self.link = [-1]
        self.max_len = [0]
        self.first_end = [2**31 - 1]
        self.edges: list[dict[int, int]] = [{}]
        self.last = 0
        self.match_state = 0
        self.match_len = 0
        self.pos = 0

    def _new_state(self, max_len: int, link: int, first_end: int, edges: dict[int, int]) -> int:
        self.link.append(link)
        self.max_len.append(max_len)
        self.first_end.append(first_end)
        self.edges.append(edges)
        return len(self.link) - 1

    def _advance_match(self, token: int) -> tuple[int, int]:
        state, length = self.match_state, self.match_len
        while state != 0 and token not in self.edges[state]:
            state = self.link[state]
            length = min(length, self.max_len[state])
        if token in self.edges[state]:
            state, length = self.edges[state][token], length + 1
        else:
            state, length = 0, 0
        self.match_state, self.match_len = state, length
        return state, length

    def _extend(self, token: int) -> None:
        cur = self._new_state(self.max_len[self.last] + 1, 0, self.pos, {})
        p = self.last
        while p != -1 and token not in self.edges[p]:
            self.edges[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.edges[p][token]
            if self.max_len[p] + 1 == self.max_len[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(
                    self.max_len[p] + 1, self.link[q], self.first_end[q], dict(self.edges[q])
                )
                while p != -1 and self.edges[p].get(token) == q:
                    self.edges[p][token] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur
        self.pos += 1

    def accept(self, seq: Sequence[int]) -> tuple[int, int]:
        if len(seq) < self.pos:
            self.__init__()  # type: ignore[misc]  # a rewound sequence: rebuilt (sam.cpp accept_tensor)
        if len(seq) == self.pos:
            return -1, -1
        state = length = 0
        for token in seq[self.pos :]:
            state, length = self._advance_match(token)
            self._extend(token)
        if length == 0:
            return -1, -1
        end = self.first_end[state] + 1
        return end - length, end
