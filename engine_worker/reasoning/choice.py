"""Choosing a family (``--reasoning-parser``) and the template variables a request
passes (``chat_template_kwargs``, the thinking switch)."""

from __future__ import annotations

import json
import logging
from typing import Any

from engine_worker.reasoning.base import Parser, Vocab
from engine_worker.reasoning.deepseek_r1 import DeepSeekR1
from engine_worker.reasoning.family import Family
from engine_worker.reasoning.gpt_oss import GptOss
from engine_worker.reasoning.mistral import Mistral
from engine_worker.reasoning.none import NoReasoning
from engine_worker.reasoning.qwen3 import Qwen3
from engine_worker.settings import ReasoningParserName

log = logging.getLogger(__name__)

ParserName = ReasoningParserName

FAMILIES: dict[str, Family] = {f.name: f for f in (GptOss(), Mistral(), Qwen3(), DeepSeekR1(), NoReasoning())}
"""By name; in the order ``auto`` tries them (most specific template test first)."""

_SWITCH = "enable_thinking"


def choose(name: str, template: str | None, vocab: Vocab) -> Parser | None:
    """The parser for ``name`` (``auto``: the first family whose span ``template``
    writes, its markers single tokens of ``vocab``; ``None`` when none fits).
    Raises ``ValueError`` for a family whose markers ``vocab`` cannot encode."""
    if name == "auto":
        for family in FAMILIES.values():
            if template and family.writes_span(template):
                parser = family.bind(vocab, single_tokens=True)
                if parser is not None:
                    log.info("reasoning parser: %s (from the chat template)", family.name)
                    return parser
        return None
    family = FAMILIES[name]
    if isinstance(family, NoReasoning):
        return None
    parser = family.bind(vocab, single_tokens=False)
    if parser is None:
        raise ValueError(f"--reasoning-parser {name}: this tokenizer has no {name} markers")
    return parser


def template_kwargs(raw: str | None, template: str | None, budget: int | None) -> dict[str, Any]:
    """The chat template's extra variables for one request: the client's
    ``chat_template_kwargs`` (``raw``, a JSON object), and ``enable_thinking=False``
    when ``budget`` is 0 and the template has that switch but the client did not set
    it (thinking switched off by the template rather than forced).
    Raises ``ValueError`` for ``raw`` that is not a JSON object."""
    out: dict[str, Any] = {}
    if raw:
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ValueError("chat_template_kwargs: expected an object")
        out.update(value)
    if budget == 0 and template and _SWITCH in template and _SWITCH not in out:
        out[_SWITCH] = False
    return out
