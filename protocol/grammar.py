"""The limits every llguidance grammar is checked and compiled under, in both processes.

The proxy checks each request's grammar in a child process under these limits
(``proxy.grammar.child``) and the worker compiles the same grammar under the
same ones (``engine_worker.constraints``), so a grammar that passed the proxy's
bounded check compiles in the worker within the same bounds. One definition,
here where the two processes meet.
"""

from __future__ import annotations

GRAMMAR_LIMITS: dict[str, int | bool] = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
    "verbose_errors": False,
}
"""``llguidance.LLParserLimits`` keyword arguments: llguidance's documented
defaults (``LLParserLimits`` in its ``_lib.pyi``), pinned so an upgrade cannot
loosen them unnoticed, and ``verbose_errors`` off (errors do not dump the
parser state and the client's schema)."""
