"""Tables over the CPU engine's vocabulary, each built on the first request that
needs it: llguidance's vocabulary (grammars, logprobs' token bytes), the grammar
compiler, each token's text and bytes, XTC's protected tokens and DRY's sequence
breakers as ``[vocab]`` bool masks (ExLlamaV3's sets, ``generator/sampler/custom.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from llguidance import LLMatcher

from engine_worker.backend import RequestRejected
from engine_worker.constraints import GrammarUnsupported, Vocabulary, compile_grammar
from engine_worker.requests.events import Recent
from protocol.messages import ErrorCode, SamplingParams

_DRY_DEFAULT = tuple('.,!?<>[](){}\n\t"')
"""ExLlamaV3's ``dry_default_sequence_breaker_tokens`` characters (plus every added token)."""


class VocabTables:
    """The tables of ``tokenizer``'s vocabulary (``vocab_size`` ids; ``end_ids`` end a
    sequence, for the grammar). ``tokenizer`` belongs to the engine thread; the
    methods that take a tokenizer are also called from the prepare thread with its own."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.vocabulary = Vocabulary(vocab_size, end_ids)
        self._token_info: dict[int, tuple[str, bytes]] = {}
        self._protected: torch.Tensor | None = None
        self._texts: list[str] | None = None  # every token's text (XTC, DRY)
        self._breakers: Recent[tuple[str, ...] | None, torch.Tensor] = Recent(self._breaker_mask)

    def load_vocabulary(self, tokenizer: Any) -> None:
        """Build llguidance's vocabulary from ``tokenizer`` (one the calling thread
        owns) unless built; without it, logprobs fall back on decoded token text."""
        with contextlib.suppress(GrammarUnsupported):
            self.vocabulary.load(tokenizer)

    def compile(self, params: SamplingParams, tokenizer: Any) -> LLMatcher:
        """``params.grammar`` compiled; raises ``RequestRejected`` naming
        ``params.grammar_param`` for one that does not compile or a tokenizer
        llguidance cannot read."""
        assert params.grammar is not None
        try:
            ll_tokenizer = self.vocabulary.load(tokenizer)
        except GrammarUnsupported as exc:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(exc), param=params.grammar_param) from exc
        return compile_grammar(ll_tokenizer, params.grammar, params.grammar_param)

    def token_info(self, token_id: int) -> tuple[str, bytes]:
        """A token's text (its bytes decoded, invalid UTF-8 replaced) and raw bytes."""
        info = self._token_info.get(token_id)
        if info is None:
            if self.vocabulary.loaded:
                raw = self.vocabulary.token_bytes(token_id)
            else:  # no llguidance vocabulary for this tokenizer: its decoded text
                raw = str(self._tokenizer.decode([token_id], skip_special_tokens=False)).encode()
            info = self._token_info[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return info

    def xtc_protected(self) -> torch.Tensor:
        """The ``[vocab]`` bool mask of tokens XTC never excludes: every token whose
        text has a newline, and every special or added token, as ExLlamaV3's
        ``xtc_default_protected_token_ids`` (``generator/sampler/custom.py``)."""
        if self._protected is None:
            self._protected = self._pieces_with(("\n",)) | self._added_mask()
        return self._protected

    def dry_breakers(self, strings: tuple[str, ...] | None) -> torch.Tensor | None:
        """DRY's sequence breakers as a ``[vocab]`` bool mask: every token whose text
        contains one of ``strings`` (ExLlamaV3's ``dry_sequence_breaker_tokens``), or
        for ``None`` its default set (``dry_default_sequence_breaker_tokens``: the
        characters ``.,!?<>[](){}``, newline, tab and ``"``, plus every added token);
        ``None`` for no breakers. The last few masks are kept."""
        mask = self._breakers(strings)
        return mask if bool(mask.any()) else None

    def _breaker_mask(self, strings: tuple[str, ...] | None) -> torch.Tensor:
        if strings is None:
            return self._pieces_with(_DRY_DEFAULT) | self._added_mask()
        return self._pieces_with(tuple(s for s in strings if s))

    def _pieces_with(self, strings: tuple[str, ...]) -> torch.Tensor:
        """``[vocab]`` bool: the tokens whose text (special tokens written out) has one of ``strings``."""
        if self._texts is None:
            ids = [[i] for i in range(self._vocab_size)]
            self._texts = [str(t) for t in self._tokenizer.batch_decode(ids, skip_special_tokens=False)]
        return torch.tensor([any(s in t for s in strings) for t in self._texts], dtype=torch.bool)

    def _added_mask(self) -> torch.Tensor:
        """``[vocab]`` bool: the tokenizer's added (special) tokens, ExLlamaV3's ``extended_id_to_piece``."""
        mask = torch.zeros(self._vocab_size, dtype=torch.bool)
        added = [i for i in self._tokenizer.added_tokens_decoder if 0 <= i < self._vocab_size]
        if added:
            mask[torch.tensor(added, dtype=torch.long)] = True
        return mask
