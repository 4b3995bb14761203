"""Incremental, UTF-8-safe detokenization and stop-string matching.

``IncrementalDetokenizer`` decodes only a short window of recent tokens per step
(the offsets scheme used by text-generation-inference and vLLM): the text of
``tokens[prefix:]`` minus the text of ``tokens[prefix:read]`` is the new text.
Decoding a window rather than single tokens keeps tokenizers that merge spaces or
bytes across tokens right. While the new text ends in U+FFFD (a multi-byte
character split across tokens, as byte-level BPE does), it is held back until the
character completes, so no client ever sees a replacement character that the
full text would not contain.

``StopStringMatcher`` finds stop strings in the emitted text stream, holding back
any tail that could still become the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


class StopStringMatcher:
    """Cuts a text stream at the first stop string.

    ``feed`` returns the text that is safe to emit and whether a stop string was
    found; on a match the text before the stop string is returned and the stop
    string and everything after it are dropped.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    @property
    def held(self) -> str:
        """Text held back because it may start a stop string."""
        return self._held

    def feed(self, text: str, check: bool = True) -> tuple[str, bool]:
        """Append ``text``; returns ``(emit, stopped)``. With ``check=False``
        (before ``min_tokens``) stop strings are not searched and nothing is held."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        if not check:
            self._held = ""
            return buf, False
        first = -1
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            self._held = ""
            self.stopped = True
            return buf[:first], True
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held text, at the end of generation without a stop string."""
        held, self._held = self._held, ""
        return held
