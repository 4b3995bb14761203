"""What ExLlamaV3 constrains in the worker's settings, and their ExLlamaV3 defaults.

The options themselves are fields of ``engine_worker.settings.WorkerSettings``
(marked ``[exllamav3]``); this module holds the engine facts that constrain them
(``validate``), the defaults the model does not decide (``EXLLAMAV3_*``) and the
parsers of the two text-valued ones (``CacheMode.parse``, ``parse_split``). Each
``ValueError`` names the field that controls the limit.

Facts from the exllamav3 1.6.5 source that constrain the values:

- KV pages hold 256 tokens (``constants.py:2``); a cache holds a whole number of
  pages (``cache/quant.py:28``).
- A quantized cache takes 2..8 bits for keys and for values
  (``cache/quant.py:30``); ``model_init.py:300`` parses ``"k,v"`` or ``"n"``.
- Prefill chunks end on page boundaries (``generator/job.py:1415-1418``), and the
  shared chunk size (half a chunk, rounded up to a page) must not exceed the
  chunk size (``generator/generator.py:300-303``): the chunk size is a
  positive multiple of 256.
- A draft model's cache must have the same size as the main cache
  (``generator/generator.py:257``), so ``draft_cache_size`` can only confirm
  ``cache_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

PAGE_SIZE = 256
"""Tokens per KV cache page in ExLlamaV3 (``exllamav3/constants.py:2``)."""


EXLLAMAV3_MAX_BATCH_SIZE = 32
"""exllamav3 ``max_batch_size`` when unset, on a model without recurrent layers."""
EXLLAMAV3_MAX_BATCH_SIZE_RECURRENT = 4
"""... and on one with recurrent layers, whose per-sequence state is memory the KV cache
size does not account for."""
EXLLAMAV3_DRAFT_TOKENS = 4
"""exllamav3 draft window when ``num_draft_tokens`` is unset: for n-gram drafting, and for a
drafter whose ``caps`` have no ``default_draft_size``; 1.6.5's own defaults
(``generator/generator.py:264-275``)."""
EXLLAMAV3_MAX_SEQ_LEN = 4096
"""exllamav3 context when neither ``max_seq_len``, ``cache_size`` nor the model's
``max_position_embeddings`` give one."""


@dataclass(frozen=True, slots=True)
class CacheMode:
    """KV cache precision. ``bits is None`` is FP16; otherwise ``(k_bits, v_bits)``."""

    bits: tuple[int, int] | None

    @classmethod
    def parse(cls, text: str, setting: str = "cache_mode") -> CacheMode:
        """Parse ``"FP16"``, ``"Q4"``..``"Q8"`` (both at that width), ``"6"`` or ``"k_bits,v_bits"``
        such as ``"8,8"``/``"4,6"`` (TabbyAPI's exllamav3 syntax). Raises ``ValueError`` naming
        ``setting``."""
        s = text.strip().upper()
        if s in ("FP16", "F16", "16"):
            return cls(None)
        if s.startswith("Q"):
            s = s[1:]
        parts = [p.strip() for p in s.split(",")]
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) == 1:
            nums = nums * 2
        if len(nums) != 2 or not all(2 <= n <= 8 for n in nums):
            raise ValueError(
                f"{setting}={text!r}: expected FP16, Q2..Q8, or k_bits,v_bits, each 2..8 (e.g. 8,8)"
            )
        return cls((nums[0], nums[1]))

    def __str__(self) -> str:
        return "FP16" if self.bits is None else f"{self.bits[0]},{self.bits[1]}"


def parse_split(value: Any, setting: str) -> tuple[float, ...] | None:
    """``"20,24"`` (GB per GPU) as ``(20.0, 24.0)``; ``None``, ``""`` or ``"auto"`` as ``None``
    (automatic split). Raises ``ValueError`` naming ``setting``."""
    if value is None or value == "" or value == "auto":
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        out = tuple(float(x) for x in items)
    except (TypeError, ValueError):
        raise ValueError(f"{setting}={value!r}: expected GB per GPU, comma-separated (e.g. 20,24)") from None
    if not out or any(x < 0 for x in out) or not any(x > 0 for x in out):
        raise ValueError(f"{setting}={value!r}: GB per GPU must be >= 0 with at least one GPU > 0")
    return out


class Options(Protocol):
    """The worker options ``validate`` reads (``engine_worker.settings.WorkerSettings``
    has them; this module does not import it: settings import the engine facts
    here). ``draft_mode`` is a
    ``engine_worker.settings.DraftMode``, a ``str`` enum."""

    @property
    def model_dir(self) -> Path | None: ...
    @property
    def draft_model_dir(self) -> Path | None: ...
    @property
    def draft_mode(self) -> str: ...
    @property
    def cache_mode(self) -> str: ...
    @property
    def draft_cache_mode(self) -> str: ...
    @property
    def cache_size(self) -> int | None: ...
    @property
    def draft_cache_size(self) -> int | None: ...
    @property
    def chunk_size(self) -> int | None: ...
    @property
    def gpu_split(self) -> str | None: ...
    @property
    def draft_gpu_split(self) -> str | None: ...


DRAFT_MODEL = "draft_model"
"""``DraftMode.DRAFT_MODEL``'s value: a separate draft model."""


def validate(s: Options) -> None:
    """Raises ``ValueError`` naming the field when ``s`` cannot be served by ExLlamaV3
    (facts in the module docstring): no ``model_dir``, a cache or chunk size that is
    not a whole number of pages, a bad cache mode or GPU split, a draft model
    without ``draft_mode=draft_model`` or the reverse, a draft cache of another size."""
    if s.model_dir is None:
        raise ValueError("model_dir: backend=exllamav3 needs an EXL3 model directory")
    CacheMode.parse(s.cache_mode, "cache_mode")
    CacheMode.parse(s.draft_cache_mode, "draft_cache_mode")
    for name in ("cache_size", "draft_cache_size", "chunk_size"):
        v = getattr(s, name)
        if v is not None and (v < PAGE_SIZE or v % PAGE_SIZE):
            raise ValueError(f"{name}={v}: must be a positive multiple of {PAGE_SIZE} tokens")
    parse_split(s.gpu_split, "gpu_split")
    parse_split(s.draft_gpu_split, "draft_gpu_split")
    if s.draft_mode == DRAFT_MODEL and s.draft_model_dir is None:
        raise ValueError("draft_mode=draft_model needs draft_model_dir")
    if s.draft_mode != DRAFT_MODEL and s.draft_model_dir is not None:
        raise ValueError(f"draft_model_dir needs draft_mode=draft_model, not {s.draft_mode}")
    if s.draft_cache_size is not None and s.cache_size is not None and s.draft_cache_size != s.cache_size:
        # exllamav3/generator/generator.py:257 asserts equal sizes.
        raise ValueError(
            f"draft_cache_size={s.draft_cache_size} differs from cache_size={s.cache_size}: "
            "ExLlamaV3 needs the draft cache to be the same size as the main cache"
        )
