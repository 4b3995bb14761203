"""The GGUF conversion cache: atomic, reused, and never left half-written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_worker.cpu import model_store
from engine_worker.settings import WorkerSettings, default_cache_dir
from tests.fakes.cpu import FakeModel, FakeTokenizer


@pytest.fixture
def fake_loaders(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    state: dict[str, Any] = {"loads": 0, "fail": False}

    def load_model(*args: Any, **kwargs: Any) -> FakeModel:
        state["loads"] += 1
        return FakeModel(state["fail"])

    monkeypatch.setattr(model_store.AutoModelForCausalLM, "from_pretrained", load_model)
    monkeypatch.setattr(model_store.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer())
    return state


def test_conversion_is_atomic_and_done_once(tmp_path: Path, fake_loaders: dict[str, Any]) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    target = model_store.converted_dir(tmp_path / "cache", gguf)
    assert target.name == "m-10-v1"

    fake_loaders["fail"] = True
    with pytest.raises(OSError, match="disk full"):
        model_store.convert_gguf(gguf, target)
    assert list((tmp_path / "cache").iterdir()) == []  # no partial folder, no temp leftovers

    fake_loaders["fail"] = False
    assert model_store.convert_gguf(gguf, target) == target
    assert sorted(p.name for p in target.iterdir()) == [
        "conversion-complete",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert model_store.convert_gguf(gguf, target) == target
    assert fake_loaders["loads"] == 2  # the failed attempt and one conversion; the third call reused it
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [target.name]


def test_stray_folder_without_marker_is_replaced(tmp_path: Path, fake_loaders: dict[str, Any]) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    target = model_store.converted_dir(tmp_path, gguf)
    target.mkdir()
    (target / "junk").write_text("half")
    model_store.convert_gguf(gguf, target)
    assert (target / "conversion-complete").is_file() and not (target / "junk").exists()


def test_default_cache_dir_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "exl3-sidecar"
    assert WorkerSettings().cache_dir == tmp_path / "exl3-sidecar"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "exl3-sidecar"


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(model_store.ModelNotFound):
        model_store.load_model(tmp_path)
