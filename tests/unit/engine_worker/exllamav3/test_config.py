"""The ExLlamaV3 checks and parsers of the worker's settings (``engine_worker.options.exllamav3``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_worker.options.exllamav3 import CacheMode, parse_split
from engine_worker.settings import DraftMode, WorkerSettings


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


def test_gpu_split_parses_gb_per_gpu() -> None:
    assert parse_split("20, 24.5", "gpu_split") == (20.0, 24.5)
    assert parse_split("auto", "gpu_split") is None and parse_split(None, "gpu_split") is None


def _exl3(**over: Any) -> WorkerSettings:
    return WorkerSettings(backend="exllamav3", model_dir=Path("/models/Llama-3-8B-exl3"), **over)


def test_exllamav3_defaults() -> None:
    c = _exl3()
    assert (c.max_seq_len, c.cache_size, c.chunk_size, c.max_batch_size) == (None, None, 2048, None)
    assert c.num_draft_tokens is None  # the drafter's own
    assert c.draft_mode is DraftMode.NONE and c.drafting is None


def test_draft_model_settings_are_accepted() -> None:
    c = _exl3(
        draft_mode="draft_model",
        draft_model_dir=Path("/models/draft"),
        cache_size=32768,
        draft_cache_size=32768,
        draft_cache_mode="Q8",
    )
    assert c.draft_mode is DraftMode.DRAFT_MODEL and c.drafting == "draft_model"


@pytest.mark.parametrize(
    ("over", "setting"),
    [
        ({"model_dir": None}, "model_dir"),
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
    kw: dict[str, Any] = {"backend": "exllamav3", "model_dir": Path("/m"), **over}
    with pytest.raises(ValueError, match=setting):
        WorkerSettings(**kw)
