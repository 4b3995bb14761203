"""Reasoning models: the thinking kept apart from the answer, in the worker.

One module per model family (vLLM's ``--reasoning-parser`` names):
``deepseek_r1``, ``qwen3``, ``gpt_oss`` (Harmony channels), ``mistral``
(``[THINK]``), ``none``. ``choice.choose`` picks one from the chat template and
the tokenizer (``--reasoning-parser auto``, the default: a template that writes
a family's span, with markers that are single tokens) or by name. Each engine
asks the chosen ``Parser`` to ``plan`` a request once (``prepare``: where the
prompt leaves the model, the span closed in the prompt when thinking is off)
and runs one ``Splitter`` per sequence over its sampled token ids (``base``),
so both engines split, force and count the same way:

- a token's ``Channel`` goes on its ``TokenDelta`` (marker tokens are never
  shown), and ``Finished.reasoning_tokens`` counts the thinking;
- ``SamplingParams.reasoning_budget`` (or ``--reasoning-budget``): once spent, the
  engine emits ``Splitter.forced`` tokens (the end marker) instead of sampling;
- a grammar (``SamplingParams.grammar``) applies to the answer only
  (``Splitter.free``); logprobs cover the answer's tokens;
- stop strings match the answer, not the thinking.

| module | what |
|---|---|
| ``base`` | ``Parser``, ``Plan``, ``Splitter``: a family's markers, a request's plan, the split |
| ``choice`` | ``choose``: the family from the chat template, or by name; the template's arguments |
| ``family`` | what a family declares (markers, template hints) |
| ``deepseek_r1`` | ``<think>`` ... ``</think>``, the model opening the span itself |
| ``qwen3`` | ``<think>`` spans the template may close (thinking off) |
| ``gpt_oss`` | Harmony's channels: ``analysis`` thinking, ``final`` answer |
| ``mistral`` | ``[THINK]`` ... ``[/THINK]`` |
| ``none`` | no thinking: everything is the answer |
| ``text_split`` | ``TextSplitter``: the split over an engine's text and token ids (ExLlamaV3) |
"""

from engine_worker.reasoning.base import Parser, Plan, Splitter, Vocab, VocabFromTables
from engine_worker.reasoning.choice import FAMILIES, ParserName, choose, template_kwargs

__all__ = [
    "FAMILIES",
    "Parser",
    "ParserName",
    "Plan",
    "Splitter",
    "Vocab",
    "VocabFromTables",
    "choose",
    "template_kwargs",
]
