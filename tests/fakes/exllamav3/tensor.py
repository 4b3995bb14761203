"""Stand-ins for the torch tensors that cross 1.6.5's API: ``FakeTensor`` for token ids
(``input_ids``, ``Tokenizer.encode``/``decode``), ``FakeArray`` for the probability tensors
of a result dict. No wheel module; where the wheel has ``torch.Tensor``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


class FakeTensor:
    """``(1, n)`` token ids, or ``(n,)`` with ``flat=True``; the backend uses only ``.shape``
    and ``.tolist()``, like a ``torch.LongTensor``."""

    def __init__(self, ids: Sequence[int], flat: bool = False) -> None:
        self._ids = [int(i) for i in ids]
        self.flat = flat

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self._ids),) if self.flat else (1, len(self._ids))

    def tolist(self) -> list[int] | list[list[int]]:
        return list(self._ids) if self.flat else [list(self._ids)]

    def __repr__(self) -> str:
        return f"FakeTensor({self._ids})"


class FakeArray:
    """A nested list with ``.shape`` and ``.tolist()``: the probability tensors of a result
    dict (``token_probs`` ``(1, n)``, ``top_k_tokens``/``top_k_probs`` ``(1, n, k)``)."""

    def __init__(self, data: list[Any]) -> None:
        self._data = data

    @property
    def shape(self) -> tuple[int, ...]:
        shape: list[int] = []
        x: Any = self._data
        while isinstance(x, list):
            shape.append(len(x))
            x = x[0] if x else None
        return tuple(shape)

    def tolist(self) -> list[Any]:
        return json.loads(json.dumps(self._data))

    def __repr__(self) -> str:
        return f"FakeArray({self._data})"


def _ids_of(t: Any) -> list[int]:
    """Token ids of a FakeTensor, a torch tensor of shape (n,) or (1, n), or a list."""
    rows = t.tolist() if hasattr(t, "tolist") else list(t)
    if rows and isinstance(rows[0], list):
        assert len(rows) == 1, "input_ids must be [1, seq_len]"
        rows = rows[0]
    return [int(i) for i in rows]
