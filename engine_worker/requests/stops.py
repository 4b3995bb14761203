"""Stop-string matching whose cost per token does not grow with the number of stops.

``StopAutomaton`` is one Aho-Corasick automaton (Aho and Corasick, "Efficient
string matching", CACM 18(6), 1975) over all stop strings of a request, built
once; ``StopMatcher`` runs it over a text stream incrementally, one new piece
of text at a time. Its state after the text so far is the longest suffix of
that text that is a prefix of some stop string, so:

- feeding ``n`` new characters costs ``O(n)`` transitions (amortised over the
  failure links: each step down a failure link undoes one step taken before),
  whatever the number of stops; nothing already scanned is scanned again;
- the text that may still become a stop string is exactly the last
  ``depth(state)`` characters: that much is held back, everything before it is
  safe to emit;
- a stop string is found where it ends first (the earliest end position in the
  stream, independent of how the text was cut into tokens); of the stops ending
  there, the longest (the earliest start) decides the cut.

Building costs ``O(total characters of the stops)`` time and memory; the callers
bound both (``protocol.messages.MAX_STOP_STRINGS`` and ``MAX_STOP_CHARS``).
The same automaton serves any "hold back what may become one of these strings"
need (banned strings, too): ``StopAutomaton.step`` is the transition function
and ``StopAutomaton.depth``/``match_length`` say what a state means.

API::

    m = StopMatcher(["END", "\\n\\n"])
    emit, stopped = m.feed(text)          # text safe to emit, and whether a stop ended it
    m.held                                # text held back (a partial stop at the end)
    m.matched                             # the stop string that ended it, or None
    tail = m.flush()                      # at the end without a stop: the held text
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class StopAutomaton:
    """The Aho-Corasick automaton of ``stops`` (empty strings are dropped: they
    match nothing). States are ints, 0 the root (nothing matched). Immutable
    once built; share one between streams of the same stops."""

    __slots__ = ("_depth", "_fail", "_goto", "_match", "stops")

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        own: list[int] = [0]  # length of the stop ending exactly at this node, 0 if none
        for stop in self.stops:
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    own.append(0)
                node = nxt
            own[node] = len(stop)
        fail = [0] * len(goto)
        match = own[:]
        queue: deque[int] = deque(goto[0].values())
        while queue:  # breadth first: a node's failure target is shallower, so already done
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                target = goto[f].get(ch, 0)
                fail[child] = target if target != child else 0
                # The longest stop that is a suffix of this node's text: its own, else the
                # longest one of its failure target (a shorter suffix).
                if not match[child]:
                    match[child] = match[fail[child]]
                queue.append(child)
        self._goto = goto
        self._fail = fail
        self._match = match
        self._depth = depth

    def __bool__(self) -> bool:
        return bool(self.stops)

    def step(self, state: int, ch: str) -> int:
        """The state after ``ch`` from ``state``."""
        goto, fail = self._goto, self._fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]

    def depth(self, state: int) -> int:
        """Characters of the text that ``state`` stands for (a prefix of some stop)."""
        return self._depth[state]

    def match_length(self, state: int) -> int:
        """Length of the longest stop that ends at ``state``'s position, 0 for none."""
        return self._match[state]


class StopMatcher:
    """Cuts a text stream at the first stop string (module docstring).

    ``feed`` returns the text safe to emit and whether a stop string was found;
    on a match the text before the stop string is returned and the stop string
    and everything after it are dropped (``matched`` names it)."""

    __slots__ = ("_auto", "_held", "_state", "matched", "stopped")

    def __init__(self, stops: Iterable[str] | StopAutomaton) -> None:
        self._auto = stops if isinstance(stops, StopAutomaton) else StopAutomaton(stops)
        self._state = 0
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text held back because it may start a stop string."""
        return self._held

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        """Append ``text``; returns ``(emit, stopped)``. With ``check=False``
        (before ``min_tokens``) stop strings are not searched and nothing is
        held: the automaton restarts after the text, as a stop may not begin in
        text already emitted."""
        if self.stopped:
            return "", True
        if not self._auto:
            return text, False
        buf = self._held + text
        if not check:
            self._held = ""
            self._state = 0
            return buf, False
        auto, state = self._auto, self._state
        # The held text was already scanned: the state stands for it. Scan only the new text.
        base = len(self._held)
        for i, ch in enumerate(text):
            state = auto.step(state, ch)
            n = auto.match_length(state)
            if n:
                end = base + i + 1
                self.stopped = True
                self.matched = buf[end - n : end]
                self._held = ""
                return buf[: end - n], True
        self._state = state
        keep = auto.depth(state)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held text, at the end of generation without a stop string."""
        held, self._held = self._held, ""
        self._state = 0
        return held
