"""ExLlamaV3Config: parsing, validation, and the CLI mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_worker.exllamav3.config import CacheMode, DraftMode, ExLlamaV3Config


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("FP16", None),
        ("fp16", None),
        ("8,8", (8, 8)),
        ("4, 6", (4, 6)),
        ("Q4", (4, 4)),
        ("q8", (8, 8)),
        ("5", (5, 5)),
        ("2,8", (2, 8)),
    ],
)
def test_cache_mode_parses_tabbyapi_spellings(text: str, bits: tuple[int, int] | None) -> None:
    assert CacheMode.parse(text).bits == bits


@pytest.mark.parametrize("text", ["Q9", "1,8", "8,9", "4,4,4", "fp8", "", "a,b"])
def test_cache_mode_rejects_what_exllamav3_cannot_store(text: str) -> None:
    with pytest.raises(ValueError, match="cache_mode"):
        CacheMode.parse(text)


def test_cache_mode_round_trips_to_text() -> None:
    assert str(CacheMode.parse("q6")) == "6,6" and str(CacheMode.parse("FP16")) == "FP16"


def _cli(**over: Any) -> dict[str, Any]:
    """The option mapping ``exl3-sidecar worker`` passes (click names, unset = None)."""
    p: dict[str, Any] = {
        "backend": "exllamav3",
        "model_dir": Path("/models/Llama-3-8B-exl3"),
        "max_seq_len": None,
        "chunk_size": None,
        "draft_mode": "none",
        "num_draft_tokens": 4,
        "ngram_match_min": 2,
        "cache_dir": None,
        "dtype": "float32",
        "prefix_cache_mb": 1024,
        "threads": None,
        "cache_size": None,
        "cache_mode": "FP16",
        "max_batch_size": None,
        "gpu_split": None,
        "tensor_parallel": False,
        "draft_model_dir": None,
        "draft_cache_size": None,
        "draft_cache_mode": "FP16",
        "heartbeat_interval": 1.0,
        "log_level": "info",
        "input_addr": None,
        "output_addr": None,
    }
    p.update(over)
    return p


def test_from_cli_defaults() -> None:
    c = ExLlamaV3Config.from_cli(_cli())
    assert c.model_dir == Path("/models/Llama-3-8B-exl3")
    assert (c.max_seq_len, c.cache_size, c.chunk_size, c.max_batch_size) == (None, None, 2048, None)
    assert c.draft_mode is DraftMode.NONE and c.drafting is None
    assert c.kv_cache_mode.bits is None and c.gpu_split is None


def test_from_cli_carries_every_engine_option() -> None:
    c = ExLlamaV3Config.from_cli(
        _cli(
            max_seq_len=16384,
            chunk_size=1024,
            cache_size=32768,
            cache_mode="4,6",
            max_batch_size=8,
            gpu_split="20, 24.5",
            tensor_parallel=True,
            draft_mode="draft_model",
            draft_model_dir=Path("/models/draft"),
            draft_cache_size=32768,
            draft_cache_mode="Q8",
            num_draft_tokens=5,
        )
    )
    assert (c.max_seq_len, c.chunk_size, c.cache_size, c.max_batch_size) == (16384, 1024, 32768, 8)
    assert c.kv_cache_mode.bits == (4, 6) and c.draft_kv_cache_mode.bits == (8, 8)
    assert c.gpu_split == (20.0, 24.5) and c.tensor_parallel
    assert c.draft_mode is DraftMode.DRAFT_MODEL and c.draft_model_dir == Path("/models/draft")
    assert c.num_draft_tokens == 5 and c.drafting == "draft_model"


def test_from_cli_ngram() -> None:
    c = ExLlamaV3Config.from_cli(_cli(draft_mode="ngram", ngram_match_min=3))
    assert c.drafting == "ngram" and c.ngram_match_min == 3


def test_from_cli_needs_a_model_dir() -> None:
    with pytest.raises(ValueError, match="model_dir"):
        ExLlamaV3Config.from_cli(_cli(model_dir=None))


@pytest.mark.parametrize(
    ("over", "setting"),
    [
        ({"cache_size": 1000}, "cache_size"),
        ({"cache_size": 0}, "cache_size"),
        ({"chunk_size": 100}, "chunk_size"),
        ({"chunk_size": 300}, "chunk_size"),
        ({"cache_mode": "9,9"}, "cache_mode"),
        ({"draft_cache_mode": "x"}, "draft_cache_mode"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"gpu_split": "a,b"}, "gpu_split"),
        ({"gpu_split": "0,0"}, "gpu_split"),
        ({"draft_mode": "eagle"}, "draft_mode"),
        ({"draft_mode": "draft_model"}, "draft_model_dir"),
        ({"draft_model_dir": Path("/d")}, "draft_model_dir"),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"ngram_match_min": 0}, "ngram_match_min"),
        ({"max_seq_len": 1}, "max_seq_len"),
        ({"cache_size": 4096, "draft_cache_size": 8192}, "draft_cache_size"),
        ({"tensor_parallel_backend": "mpi"}, "tensor_parallel_backend"),
    ],
)
def test_bad_settings_are_refused_by_name(over: dict[str, Any], setting: str) -> None:
    with pytest.raises(ValueError, match=setting):
        ExLlamaV3Config.from_cli(_cli(**over))


def test_config_is_frozen() -> None:
    c = ExLlamaV3Config(model_dir=Path("/m"))
    with pytest.raises(AttributeError):
        c.cache_size = 512  # type: ignore[misc]
