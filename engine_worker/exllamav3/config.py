"""Settings of the ExLlamaV3 backend, read once into a frozen object.

Names follow TabbyAPI's ``config.yml`` where one exists (``max_seq_len``,
``cache_size``, ``cache_mode``, ``chunk_size``, ``max_batch_size``,
``gpu_split``, ``tensor_parallel``, ``tensor_parallel_backend``,
``output_chunking``, ``draft_model_dir``, ``draft_cache_mode``,
``draft_gpu_split``, ``ngram_match_min``); the others are ExLlamaV3's own
(``num_draft_tokens``, ``max_rq_tokens``). Every limit an error can name is a
field here, and each ``ValueError`` names the field that controls it.

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

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE_SIZE = 256
"""Tokens per KV cache page in ExLlamaV3 (``exllamav3/constants.py:2``)."""


class DraftMode(enum.StrEnum):
    """Speculative decoding mode; the values are the ``drafting`` names of ``protocol.messages.Ready``."""

    NONE = "none"
    DRAFT_MODEL = "draft_model"  # a separate, smaller EXL3 model with the same vocabulary
    MTP = "mtp"  # the model's own multi-token-prediction head
    NGRAM = "ngram"  # prompt lookup: continue an earlier occurrence of the current suffix


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


def _split(value: Any, setting: str) -> tuple[float, ...] | None:
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


@dataclass(frozen=True, slots=True)
class ExLlamaV3Config:
    """Everything needed to load an EXL3 model and serve it.

    Token counts are tokens; memory sizes are in ExLlamaV3's "GB", which are GiB
    (``1024**3`` bytes, ``model/model.py:651,662``).

    - ``model_dir``: EXL3 model directory (``config.json``, ``*.safetensors``, tokenizer files).
    - ``max_seq_len``: longest prompt + completion per request. Default: the model's
      ``max_position_embeddings``, capped by ``cache_size`` when that is given.
    - ``cache_size``: KV cache size shared by all requests, a multiple of 256.
      Default: ``max_seq_len`` rounded up to a page.
    - ``cache_mode``: ``FP16`` or ``k_bits,v_bits`` (2..8 each), see ``CacheMode.parse``.
    - ``chunk_size``: prefill chunk in tokens (one progress event each), multiple of 256.
    - ``max_batch_size``: most sequences decoded together. Default: 32, or 4 on models
      with recurrent layers (TabbyAPI's defaults), whose state slots cost VRAM per sequence.
    - ``gpu_split``: GB to use per GPU; ``None`` splits automatically.
    - ``tensor_parallel``/``tensor_parallel_backend``: ``model.load(tensor_p=True,
      tp_backend="native"|"nccl")``.
    - ``draft_mode``: see ``DraftMode``. ``draft_model_dir``/``draft_cache_mode``/
      ``draft_gpu_split`` configure ``draft_model``; without ``draft_gpu_split`` the
      drafter is placed automatically, not with ``gpu_split`` (ExLlamaV3 counts
      ``use_per_device`` on top of memory already in use, ``model/model.py:522-526``,
      so the drafter and the model would take about twice the split together);
      ``draft_cache_size`` must equal the main cache size if given.
    - ``num_draft_tokens``: tokens drafted per verification pass. Default: 4, or what a
      draft model or MTP head prefers (``generator/generator.py:265-268``).
    - ``ngram_match_min``: shortest suffix match (tokens) before n-gram drafting proposes.
    - ``output_chunking``/``max_rq_tokens``: reserve cache pages for at most
      ``max_rq_tokens`` completion tokens at a time; a longer completion is re-queued
      with its text so far as the prompt (prefix-cache hit). Without it every request
      reserves pages for its whole ``max_tokens`` up front and few fit at once.
    - ``warmup``: run ``Model.warmup`` after loading, so kernel compilation and GEMM
      tuning happen before the first request rather than during it.
    - ``add_bos``: prepend the tokenizer's BOS token to raw-text prompts (chat prompts
      get whatever the chat template writes).
    - ``served_model_id``: model id announced to the proxy. Default: the directory name.
    """

    model_dir: Path
    max_seq_len: int | None = None
    cache_size: int | None = None
    cache_mode: str = "FP16"
    chunk_size: int = 2048
    max_batch_size: int | None = None
    gpu_split: tuple[float, ...] | None = None
    tensor_parallel: bool = False
    tensor_parallel_backend: str = "native"
    draft_mode: DraftMode = DraftMode.NONE
    draft_model_dir: Path | None = None
    draft_cache_size: int | None = None
    draft_cache_mode: str = "FP16"
    draft_gpu_split: tuple[float, ...] | None = None
    num_draft_tokens: int | None = None
    ngram_match_min: int = 2
    output_chunking: bool = True
    max_rq_tokens: int = 2048
    warmup: bool = True
    add_bos: bool = True
    served_model_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.draft_model_dir is not None:
            object.__setattr__(self, "draft_model_dir", Path(self.draft_model_dir))
        try:
            object.__setattr__(self, "draft_mode", DraftMode(self.draft_mode))
        except ValueError:
            choices = ", ".join(m.value for m in DraftMode)
            raise ValueError(f"draft_mode={self.draft_mode!r}: expected one of {choices}") from None
        CacheMode.parse(self.cache_mode, "cache_mode")
        CacheMode.parse(self.draft_cache_mode, "draft_cache_mode")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len={self.max_seq_len}: must be at least 2 tokens")
        for name in ("cache_size", "draft_cache_size"):
            v = getattr(self, name)
            if v is not None and (v < PAGE_SIZE or v % PAGE_SIZE):
                raise ValueError(f"{name}={v}: must be a positive multiple of {PAGE_SIZE} tokens")
        if self.chunk_size < PAGE_SIZE or self.chunk_size % PAGE_SIZE:
            raise ValueError(f"chunk_size={self.chunk_size}: must be a positive multiple of {PAGE_SIZE}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size}: must be at least 1")
        if self.tensor_parallel_backend not in ("native", "nccl"):
            raise ValueError(
                f"tensor_parallel_backend={self.tensor_parallel_backend!r}: expected native or nccl"
            )
        object.__setattr__(self, "gpu_split", _split(self.gpu_split, "gpu_split"))
        object.__setattr__(self, "draft_gpu_split", _split(self.draft_gpu_split, "draft_gpu_split"))
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens}: must be at least 1")
        if self.ngram_match_min < 1:
            raise ValueError(f"ngram_match_min={self.ngram_match_min}: must be at least 1")
        if self.max_rq_tokens < 1:
            raise ValueError(f"max_rq_tokens={self.max_rq_tokens}: must be at least 1")
        if self.draft_mode is DraftMode.DRAFT_MODEL and self.draft_model_dir is None:
            raise ValueError("draft_mode=draft_model needs draft_model_dir")
        if self.draft_mode is not DraftMode.DRAFT_MODEL and self.draft_model_dir is not None:
            raise ValueError(f"draft_model_dir needs draft_mode=draft_model, not {self.draft_mode.value}")
        if (
            self.draft_cache_size is not None
            and self.cache_size is not None
            and self.draft_cache_size != self.cache_size
        ):
            # exllamav3/generator/generator.py:257 asserts equal sizes.
            raise ValueError(
                f"draft_cache_size={self.draft_cache_size} differs from cache_size={self.cache_size}: "
                "ExLlamaV3 needs the draft cache to be the same size as the main cache"
            )

    @property
    def kv_cache_mode(self) -> CacheMode:
        """``cache_mode`` parsed."""
        return CacheMode.parse(self.cache_mode)

    @property
    def draft_kv_cache_mode(self) -> CacheMode:
        """``draft_cache_mode`` parsed."""
        return CacheMode.parse(self.draft_cache_mode, "draft_cache_mode")

    @property
    def drafting(self) -> str | None:
        """``Ready.drafting``: the mode name, or ``None`` without drafting."""
        return None if self.draft_mode is DraftMode.NONE else self.draft_mode.value

    @classmethod
    def from_cli(cls, p: Mapping[str, Any]) -> ExLlamaV3Config:
        """Build from the ``exl3-sidecar worker`` option mapping (click's parameter names:
        ``model_dir``, ``max_seq_len``, ``cache_size``, ``cache_mode``, ``chunk_size``,
        ``max_batch_size``, ``gpu_split`` (str ``"20,24"``), ``tensor_parallel``,
        ``tensor_parallel_backend``, ``draft_mode``, ``draft_model_dir``, ``draft_cache_size``,
        ``draft_cache_mode``, ``draft_gpu_split``, ``num_draft_tokens``, ``ngram_match_min``,
        ``output_chunking``, ``max_rq_tokens``, ``warmup``, ``served_model_id``). Missing or
        ``None`` values take the defaults. Raises ``ValueError`` naming the bad setting."""
        fields = {
            "model_dir",
            "max_seq_len",
            "cache_size",
            "cache_mode",
            "chunk_size",
            "max_batch_size",
            "gpu_split",
            "tensor_parallel",
            "tensor_parallel_backend",
            "draft_mode",
            "draft_model_dir",
            "draft_cache_size",
            "draft_cache_mode",
            "draft_gpu_split",
            "num_draft_tokens",
            "ngram_match_min",
            "output_chunking",
            "max_rq_tokens",
            "warmup",
            "add_bos",
            "served_model_id",
        }
        kw = {k: v for k, v in p.items() if k in fields and v is not None}
        if "model_dir" not in kw:
            raise ValueError("model_dir: an EXL3 model directory is required")
        return cls(**kw)
