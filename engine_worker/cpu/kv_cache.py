"""The KV cache of one sequence for ``engine_worker.cpu.llama.LlamaRunner``.

One float32 buffer per sequence, ``[layers, 2 (keys, values), kv_heads,
capacity, head_dim]``: a forward pass writes each segment's new positions in
place and attention reads views of the filled part, so a decode step copies
only the new position. The buffer grows geometrically when a pass needs more
room. It can be cropped back (rejected draft positions), seeded from a prefix
of another sequence's KV (prefix cache hit) and exported (prefix cache insert).
"""

from __future__ import annotations

import torch

KVTensors = torch.Tensor
"""Exported KV: ``[layers, 2, kv_heads, tokens, head_dim]`` float32."""

_GROWTH = 1.5
# Exported buffers are copied to their exact size when this share of them is unused.
_MAX_EXPORT_WASTE = 0.25


class SequenceKV:
    """The KV of one sequence: ``length`` positions filled out of ``capacity``.

    ``initial_capacity`` (tokens) sizes the first allocation, made on first use.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, initial_capacity: int) -> None:
        self._shape = (num_layers, 2, kv_heads, head_dim)
        self._initial_capacity = max(1, initial_capacity)
        self._buffer: torch.Tensor | None = None
        self.layers: list[torch.Tensor] = []
        """Per layer a ``[2, kv_heads, capacity, head_dim]`` view of the buffer."""
        self.length = 0

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int) -> int:
        return num_layers * 2 * kv_heads * head_dim * 4

    @property
    def buffer(self) -> torch.Tensor:
        """The whole ``[layers, 2, kv_heads, capacity, head_dim]`` buffer (views of
        it are valid until the cache next grows). Raises ``ValueError`` before the
        first ``reserve``."""
        if self._buffer is None:
            raise ValueError("the cache holds no KV")
        return self._buffer

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.shape[3])

    def reserve(self, positions: int) -> None:
        """Make room for ``positions`` positions, keeping the filled ones."""
        if positions <= self.capacity:
            return
        capacity = max(positions, self._initial_capacity, int(self.capacity * _GROWTH))
        layers, two, heads, dim = self._shape
        buffer = torch.zeros((layers, two, heads, capacity, dim))
        if self._buffer is not None and self.length:
            buffer[:, :, :, : self.length] = self._buffer[:, :, :, : self.length]
        self._buffer = buffer
        self.layers = list(buffer.unbind(0))

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions (the buffer is kept for reuse)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} positions to {length}")
        self.length = length

    def seed(self, kv: KVTensors, length: int) -> None:
        """Start from a copy of the first ``length`` positions of ``kv``."""
        if (*kv.shape[:3], kv.shape[4]) != self._shape:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit this cache {self._shape}")
        if length > kv.shape[3]:
            raise ValueError(f"KV holds {kv.shape[3]} positions, {length} asked")
        self.length = 0
        self.reserve(length)
        assert self._buffer is not None
        self._buffer[:, :, :, :length] = kv[:, :, :, :length]
        self.length = length

    def view(self) -> KVTensors:
        """The filled positions as a view of the buffer (no copy): valid until the
        cache is next written or grown."""
        if self._buffer is None:
            raise ValueError("the cache holds no KV")
        return self._buffer[:, :, :, : self.length]

    def export(self) -> KVTensors:
        """The filled positions, without copying unless much of the buffer is
        unused. The cache must not be written afterwards (they may share memory)."""
        if self._buffer is None:
            raise ValueError("the cache holds no KV")
        filled = self._buffer[:, :, :, : self.length]
        if self.capacity - self.length > _MAX_EXPORT_WASTE * self.capacity:
            return filled.clone()
        return filled


def kv_length(kv: KVTensors) -> int:
    """Positions held by exported KV."""
    return int(kv.shape[3])


def kv_nbytes(kv: KVTensors) -> int:
    """Bytes of memory ``kv`` keeps alive (its whole storage: a view of a larger
    buffer counts the buffer)."""
    return int(kv.untyped_storage().nbytes())
