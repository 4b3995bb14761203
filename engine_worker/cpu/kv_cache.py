"""A per-sequence KV cache for transformers models that grows without re-copying.

transformers' ``DynamicLayer`` appends with ``torch.cat`` on every forward pass,
which copies the whole cache of every layer once per decoded token: work that
grows with the sequence length. ``GrowableLayer`` keeps a preallocated buffer per
layer (shape ``[batch, kv_heads, capacity, head_dim]``), writes new positions in
place and grows geometrically, so a decode step copies only the new position.
``keys``/``values`` are views of the filled part, which is what attention reads.

``SequenceKV`` is a ``DynamicCache`` made of such layers; it can be cropped back
(rejected draft positions), seeded from a prefix of another sequence's KV
(prefix cache hit) and exported as per-layer tensors (prefix cache insert).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

KVTensors = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(keys, values)``, each ``[1, kv_heads, tokens, head_dim]``."""

_GROWTH = 1.5
# Exported buffers are copied to their exact size when this share of them is unused.
_MAX_EXPORT_WASTE = 0.25


class GrowableLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One layer's KV in a buffer of ``capacity`` positions, ``length`` of them filled."""

    def __init__(self, initial_capacity: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._initial_capacity = max(1, initial_capacity)
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None
        self.length = 0

    @property
    def capacity(self) -> int:
        return 0 if self._k_buf is None else int(self._k_buf.shape[-2])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._allocate(key_states, value_states, max(self._initial_capacity, key_states.shape[-2]))
        self.is_initialized = True

    def _allocate(self, key_like: torch.Tensor, value_like: torch.Tensor, capacity: int) -> None:
        b, h, _, d = key_like.shape
        k_buf = key_like.new_empty((b, h, capacity, d))
        v_buf = value_like.new_empty((b, value_like.shape[1], capacity, value_like.shape[-1]))
        if self._k_buf is not None and self._v_buf is not None and self.length:
            k_buf[..., : self.length, :] = self._k_buf[..., : self.length, :]
            v_buf[..., : self.length, :] = self._v_buf[..., : self.length, :]
        self._k_buf, self._v_buf = k_buf, v_buf

    def _refresh_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._k_buf is not None and self._v_buf is not None
        keys = self._k_buf[..., : self.length, :]
        values = self._v_buf[..., : self.length, :]
        self.keys, self.values = keys, values
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        needed = self.length + n
        if needed > self.capacity:
            self._allocate(key_states, value_states, max(needed, int(self.capacity * _GROWTH)))
        assert self._k_buf is not None and self._v_buf is not None
        self._k_buf[..., self.length : needed, :] = key_states
        self._v_buf[..., self.length : needed, :] = value_states
        self.length = needed
        return self._refresh_views()

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._k_buf = self._v_buf = None
        self.keys = self.values = None
        self.length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions (transformers' convention:
        a negative count). The buffer is kept for reuse."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._refresh_views()

    def seed(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Fill positions ``[0, length)`` with a copy of the first ``length`` positions
        of ``keys``/``values`` (``[1, kv_heads, >=length, head_dim]``)."""
        self.device = keys.device
        self._k_buf = None
        self._v_buf = None
        self.length = 0
        self._allocate(keys, values, max(self._initial_capacity, length))
        assert self._k_buf is not None and self._v_buf is not None
        self._k_buf[..., :length, :] = keys[..., :length, :]
        self._v_buf[..., :length, :] = values[..., :length, :]
        self.length = length
        self.is_initialized = True
        self._refresh_views()

    def export(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The filled positions, without copying unless much of the buffer is unused.
        The layer must not be written afterwards."""
        if self._k_buf is None or self._v_buf is None:
            raise ValueError("layer holds no KV")
        keys, values = self._refresh_views()
        if self.capacity - self.length > _MAX_EXPORT_WASTE * self.capacity:
            return keys.clone(), values.clone()
        return keys, values


class SequenceKV(DynamicCache):
    """The KV cache of one sequence (batch size 1), ``num_layers`` growable layers.

    ``initial_capacity`` (tokens) sizes the first allocation; the buffers grow by
    1.5x when full.
    """

    def __init__(self, num_layers: int, initial_capacity: int) -> None:
        # DynamicCache.__init__ would build DynamicLayers; build ours instead.
        self._growable = [GrowableLayer(initial_capacity) for _ in range(num_layers)]
        Cache.__init__(self, layers=list(self._growable))

    @property
    def length(self) -> int:
        """Positions held, in tokens."""
        return self._growable[0].length

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` positions."""
        drop = self.length - length
        if drop < 0:
            raise ValueError(f"cannot truncate {self.length} positions to {length}")
        if drop:
            self.crop(-drop)

    def seed(self, kv: KVTensors, length: int) -> None:
        """Start from a copy of the first ``length`` positions of ``kv``."""
        if len(kv) != len(self._growable):
            raise ValueError(f"KV has {len(kv)} layers, this cache {len(self._growable)}")
        for layer, (k, v) in zip(self._growable, kv, strict=True):
            layer.seed(k, v, length)

    def export(self) -> KVTensors:
        """Per-layer ``(keys, values)`` of all held positions. The cache must not be
        used afterwards (the tensors may share its buffers)."""
        return [layer.export() for layer in self._growable]


def kv_nbytes(kv: KVTensors) -> int:
    """Bytes of memory the tensors of ``kv`` keep alive (whole storages, so views
    of larger buffers count the buffer)."""
    seen: set[int] = set()
    total = 0
    for pair in kv:
        for t in pair:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total
