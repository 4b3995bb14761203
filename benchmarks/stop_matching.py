"""Cost per token of the stop automaton (``engine_worker.requests.stops``) against the number of stops.

    python benchmarks/stop_matching.py [--tokens 20000]

Feeds the same text, a few characters at a time as a tokenizer would, through a
``StopMatcher`` of 1, 4, 64, 1,000 and 50,000 stop strings that never match (so
the whole text is scanned), and prints microseconds per token for each, plus the
time to build each automaton. Flat per-token figures are the point: the work is
per new character, not per stop.
"""

from __future__ import annotations

import argparse
import random
import time

from engine_worker.requests.stops import StopAutomaton, StopMatcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    args = parser.parse_args()
    rng = random.Random(0)
    words = ["the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", ".", "\n", " zq"]
    pieces = [rng.choice(words) for _ in range(args.tokens)]
    for count in (1, 4, 64, 1000, 50_000):
        # Stops sharing a prefix with the text ("zq", "the"), so partial matches are held and released.
        stops = [f"zq{i:07d}" if i % 2 else f"the end {i}" for i in range(count)]
        t0 = time.perf_counter()
        auto = StopAutomaton(stops)
        built = time.perf_counter() - t0
        m = StopMatcher(auto)
        t0 = time.perf_counter()
        for p in pieces:
            m.feed(p)
        per = (time.perf_counter() - t0) / len(pieces)
        assert not m.stopped
        print(f"{count:>6} stops: {per * 1e6:6.2f} us per token; automaton built in {built * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
