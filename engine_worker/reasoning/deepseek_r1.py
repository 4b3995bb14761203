"""DeepSeek-R1 and its distills: ``<think>`` ... ``</think>``, the output starting
inside the span.

Format facts (vLLM's ``deepseek_r1`` parser, ``vllm/reasoning/deepseek_r1_reasoning_parser.py``;
the R1 templates end the generation prompt with the Assistant tag (U+FF5C bars) and ``<think>\\n``, and
earlier R1 releases let the model write ``<think>`` itself): everything up to
``</think>`` is thinking, whether or not ``<think>`` was written; an opening
``<think>`` the model writes first is swallowed. In R1-Distill-Qwen's
``tokenizer.json`` they are added tokens 151648 (``<think>``) and 151649
(``</think>``).
"""

from __future__ import annotations

from engine_worker.reasoning.base import Markers, Parser, SpanParser, Vocab
from engine_worker.reasoning.family import Family, marker_ids


class DeepSeekR1(Family):
    name = "deepseek_r1"

    def writes_span(self, template: str) -> bool:
        return "<think>" in template and "<tool_call>" not in template

    def bind(self, vocab: Vocab, *, single_tokens: bool) -> Parser | None:
        start = marker_ids(vocab, "<think>", single_tokens=single_tokens)
        end = marker_ids(vocab, "</think>", single_tokens=single_tokens)
        if start is None or end is None:
            return None
        return SpanParser(self.name, Markers(start, end), vocab.decode, starts_inside=True)
