"""The grammar-checking child process: ``python -m proxy.grammar.child MEMORY_MB``.

llguidance's grammar validation has costs that its own limits
(``protocol.grammar.GRAMMAR_LIMITS``, the worker's too) do not bound: a string
schema with ``allOf`` of N regex ``pattern``s is intersected while llguidance decides whether the result is
empty, in time and memory exponential in N (20 patterns: 1.4 s, 250 MB; 50:
minutes, 20 GB, then a Rust panic). So the proxy never validates on its own
process: it sends grammars to children like this one (``proxy.grammar.check``),
which it can kill at a deadline, and whose address space is capped here
(``RLIMIT_AS``), so an allocation over the cap kills the child (Rust aborts),
never the proxy.

Protocol, one JSON document per line: the child says ``{"ready": true}`` once
llguidance is loaded (its start never counts against a check's deadline); the
parent writes a list of grammar texts; the child answers ``{"at": i}`` before
checking the ``i``-th, then
``{"ok": true}``, or ``{"index": i, "error": str}`` for the first one llguidance
refuses. Standard library and llguidance only (the child starts in about 70 ms).
"""

from __future__ import annotations

import json
import os
import resource
import sys

from protocol.grammar import GRAMMAR_LIMITS


def main() -> None:
    memory_mb = int(sys.argv[1])
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.nice(10)  # a check never takes a core from the engine worker first

    from llguidance import LLMatcher, LLParserLimits

    limits = LLParserLimits(**GRAMMAR_LIMITS)  # type: ignore[arg-type]
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:  # EOF (the proxy closed the pipe or died): exit
        grammars = json.loads(line)
        reply: dict[str, object] = {"ok": True}
        for i, grammar in enumerate(grammars):
            out.write(json.dumps({"at": i}) + "\n")
            out.flush()
            error = LLMatcher.validate_grammar(grammar, limits=limits)
            if error:
                reply = {"index": i, "error": error}
                break
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
