"""Tokenizers of each reasoning family for tests: a byte-level vocabulary with
the family's marker and control tokens at their real ids (the facts and sources
are in ``tests/data/reasoning/README.md``), and the family's chat template from
``tests/data/reasoning``.

The vocabulary is filled up to the highest real id with pieces no input can
produce (BPE without merges only makes single bytes), so the ids the worker
sees are the real model's for every marker."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tests.fakes.exllamav3 import _byte_symbols

DATA = Path(__file__).resolve().parents[3] / "data" / "reasoning"

# (text, id, special) per family: special = a control token (added, special=True).
FAMILY_TOKENS: dict[str, list[tuple[str, int, bool]]] = {
    "qwen3": [
        ("<|endoftext|>", 151643, True),
        ("<|im_start|>", 151644, True),
        ("<|im_end|>", 151645, True),
        ("<tool_call>", 151657, False),
        ("</tool_call>", 151658, False),
        ("<think>", 151667, False),
        ("</think>", 151668, False),
    ],
    "deepseek_r1": [
        ("<\uff5cend\u2581of\u2581sentence\uff5c>", 151643, True),
        ("<\uff5cUser\uff5c>", 151644, False),
        ("<\uff5cAssistant\uff5c>", 151645, False),
        ("<think>", 151648, False),
        ("</think>", 151649, False),
    ],
    "gpt_oss": [
        ("<|endoftext|>", 199999, True),
        ("<|return|>", 200002, True),
        ("<|constrain|>", 200003, True),
        ("<|channel|>", 200005, True),
        ("<|start|>", 200006, True),
        ("<|end|>", 200007, True),
        ("<|message|>", 200008, True),
        ("<|call|>", 200012, True),
    ],
    "mistral": [
        ("<s>", 1, True),
        ("</s>", 2, True),
        ("[INST]", 3, True),
        ("[/INST]", 4, True),
        ("[SYSTEM_PROMPT]", 17, True),
        ("[/SYSTEM_PROMPT]", 18, True),
        ("[THINK]", 34, True),
        ("[/THINK]", 35, True),
    ],
}
EOS = {
    "qwen3": "<|im_end|>",
    "deepseek_r1": "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "gpt_oss": "<|return|>",
    "mistral": "</s>",
}
BYTE_OFFSET = {"mistral": 1000}  # tekken: ids below 1000 are control tokens, bytes follow


def template(family: str) -> str:
    return (DATA / f"{family}.jinja").read_text()


@functools.cache
def tokenizer_json(family: str) -> str:
    tokens = FAMILY_TOKENS[family]
    offset = BYTE_OFFSET.get(family, 0)
    size = max(max(i for _, i, _ in tokens) + 1, offset + 256)
    pieces = [f"<|filler_{i}|>" for i in range(size)]
    for b, sym in enumerate(_byte_symbols()):
        pieces[offset + b] = sym
    for text, i, _ in tokens:
        pieces[i] = text
    added = [
        {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for text, i, special in tokens
    ]
    return json.dumps(
        {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
            "post_processor": None,
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": True,
                "trim_offsets": True,
                "use_regex": True,
            },
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {p: i for i, p in enumerate(pieces)},
                "merges": [],
            },
        }
    )


def family_tokenizer(family: str) -> Any:
    """A ``transformers`` fast tokenizer of ``family`` with its chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json(family)), eos_token=EOS[family]
    )
    fast.chat_template = template(family)
    return fast


def ids(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
