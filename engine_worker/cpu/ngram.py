"""N-gram prompt-lookup drafting for speculative decoding.

The draft for the next positions is what followed the most recent earlier
occurrence of the sequence's last ``n`` tokens (prompt and output together),
trying the longest ``n`` first (the idea of "prompt lookup decoding", also
llama.cpp's and vLLM's n-gram speculator). The target model then verifies the
draft in one forward pass.

The index maps every n-gram that has a following token to the position of that
token, the latest occurrence winning. It is updated incrementally: appending a
token costs ``O(max_n)``, and a lookup ``O(max_n)`` dictionary probes, however
long the sequence is.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramDrafter:
    """Drafts tokens for one sequence from its own history.

    ``tokens`` is the history so far (prompt); ``min_n``/``max_n`` bound the
    n-gram lengths matched, in tokens.
    """

    def __init__(self, tokens: Iterable[int], min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}
        for token in tokens:
            self.observe(token)

    def __len__(self) -> int:
        return len(self._tokens)

    def observe(self, token: int) -> None:
        """Append one token of the sequence."""
        pos = len(self._tokens)
        self._tokens.append(token)
        # The n-grams ending just before `pos` now have a follower: `token`.
        for n in range(self.min_n, self.max_n + 1):
            start = pos - n
            if start < 0:
                break
            self._index[tuple(self._tokens[start:pos])] = pos

    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` drafted tokens continuing the sequence; ``[]`` when
        no n-gram of the allowed lengths occurred earlier."""
        if max_tokens <= 0:
            return []
        tokens = self._tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            pos = self._index.get(tuple(tokens[len(tokens) - n :]))
            if pos is not None:
                return tokens[pos : pos + max_tokens]
        return []
