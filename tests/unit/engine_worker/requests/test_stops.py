"""The stop automaton: the stream cut where a stop first ends, whatever the chunking."""

from __future__ import annotations

import random

from engine_worker.requests.stops import StopAutomaton, StopMatcher


def oracle(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The emitted text and the matched stop by brute force: the earliest end
    position where some stop ends, the longest of those ending there."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            best = max(ending, key=len)
            return text[: end - len(best)], best
    return text, None


def run(m: StopMatcher, pieces: list[str]) -> str:
    out = []
    for p in pieces:
        emit, stopped = m.feed(p)
        out.append(emit)
        if stopped:
            return "".join(out)
    return "".join(out) + m.flush()


def test_stop_string_split_across_feeds() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.held == "ST"
    assert m.feed("O") == ("", False)
    assert m.feed("Pxyz") == ("", True)
    assert m.stopped and m.matched == "STOP"
    assert m.feed("more") == ("", True)


def test_false_start_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ART") == ("START", False)
    assert m.flush() == ""


def test_earliest_end_wins_and_overlapping_prefixes() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched == "lo w"
    m2 = StopMatcher(["aab"])
    assert m2.feed("aaa") == ("a", False)
    assert m2.feed("b!") == ("", True)  # "aaab!" cut before "aab": "a", already emitted


def test_longest_of_the_stops_ending_at_one_place() -> None:
    m = StopMatcher(["bc", "abc"])
    assert m.feed("xabcd") == ("x", True)
    assert m.matched == "abc"


def test_without_stops_and_unchecked() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", False)
    assert StopMatcher(["", ""]).feed("x") == ("x", False)
    m = StopMatcher(["x"])
    assert m.feed("axb", check=False) == ("axb", False)
    assert m.feed("cxd") == ("c", True)


def test_unchecked_text_does_not_start_a_stop() -> None:
    m = StopMatcher(["ab"])
    assert m.feed("a", check=False) == ("a", False)
    assert m.feed("b") == ("b", False)  # the "a" was emitted before checking began


def test_matches_the_oracle_for_random_stops_and_chunkings() -> None:
    rng = random.Random(7)
    for _ in range(400):
        alphabet = "ab" if rng.random() < 0.5 else "abc\n"
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 6))
        ]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        want, matched = oracle(text, stops)
        m = StopMatcher(stops)
        assert run(m, pieces) == want, (stops, pieces)
        assert m.matched == matched, (stops, pieces)


def test_held_text_is_the_longest_partial_stop() -> None:
    m = StopMatcher(["abcd", "bce"])
    assert m.feed("xxabc") == ("xx", False)
    assert m.held == "abc"
    assert m.feed("e") == ("a", True)  # "bce" ends here: the "a" before it is released
    assert m.matched == "bce"


def test_one_automaton_shared_by_streams() -> None:
    auto = StopAutomaton(["END", "END"])
    assert auto.stops == ("END",)
    a, b = StopMatcher(auto), StopMatcher(auto)
    assert a.feed("xEN") == ("x", False)
    assert b.feed("yEND") == ("y", True)
    assert a.feed("D") == ("", True)


def test_many_stops_scan_each_new_character_once() -> None:
    """The per-character work is bounded by the automaton's depth, not the
    number of stops: 5,000 stops sharing no prefix with the text cost one
    transition per character (state stays at the root)."""
    stops = [f"zz{i:05d}" for i in range(5000)]
    auto = StopAutomaton(stops)
    state = 0
    for ch in "hello world " * 10:
        state = auto.step(state, ch)
        assert state == 0
    m = StopMatcher(auto)
    assert m.feed("a zz0499") == ("a ", False)
    assert m.feed("9!") == ("", True)
    assert m.matched == "zz04999"
