"""With ``GPU_CHECK_STANDIN=1``: torch, when something imports it, reports CUDA 13.0 and
one capability 9.0 device that it cannot run work on (``device_count()`` stays 0, so
nothing allocates on it; ``synchronize()`` returns at once). The proxy process, which
never imports torch, stays without it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any


def _patch(torch: Any) -> None:
    torch.version.cuda = "13.0"
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda device=None: "stand-in (no GPU)"
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    # nothing ever runs on the stand-in device, so there is nothing to wait for
    torch.cuda.synchronize = lambda device=None: None


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    """Hands out torch's spec with a loader that patches the module once executed (a
    ``find_spec`` alone, as transformers' availability checks do, loads nothing)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("GPU_CHECK_STANDIN") == "1":
    sys.meta_path.insert(0, _PatchTorchOnImport())
