"""Qwen3 (and QwQ, GLM-4.5-style templates with the same span): ``<think>`` ...
``</think>``, opened by the model (or by the template at the generation prompt,
as the Qwen3 *-Thinking-2507 templates do), switched off by the template's
``enable_thinking=false`` (which writes ``<think>\\n\\n</think>\\n\\n`` into the
prompt).

Format facts (Qwen3's ``tokenizer_config.json``: ``<think>`` 151667,
``</think>`` 151668, ``<tool_call>`` 151657, all non-special added tokens;
vLLM's ``qwen3`` parser, ``vllm/reasoning/qwen3_reasoning_parser.py``): a
``<tool_call>`` written inside the span ends it and is the answer's (a tool
call the proxy parses), as TabbyAPI and llama.cpp also treat it.
"""

from __future__ import annotations

from engine_worker.reasoning.base import Markers, Parser, SpanParser, Vocab
from engine_worker.reasoning.family import Family, marker_ids


class Qwen3(Family):
    name = "qwen3"

    def writes_span(self, template: str) -> bool:
        return "<think>" in template and "<tool_call>" in template

    def bind(self, vocab: Vocab, *, single_tokens: bool) -> Parser | None:
        start = marker_ids(vocab, "<think>", single_tokens=single_tokens)
        end = marker_ids(vocab, "</think>", single_tokens=single_tokens)
        if start is None or end is None:
            return None
        call = marker_ids(vocab, "<tool_call>", single_tokens=single_tokens)
        exits = (call,) if call is not None else ()
        return SpanParser(self.name, Markers(start, end, exits), vocab.decode, starts_inside=False)
