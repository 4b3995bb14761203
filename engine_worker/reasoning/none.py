"""No reasoning parser: every token is the answer (``--reasoning-parser none``, or a
template with no thinking the other families recognise)."""

from __future__ import annotations

from engine_worker.reasoning.base import Parser, Vocab
from engine_worker.reasoning.family import Family


class NoReasoning(Family):
    name = "none"

    def writes_span(self, template: str) -> bool:
        return False

    def bind(self, vocab: Vocab, *, single_tokens: bool) -> Parser | None:
        return None
