"""ExLlamaV3 backend: serves an EXL3 model on CUDA with ExLlamaV3 1.6.5.

- ``config``: the engine facts that constrain its options (``validate``) and their parsers.
- ``engine``: ``EngineHandle``, the engine surface the backend drives.
- ``backend``: ``ExLlamaV3Backend``, the one place where ``Generator.iterate()``
  results become protocol events.
- ``sampling``: request parameters -> ``ComboSampler``/``Job`` arguments.
- ``grammar``: constrained decoding with 1.6.5's ``LLGuidanceFilter``.
- ``logprobs``: the probabilities 1.6.5 returns, lined up with the streamed text.
- ``loader``: ``load_engine``/``build_backend``, the only module that imports
  ``torch`` and ``exllamav3`` (lazily, inside functions).

Importing this package never imports ``exllamav3``.
"""

from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.exllamav3.config import CacheMode
from engine_worker.exllamav3.engine import EngineHandle

__all__ = ["CacheMode", "EngineHandle", "ExLlamaV3Backend"]
