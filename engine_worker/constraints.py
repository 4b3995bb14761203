"""Grammar-constrained decoding with llguidance, for any backend that samples on CPU tensors.

llguidance compiles a grammar (Lark, or the JSON that
``llguidance.LLMatcher.grammar_from_json_schema`` returns) against the model's
vocabulary and then says, position by position, which tokens may come next.
The pieces here:

- ``Vocabulary``: the vocabulary as llguidance sees it (an ``LLTokenizer``), built
  once per model on first use (about 0.3 s for a 49k vocabulary, so a worker
  that never sees a grammar never pays for it), and each token's raw bytes.
- ``compile_grammar``: a grammar to an ``LLMatcher`` in its start state, or a
  ``RequestRejected`` naming the request field the grammar came from. It also
  computes the first mask, which builds the lexer: on the thread that compiles,
  not on the one that later decodes (copies share what was built).
- ``TokenConstraint``: one sequence's matcher: the forbidden tokens at the next
  position, consuming a chosen token, checking drafted tokens, completion.

An ``LLMatcher`` never raises on a bad grammar or a forbidden token: it enters
an error state instead, which is checked after every call that could cause it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from engine_worker.backend import RequestRejected
from protocol.grammar import GRAMMAR_LIMITS
from protocol.messages import ErrorCode

_BITS = 32  # llguidance's bitmask words are 32-bit, token i is bit i % 32 of word i // 32


class GrammarUnsupported(Exception):
    """The model's tokenizer cannot be turned into an llguidance tokenizer."""


class Vocabulary:
    """llguidance's view of one model's vocabulary: made on first use, then shared.

    ``vocab_size`` is the width of the model's logits (masks cover exactly that
    many tokens); ``eos_ids`` are the tokens a grammar allows once it is
    complete (the model's end-of-turn and end-of-text tokens).
    """

    def __init__(self, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self._eos_ids = sorted(set(eos_ids))
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._failure: str | None = None
        self._bytes: list[bytes] = []

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self, hf_tokenizer: Any) -> llguidance.LLTokenizer:
        """The ``LLTokenizer``, built from ``hf_tokenizer`` (a fast transformers
        tokenizer) on the first call; later calls ignore the argument. The caller
        passes a tokenizer no other thread uses meanwhile (building reads its
        Rust backend). Raises ``GrammarUnsupported``."""
        with self._lock:
            if self._tokenizer is None and self._failure is None:
                try:
                    tokenizer = llguidance.hf.from_tokenizer(
                        hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids or None
                    )
                except Exception as exc:  # a slow tokenizer, or a vocabulary llguidance refuses
                    self._failure = f"{type(exc).__name__}: {exc}"
                else:
                    # The table first: `loaded` is read without the lock.
                    self._bytes = [tokenizer.decode_bytes([i]) for i in range(self.vocab_size)]
                    self._tokenizer = tokenizer
            if self._tokenizer is None:
                raise GrammarUnsupported(
                    f"this model's tokenizer cannot be used with grammars ({self._failure})"
                )
            return self._tokenizer

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (a special token's are its text); ``load`` first."""
        return self._bytes[token_id]


def compile_grammar(
    tokenizer: llguidance.LLTokenizer, grammar: str, param: str | None
) -> llguidance.LLMatcher:
    """An ``LLMatcher`` for ``grammar`` in its start state, its lexer built.

    Raises ``RequestRejected`` (``INVALID_REQUEST``, ``param``) when the grammar
    does not compile or exceeds llguidance's limits (``GRAMMAR_LIMITS``)."""
    try:
        limits = llguidance.LLParserLimits(**GRAMMAR_LIMITS)  # type: ignore[arg-type]
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the lexer here rather than at the first decode step
    except Exception as exc:  # llguidance raises only on API misuse; still never a worker crash
        raise RequestRejected(ErrorCode.INVALID_REQUEST, invalid_grammar(str(exc)), param=param) from exc
    if matcher.is_error():
        raise RequestRejected(ErrorCode.INVALID_REQUEST, invalid_grammar(matcher.get_error()), param=param)
    return matcher


class GrammarFailed(RequestRejected):
    """A sequence's grammar failed while decoding (a parser limit reached)."""


class TokenConstraint:
    """One sequence's grammar state; ``matcher`` is this sequence's own (a
    ``deep_copy`` of a compiled one), ``param`` names the request field for errors."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, param: str | None) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._param = param
        self._words = torch.empty((vocab_size + _BITS - 1) // _BITS, dtype=torch.int32)
        self._shifts = torch.arange(_BITS, dtype=torch.int32)

    def forbidden(self) -> torch.Tensor:
        """``[vocab]`` bool: the tokens the grammar forbids at the next position."""
        words = self._words
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        self._check()
        bits = (words.unsqueeze(1) >> self._shifts) & 1
        return bits.view(-1)[: self._vocab_size] == 0

    def consume(self, token: int) -> None:
        """Advance past ``token``, which the mask allowed."""
        self._matcher.consume_token(token)
        self._check()

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafted, following the consumed ones) the grammar
        allows in a row; none of them is consumed."""
        if not tokens:
            return 0
        n = self._matcher.validate_tokens(list(tokens))
        self._check()
        return n

    @property
    def stopped(self) -> bool:
        """The grammar is complete and nothing but an end token may follow."""
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarFailed(
                ErrorCode.INVALID_REQUEST, grammar_failure(self._matcher.get_error()), param=self._param
            )


_MAX_REASON_CHARS = 400


def llguidance_reason(error: str) -> str:
    """llguidance's reason from one of its error texts: the first line, capped,
    without the parser state, tokens and grammar it dumps after it (internals,
    and the client's own schema echoed back). Both engines word their grammar
    errors through this and the two functions below."""
    text = error.strip()
    line = text.splitlines()[0] if text else "unknown error"
    line = line.removeprefix("invalid grammar: ")
    return line if len(line) <= _MAX_REASON_CHARS else line[:_MAX_REASON_CHARS] + "..."


def invalid_grammar(error: str) -> str:
    """The client's message for a grammar that does not compile."""
    return f"invalid grammar: {llguidance_reason(error)}"


def grammar_failure(error: str) -> str:
    """The client's message for a grammar that failed while decoding."""
    reason = llguidance_reason(error)
    hint = (
        " (the grammar allows nothing more: e.g. a schema whose $ref loops has no finite value)"
        if "NoExtension" in reason
        else ""
    )
    return f"grammar failed while decoding: {reason}{hint}"
