"""The wheel's ``exllamav3/cache/cache.py`` (``Cache``) and its layer types,
``exllamav3/cache/fp16.py`` (``CacheLayer_fp16``) and ``exllamav3/cache/quant.py``
(``CacheLayer_quant``), with their storage sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .constants import PAGE_SIZE

if TYPE_CHECKING:
    from .generator import Generator
    from .model import Model


class CacheLayer_fp16:
    """Marker for an FP16 cache layer (``cache/fp16.py``)."""


class CacheLayer_quant:
    """Marker for a quantized cache layer (``cache/quant.py``)."""


class _CacheLayerSize:
    """The sizes of one attention layer's cache tensors: FP16 keys and values
    (``cache/fp16.py:27-30``, ``92-98``), or packed ``k_bits``/``v_bits`` ints per 32 channels
    plus an FP16 scale each (``cache/quant.py:32-42``, ``137-147``)."""

    def __init__(self, tokens: int, kv_heads: int, head_dim: int, bits: tuple[int, int] | None) -> None:
        self.tokens, self.token_dim, self.bits = tokens, kv_heads * head_dim, bits

    def storage_size(self) -> int:
        if self.bits is None:
            return 2 * self.tokens * self.token_dim * 2
        k, v = self.bits
        groups = self.tokens * (self.token_dim // 32)
        return groups * k * 4 + groups * v * 4 + 2 * groups * 2

    def overhead_size(self) -> int:
        return 0 if self.bits is None else 2 * self.token_dim * 2


class Cache:
    """``Cache(model, max_num_tokens, layer_type, max_batch_size, max_history, recurrent_dtype,
    **kwargs)`` (``cache/cache.py:93-185``); ``k_bits``/``v_bits``/``compand_a`` are the
    keyword arguments ``CacheLayer_quant`` takes (``cache/quant.py:15-30``). ``layers`` has
    one entry per attention layer (``cache/cache.py:158-167``), sized from ``config.json``'s
    ``num_hidden_layers``/``num_key_value_heads``/``head_dim``."""

    def __init__(
        self,
        model: Model,
        max_num_tokens: int,
        layer_type: type | None = None,
        max_batch_size: int = 16,
        max_history: int = 0,
        recurrent_dtype: Any = None,
        *,
        k_bits: int | None = None,
        v_bits: int | None = None,
        compand_a: float = 0.0,
    ) -> None:
        assert max_num_tokens % PAGE_SIZE == 0, f"max_num_tokens must be a multiple of {PAGE_SIZE}."
        if layer_type is CacheLayer_quant:
            assert k_bits is not None and v_bits is not None
            assert (2 <= k_bits <= 8) and (2 <= v_bits <= 8), "quantized cache must be from 2 to 8 bits"
        else:
            assert k_bits is None and v_bits is None, "k_bits/v_bits only apply to CacheLayer_quant"
        assert not model.loaded, "Construct the Cache BEFORE calling model.load()"
        self.model = model
        self.max_num_tokens = max_num_tokens
        self.layer_type = layer_type or CacheLayer_fp16
        self.bits = (k_bits, v_bits)
        self.max_batch_size = max_batch_size
        self.max_history = max_history
        self.initialized = False
        self.owner: Generator | None = None
        self.owner_serial = 0
        cfg = model.config.config_dict if model.config is not None else {}
        bits = None if layer_type is not CacheLayer_quant else (int(k_bits or 0), int(v_bits or 0))
        self.layers = {
            (i, 0): _CacheLayerSize(
                max_num_tokens, int(cfg.get("num_key_value_heads", 2)), int(cfg.get("head_dim", 64)), bits
            )
            for i in range(int(cfg.get("num_hidden_layers", 2)))
        }
        model.caches.append(self)
