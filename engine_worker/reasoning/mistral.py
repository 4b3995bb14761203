"""Mistral's reasoning models (Magistral): ``[THINK]`` ... ``[/THINK]``, opened by
the model at the start of its answer.

Format facts (Magistral Small 2507+ ``tekken.json``: ``[THINK]`` and
``[/THINK]`` are control tokens, ids 34 and 35; vLLM's ``mistral`` parser,
``vllm/reasoning/mistral_reasoning_parser.py``, splits on them).
"""

from __future__ import annotations

from engine_worker.reasoning.base import Markers, Parser, SpanParser, Vocab
from engine_worker.reasoning.family import Family, marker_ids


class Mistral(Family):
    name = "mistral"

    def writes_span(self, template: str) -> bool:
        return "[THINK]" in template

    def bind(self, vocab: Vocab, *, single_tokens: bool) -> Parser | None:
        start = marker_ids(vocab, "[THINK]", single_tokens=single_tokens)
        end = marker_ids(vocab, "[/THINK]", single_tokens=single_tokens)
        if start is None or end is None:
            return None
        return SpanParser(self.name, Markers(start, end), vocab.decode, starts_inside=False)
