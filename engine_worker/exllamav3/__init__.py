"""ExLlamaV3 backend: serves an EXL3 model on CUDA with ExLlamaV3 1.6.5.

Importing this package never imports ``exllamav3``: only ``loader`` does, lazily,
inside functions.

| module | what |
|---|---|
| ``backend`` | ``ExLlamaV3Backend``: jobs enqueued, held, cancelled, ``iterate()`` stepped, faults repaired |
| ``results`` | one job's result dicts into protocol events, at this one place |
| ``segments`` | the pages 1.6.5 allocates for a job, segment by segment: its reservation |
| ``engine`` | ``EngineHandle``, the engine surface the backend drives |
| ``sampling`` | request parameters to ``ComboSampler`` and ``Job`` arguments |
| ``grammar`` | constrained decoding with 1.6.5's ``LLGuidanceFilter``; the thinking budget's filter |
| ``logprobs`` | the probabilities 1.6.5 returns, lined up with the streamed text |
| ``chat_template`` | the chat template rendered with the tokenizer transformers loads |
| ``vision`` | image embeddings by the vision component, kept by the bytes' hash; GPU turns |
| ``kv_pages`` | the page table's complete pages as KV-cache events |
| ``loader`` | ``load_engine``/``build_backend``: config, model, caches, generator, warm-up |
| ``sizes`` | the context, batch, draft window and cache size the model decides when the options do not |
"""

from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.exllamav3.engine import EngineHandle
from engine_worker.options.exllamav3 import CacheMode

__all__ = ["CacheMode", "EngineHandle", "ExLlamaV3Backend"]
