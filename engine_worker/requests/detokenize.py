"""Incremental, UTF-8-safe detokenization.

``IncrementalDetokenizer`` decodes only a short window of recent tokens per step
(the offsets scheme used by text-generation-inference and vLLM): the text of
``tokens[prefix:]`` minus the text of ``tokens[prefix:read]`` is the new text.
Decoding a window rather than single tokens keeps tokenizers that merge spaces or
bytes across tokens right. While the new text ends in U+FFFD (a multi-byte
character split across tokens, as byte-level BPE does), it is held back until the
character completes, so no client ever sees a replacement character that the
full text would not contain.

Stop strings are matched on the emitted text by ``engine_worker.requests.stops.StopMatcher``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into complete UTF-8 text pieces.

    ``context`` are a few tokens preceding the output (the end of the prompt),
    decoded with it so that the first output token gets its leading space right
    with tokenizers whose decoding depends on the previous token; their text is
    never emitted.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = list(context)
        # Text of tokens[prefix:read], kept to avoid decoding it twice.
        self._prefix_text = self._decode(self._tokens)
        if _REPLACEMENT in self._prefix_text:
            # A context cut inside a character would shift the output's text.
            self._tokens.clear()
            self._prefix_text = ""
        self._prefix = 0
        self._read = len(self._tokens)

    def _decode(self, tokens: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(tokens), skip_special_tokens=self._skip_special))

    def add(self, token: int) -> str:
        """New complete text after ``token``; ``""`` while a character is incomplete
        or the token has no text (a skipped special token)."""
        self._tokens.append(token)
        window = self._tokens[self._prefix :]
        text = self._decode(window)
        if text.endswith(_REPLACEMENT) or len(text) <= len(self._prefix_text):
            return ""
        new = text[len(self._prefix_text) :]
        self._prefix = self._read
        self._read = len(self._tokens)
        self._prefix_text = self._decode(self._tokens[self._prefix : self._read])
        # Drop consumed tokens so the list does not grow with the output.
        del self._tokens[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return new

    def state(self) -> tuple[tuple[int, ...], str, int, int]:
        """A snapshot for ``restore`` (banned strings rewind the sequence)."""
        return tuple(self._tokens), self._prefix_text, self._prefix, self._read

    def restore(self, state: tuple[tuple[int, ...], str, int, int]) -> None:
        """Back to a ``state`` snapshot: as if the tokens since were never added."""
        tokens, self._prefix_text, self._prefix, self._read = state
        self._tokens = list(tokens)

    def flush(self) -> str:
        """Text still held at the end of generation (may contain U+FFFD if the
        output really ended inside a character)."""
        text = self._decode(self._tokens[self._prefix :])
        new = text[len(self._prefix_text) :]
        self._tokens.clear()
        self._prefix = self._read = 0
        self._prefix_text = ""
        return new
