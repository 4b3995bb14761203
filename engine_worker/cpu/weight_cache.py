"""The CPU engine's quantized weights, kept on disk between starts.

Quantizing a model's linear layers (``llama.QuantizedLinear``: int4 codes per group
of 32, int8 for the LM head, bfloat16 copies for prefill) took 5-6 s of a 14 s
start of the embedded model on 2 idle cores and 10-39 s on a busy machine, after
the model's own "Loading weights 100%" and before the worker served. The result
depends only on the weights, the options and torch, so the first start saves it
(one safetensors file under ``cache_dir``) and later starts read it back.

The file's name carries a fingerprint of what the result depends on: the model
folder's resolved path and each ``config.json`` / weights file's size and
modification time, ``--quantization``, ``--dense-prefill``, the torch version (the
int4 kernel's packed layout is torch's), which int4 kernel the layers run
(``int4.LAYOUT`` or torch's, as ``kernel_choice`` chose: their layouts differ) and
``FORMAT``. A changed model or option never matches a stale file; a file that cannot
be read is ignored (and rebuilt), and one that cannot be written costs only the
speed-up. The tensors read back are mapped from the file (safetensors'
``safe_open``): pages of the system's file cache, read on first touch (the warm-up
pass) and shared by workers on one machine; a file replaced later (``save`` renames
a new one into place) leaves a running worker's mapping intact. The kernels need
their tensors ``ALIGNMENT``-byte aligned: ``save`` pads the header so that the data
starts on such a boundary, and ``load`` copies any tensor that is not (a file
written before, or a tensor whose predecessors' sizes are not multiples of it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine_worker.cpu.kernels import int4
from engine_worker.cpu.llama import QuantizedState
from engine_worker.cpu.quant import LAYERS_VNNI

log = logging.getLogger(__name__)

FORMAT = 3
"""Bump when ``LlamaRunner.quantized_state``'s names or layouts change."""

ALIGNMENT = 64
"""Bytes a tensor's data must be aligned to, as torch's CPU allocator aligns it.
safetensors aligns its data section to 8 bytes only, and
``torch._weight_int8pack_mm`` dies with a general protection fault on int8
weights at an address 8 bytes past a 64-byte boundary (``--quantization int8``,
second start, 2026-12-01)."""

_ALIGN_KEY = "align"
"""Metadata whose value (spaces) pads the header to ``ALIGNMENT``."""

_MODES_PREFIX = "mode:"


def cache_file(
    cache_dir: Path, model_dir: Path, quantization: str, dense_prefill: bool, int4_kernel: str
) -> Path:
    """Where the quantized weights of ``model_dir`` under these options are kept,
    ``int4_kernel`` the layers' kernel (``llama.Kernels.layers``: its layout)."""
    h = hashlib.sha256()
    root = model_dir.resolve()
    kernel = int4.LAYOUT if int4_kernel == LAYERS_VNNI and int4.available() else "torch"
    h.update(f"{FORMAT}\0{root}\0{quantization}\0{dense_prefill}\0{torch.__version__}\0{kernel}\0".encode())
    for p in sorted(root.iterdir()):
        if p.name == "config.json" or p.suffix in (".safetensors", ".bin"):
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return cache_dir / "quantized" / f"{model_dir.name}-{quantization}-{h.hexdigest()[:16]}.safetensors"


def load(path: Path) -> QuantizedState | None:
    """The state saved at ``path``; ``None`` when there is none or it cannot be read."""
    if not path.is_file():
        return None
    try:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensor = f.get_tensor(key)
                tensors[key] = tensor.clone() if tensor.data_ptr() % ALIGNMENT else tensor
    except Exception as e:  # a truncated or foreign file: rebuild it
        log.warning("ignoring the quantized weights in %s (%s); quantizing again", path, e)
        return None
    modes = {k.removeprefix(_MODES_PREFIX): v for k, v in metadata.items() if k.startswith(_MODES_PREFIX)}
    return QuantizedState(tensors, modes)


def _padding(path: Path) -> int:
    """Characters to add to the header of the safetensors file at ``path`` (a JSON
    string value in it) so that its data section starts on an ``ALIGNMENT``
    boundary: the file is an 8-byte little-endian header length, the header
    (JSON, padded with spaces to a multiple of 8), then the data."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        unpadded = len(f.read(length).rstrip(b" "))
    # The padded header ends on a multiple of 8, so start + 8 is aligned exactly
    # when the unpadded header plus the added characters is ALIGNMENT - 8 modulo it.
    return (ALIGNMENT - 8 - unpadded) % ALIGNMENT


def save(path: Path, state: QuantizedState) -> None:
    """Write ``state`` to ``path`` atomically (a temporary sibling, then a rename);
    an error is one WARNING, never a failed start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            metadata = {_MODES_PREFIX + k: v for k, v in state.modes.items()}
            tensors = {k: v.contiguous() for k, v in state.tensors.items()}
            metadata[_ALIGN_KEY] = ""
            save_file(tensors, tmp, metadata=metadata)
            pad = _padding(Path(tmp))
            if pad:  # written again with the header that many bytes longer
                metadata[_ALIGN_KEY] = " " * pad
                save_file(tensors, tmp, metadata=metadata)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as e:
        log.warning(
            "could not keep the quantized weights in %s (%s); the next start quantizes again", path, e
        )
