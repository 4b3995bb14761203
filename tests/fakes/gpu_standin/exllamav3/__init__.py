"""Stand-in for the exllamav3 1.6.5 package (see ../README.md): its import runs ``ext``, as
the real one's does, then serves the fake engine of ``tests/fakes/exllamav3/``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.fakes import exllamav3 as _fake
from tests.fakes.exllamav3 import *  # noqa: F403
from tests.fakes.exllamav3 import model as _model

from . import ext  # noqa: F401  (the real package builds its extension on import)
from .version import __version__

# The check's random-weight model repeats its last token (scripts/gpu_check.py, phase_model).
_fake.DEFAULT_SCRIPT = lambda prompt, generated: [*prompt, *generated][-1]
_warmup = _fake.Model.warmup


def _warmup_with_triton(self: Any, *args: Any, **kwargs: Any) -> list[str]:
    """Kernels compiled at warm-up land in ``TRITON_CACHE_DIR``; the check keeps them only
    there (Triton's own default, ``~/.triton/cache``, is not kept)."""
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache:
        raise RuntimeError("stand-in Triton: TRITON_CACHE_DIR is not set; the kernels would not be kept")
    kernel = Path(cache) / "standin" / "paged_attention.json"
    kernel.parent.mkdir(parents=True, exist_ok=True)
    kernel.write_text('{"kernel": "paged_attention", "arch": "sm_90"}\n')
    return list(_warmup(self, *args, **kwargs))


_fake.Model.warmup = _warmup_with_triton  # type: ignore[method-assign]


# Knobs that make the vision component wrong, for the tests that the check then fails.
_EXTRA_ROWS = int(os.environ.get("GPU_CHECK_STANDIN_IMAGE_EXTRA_ROWS") or 0)
if _EXTRA_ROWS:
    _embed = _model.VisionModel.get_image_embeddings

    def _embed_with_extra_rows(self: Any, tokenizer: Any, image: Any, text_alias: str | None = None) -> Any:
        """The picture embedded as if ``28 * _EXTRA_ROWS`` pixels taller: more rows than its size gives."""
        wider = image.resize((image.size[0], image.size[1] + 28 * _EXTRA_ROWS))
        return _embed(self, tokenizer, wider, text_alias)

    _model.VisionModel.get_image_embeddings = _embed_with_extra_rows  # type: ignore[method-assign]

if os.environ.get("GPU_CHECK_STANDIN_VISION_LOAD") == "fails":

    def _load_fails(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("stand-in: the vision component failed to load")

    _model.VisionModel.load = _load_fails  # type: ignore[method-assign]
    _model.VisionModel.load_gen = _load_fails  # type: ignore[method-assign]
__all__ = ["__version__"]
