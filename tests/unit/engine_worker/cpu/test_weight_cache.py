"""The CPU engine's quantized weights kept between starts (``weight_cache``): a
runner read back from the file computes what the one that quantized computes, the
file is found again only for the same weights and options, and a bad file is
rebuilt, not trusted."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from engine_worker.cpu import weight_cache
from engine_worker.cpu.backend import CpuBackend
from engine_worker.cpu.kernels import int4
from engine_worker.cpu.llama import LlamaRunner, QuantizedState, Segment
from engine_worker.cpu.model_store import LoadedModel
from engine_worker.cpu.quant import Quantization
from engine_worker.settings import WorkerSettings


def _logits(runner: LlamaRunner, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = runner.forward([Segment(runner.new_kv(64), tokens, len(tokens))])[0]
    assert out is not None
    return out


@pytest.mark.parametrize("quantization", [Quantization.INT4, Quantization.INT8])
def test_a_restored_runner_computes_the_same_logits(
    tiny: LoadedModel, tmp_path: Path, quantization: Quantization
) -> None:
    built = LlamaRunner(tiny.model, quantization, 64)
    path = tmp_path / "w.safetensors"
    weight_cache.save(path, built.quantized_state())
    state = weight_cache.load(path)
    assert state is not None
    restored = LlamaRunner(tiny.model, quantization, 64, quantized=state)
    # 40 tokens: the prompt path through the bfloat16 copies (32+), and 3: the quantized kernels
    for tokens in ([5, 9, 2] * 13 + [7], [5, 9, 2]):
        assert torch.equal(_logits(built, tokens), _logits(restored, tokens))


@pytest.mark.parametrize("extra", [0, 3, 61])
def test_tensors_read_back_are_aligned_for_the_kernels(tmp_path: Path, extra: int) -> None:
    """``save`` pads the header so the data starts on a 64-byte boundary, whatever
    the header's length (here a mode name of varying length); a file without the
    padding (safetensors' own 8-byte alignment) is read into aligned copies.
    An int8 weight 8 bytes past a boundary crashed ``torch._weight_int8pack_mm``."""
    tensors = {"a.weight": torch.arange(64 * 9, dtype=torch.int8).view(9, 64), "b.scales": torch.ones(32)}
    state = QuantizedState(tensors, {"layers.0.qkv": "int8" + "x" * extra})
    path = tmp_path / "w.safetensors"
    weight_cache.save(path, state)
    with path.open("rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % weight_cache.ALIGNMENT == 0
    unpadded = tmp_path / "plain.safetensors"
    safetensors.torch.save_file(tensors, str(unpadded), metadata={"pad": "x" * extra})
    for file in (path, unpadded):
        loaded = weight_cache.load(file)
        assert loaded is not None
        for name, tensor in tensors.items():
            assert loaded.tensors[name].data_ptr() % weight_cache.ALIGNMENT == 0, (file, name)
            assert torch.equal(loaded.tensors[name], tensor)
    assert weight_cache.load(path).modes == state.modes  # type: ignore[union-attr]


def _model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x" * 10)
    return d


def test_the_file_name_changes_with_the_weights_and_the_options(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    base = weight_cache.cache_file(tmp_path, d, "int4", True, "vnni")
    assert base == weight_cache.cache_file(tmp_path, d, "int4", True, "vnni")
    assert base.parent == tmp_path / "quantized" and base.name.startswith("model-int4-")
    assert base != weight_cache.cache_file(tmp_path, d, "int8", True, "vnni")
    assert base != weight_cache.cache_file(tmp_path, d, "int4", False, "vnni")
    if int4.available():  # the other layout is another file
        assert base != weight_cache.cache_file(tmp_path, d, "int4", True, "torch")
    (d / "model.safetensors").write_bytes(b"y" * 11)  # new weights
    assert base != weight_cache.cache_file(tmp_path, d, "int4", True, "vnni")


def test_an_unreadable_file_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "w.safetensors"
    assert weight_cache.load(path) is None
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    with caplog.at_level(logging.WARNING):
        assert weight_cache.load(path) is None
    assert "quantizing again" in caplog.text


def test_a_file_that_cannot_be_written_is_a_warning(
    tiny: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    state = LlamaRunner(tiny.model, Quantization.INT8, 16).quantized_state()
    with caplog.at_level(logging.WARNING):
        weight_cache.save(blocked / "sub" / "w.safetensors", state)  # a file where a folder must be
    assert "the next start quantizes again" in caplog.text


def test_the_backend_quantizes_once_then_reads_the_file(
    tiny: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = dataclasses.replace(tiny, folder=_model_dir(tmp_path))
    settings = WorkerSettings(cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="engine_worker.load"):
        first = CpuBackend(settings, loaded=loaded)
        files = list((tmp_path / "cache" / "quantized").iterdir())
        second = CpuBackend(settings, loaded=loaded)
    assert len(files) == 1 and os.path.getsize(files[0]) > 0
    stages = [r.getMessage() for r in caplog.records if r.getMessage().endswith("started")]
    assert stages == [
        "load: choose kernels (measured speed): started",
        "load: quantize weights (int4): started",
        "load: warm up (one forward pass): started",
        "load: choose kernels (measured speed): started",
        "load: read weights (int4): started",
        "load: warm up (one forward pass): started",
    ]
    assert torch.equal(_logits(first.runner, [1, 2, 3]), _logits(second.runner, [1, 2, 3]))
