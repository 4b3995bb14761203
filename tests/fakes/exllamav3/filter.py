"""The wheel's ``exllamav3/generator/filter/``: ``Filter`` of ``filter.py`` and
``LLGuidanceFilter``/``create_ll_tokenizer`` of ``llguidance.py``, over the real
``llguidance``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .generator import Generator
    from .job import Job
    from .tokenizer import Tokenizer


# Filter journal entry types (generator/filter/filter.py:8-11).
FJ_PASS, FJ_TRIGGER, FJ_ACCEPT, FJ_COMPLETE = 0, 1, 2, 3


class Filter:
    """``exllamav3.Filter`` (``generator/filter/filter.py``), its ``feed``/``attach`` as in
    1.6.5; masks are numpy arrays where 1.6.5 has CPU torch tensors."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        trigger_token: int | None,
        prefix_str: str | None,
        eos_after_completed: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.trigger_token = trigger_token
        self.prefix_str = prefix_str
        self.eos_after_completed = eos_after_completed
        self.job: Job | None = None
        self.generator: Generator | None = None
        self.vocab_size: int | None = None
        self.is_active = trigger_token is None
        self._journal: list[tuple[int, int]] = []

    def feed(self, token: int) -> bool:
        """``Filter.feed`` (``filter.py:50-70``): advance on an emitted token; True when the
        filter completed on it and ``eos_after_completed`` is set."""
        if not self.is_active:
            if token == self.trigger_token:
                self.is_active = True
                self.reset()
                self._journal.append((FJ_TRIGGER, token))
            else:
                self._journal.append((FJ_PASS, token))
            return False
        self.accept_token(token)
        if self.is_completed():
            self.is_active = False
            self._journal.append((FJ_COMPLETE, token))
            return self.eos_after_completed
        self._journal.append((FJ_ACCEPT, token))
        return False

    def reset(self) -> None:
        raise NotImplementedError

    def accept_token(self, token: int) -> None:
        raise NotImplementedError

    def get_next_logit_mask(self) -> Any:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def use_background_worker(self) -> bool:
        return True

    def attach(self, job: Job) -> None:
        """``Filter.attach`` (``filter.py:155-162``): runs when the job starts (``Job.activate``)."""
        self.job = job
        self.generator = job.generator
        assert job.generator is not None
        self.vocab_size = job.generator.padded_vocab_size
        self._journal.clear()


_LL_TOKENIZERS: dict[int, Any] = {}


def create_ll_tokenizer(tokenizer: Tokenizer) -> Any:
    """``generator/filter/llguidance.py:17-29``: an ``LLTokenizer`` from the serialized HF
    tokenizer, EOS from ``config.eos_token_id_list`` or else ``eos_token_id``; cached per
    tokenizer object (an ``lru_cache`` there)."""
    key = id(tokenizer)
    if key not in _LL_TOKENIZERS:
        from llguidance import LLTokenizer

        eos: Any = None
        cfg = tokenizer.config
        if getattr(cfg, "eos_token_id_list", None):
            eos = list(cfg.eos_token_id_list)  # type: ignore[union-attr]
        elif tokenizer.eos_token_id is not None:
            eos = tokenizer.eos_token_id
        _LL_TOKENIZERS[key] = LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=eos)
    return _LL_TOKENIZERS[key]


class LLGuidanceFilter(Filter):
    """``exllamav3.LLGuidanceFilter`` (``generator/filter/llguidance.py:32-163``), line for line
    over the real ``llguidance``: exactly one grammar source (``85-86``), compiled and
    validated in the constructor, ``ValueError("Invalid grammar: ...")`` when it does not
    (``92-95``); every matcher call checked by ``_check_error``, which raises ``RuntimeError``
    (``110-112``); masks are packed int32 bitmasks, bit set = allowed (``146-153``);
    ``is_completed`` is the matcher's ``is_stopped`` (``155-156``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        trigger_token: int | None = None,
        prefix_str: str | None = None,
        eos_after_completed: bool = False,
        json_schema: dict[str, Any] | str | None = None,
        regex: str | None = None,
        lark_grammar: str | None = None,
        gbnf_grammar: str | None = None,
        llg_grammar: str | None = None,
        consume_prefix: bool = False,
    ) -> None:
        import numpy as np
        from llguidance import LLMatcher, grammar_from

        super().__init__(tokenizer, trigger_token, prefix_str, eos_after_completed)
        sources = [
            ("json_schema", json_schema),
            ("regex", regex),
            ("lark", lark_grammar),
            ("gbnf", gbnf_grammar),
            ("llguidance", llg_grammar),
        ]
        given = [(f, g) for f, g in sources if g is not None]
        assert len(given) == 1, (
            "Specify exactly one of json_schema, regex, lark_grammar, gbnf_grammar, llg_grammar"
        )
        g_format, g_text = given[0]
        if isinstance(g_text, dict):
            g_text = json.dumps(g_text)
        self._ll_tokenizer = create_ll_tokenizer(tokenizer)
        self._grammar = grammar_from(g_format, g_text)  # type: ignore[arg-type]
        err = LLMatcher.validate_grammar(self._grammar, self._ll_tokenizer)
        if err:
            raise ValueError(f"Invalid grammar: {err}")
        self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        self._consume_prefix = consume_prefix
        self._consumed = 0
        self._bitmask = np.empty(((self._ll_tokenizer.vocab_size + 31) // 32,), dtype=np.int32)
        self._bitmask_torch = self._bitmask.reshape(1, -1)
        self._start()

    def _start(self) -> None:
        if self._consume_prefix and self.prefix_str:
            tokens = self._ll_tokenizer.tokenize_str(self.prefix_str)
            self._matcher.consume_tokens(tokens)
        self._check_error()

    def _check_error(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance matcher error: {self._matcher.get_error()}")

    def reset(self) -> None:
        from llguidance import LLMatcher

        if self._matcher.is_error():
            self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        else:
            self._matcher.reset()
        self._consumed = 0
        self._start()

    def accept_token(self, token: int) -> None:
        if self._matcher.is_stopped():
            return
        if self._matcher.consume_token(token):
            self._consumed += 1
        self._check_error()

    def get_next_logit_mask(self) -> Any:
        bm = self._bitmask
        self._matcher.unsafe_compute_mask_ptr(bm.ctypes.data, bm.size * bm.itemsize)
        self._check_error()
        return self._bitmask_torch

    def is_completed(self) -> bool:
        return bool(self._matcher.is_stopped())


def _allowed_by(mask: Any, vocab: int) -> set[int]:
    """Token ids whose bit is set in a packed int32 mask of shape ``(1, words)``; tokens past
    the mask's width count as masked out (``filter.py:132-140``)."""
    import numpy as np

    bits = np.unpackbits(np.ascontiguousarray(mask).reshape(-1).view(np.uint8), bitorder="little")
    return {int(i) for i in np.flatnonzero(bits[:vocab])}
