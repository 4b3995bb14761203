"""Settings of the CPU engine backend, read once into a frozen object."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/exl3-sidecar``, or ``~/.cache/exl3-sidecar``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "exl3-sidecar"


@dataclass(frozen=True, slots=True)
class CpuEngineConfig:
    """Settings of ``CpuBackend``.

    - ``model_dir``: a local transformers model folder; ``None`` means the embedded
      SmolLM2-135M-Instruct (converted from its GGUF into ``cache_dir`` on first use).
    - ``cache_dir``: where converted models live; default ``$XDG_CACHE_HOME/exl3-sidecar``
      or ``~/.cache/exl3-sidecar``.
    - ``dtype``: weights and KV cache dtype, one of ``DTYPES``.
    - ``prefill_chunk_size``: prompt tokens per forward pass during prefill.
    - ``max_context_tokens``: longest prompt + completion, in tokens (also capped by
      the model's ``max_position_embeddings``).
    - ``prefix_cache_mb``: memory budget of the prefix cache (KV tensors of earlier
      sequences), MiB; 0 disables it.
    - ``ngram_drafting``: speculative decoding with n-gram prompt lookup.
    - ``num_draft_tokens``: drafted tokens verified per forward pass.
    - ``ngram_match_min`` / ``ngram_match_max``: n-gram lengths (tokens) looked up
      in the prompt and output, longest first.
    - ``num_threads``: torch intra-op threads; ``None`` keeps torch's default.
    - ``step_budget_s``: seconds after which a step stops advancing further
      requests (each request still gets its turn, round-robin); bounds how long
      heartbeats and aborts wait when many requests are in flight. 0 advances one
      request per step.

    Raises ``ValueError`` naming the setting when a value is out of range.
    """

    model_dir: Path | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    dtype: str = "float32"
    prefill_chunk_size: int = 256
    max_context_tokens: int = 8192
    prefix_cache_mb: int = 1024
    ngram_drafting: bool = False
    num_draft_tokens: int = 4
    ngram_match_min: int = 2
    ngram_match_max: int = 4
    num_threads: int | None = None
    step_budget_s: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
        if self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {self.max_context_tokens}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_match_min <= self.ngram_match_max:
            raise ValueError(
                "need 1 <= ngram_match_min <= ngram_match_max, got "
                f"{self.ngram_match_min} and {self.ngram_match_max}"
            )
        if self.step_budget_s < 0:
            raise ValueError(f"step_budget_s must be >= 0, got {self.step_budget_s}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")
