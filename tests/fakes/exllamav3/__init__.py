"""A fake of the exllamav3 1.6.5 surface the worker uses, runnable without CUDA.

It stands in for ``import exllamav3`` (``Config``, ``Model``, ``Cache``,
``CacheLayer_fp16``, ``CacheLayer_quant``, ``Tokenizer``, ``Generator``, ``Job``,
``ComboSampler``) and emits exactly the result dicts of
``Generator.iterate()``, quirks included. It follows the control flow of the
1.6.5 wheel (paths below are under ``exllamav3/``), with a scripted "model"
choosing tokens instead of a network:

- ``iterate()`` (``generator/generator.py:674-836``): start pending jobs, one
  prefill pass per active job (with the shared chunk size and cooldown while
  another job decodes, lines 763-786), then one decode or speculative
  verification pass. Several dicts per job per call: ``"started"``,
  ``"prefill"`` and ``"streaming"`` in one call, and one ``"streaming"`` dict per
  accepted draft position (``generator.py:1897-1913``).
- ``"started"`` when pages are allocated, with ``identifier`` only when the job
  has one (``generator.py:2165-2222``); jobs that do not fit the batch or the
  free pages wait (``generator.py:2189-2192``).
- Paged prefix cache of 256-token pages: prompt pages hashed as a chain
  (``generator/pagetable.py:240-259``), reused by hash at allocation, counted as
  cached when already filled (``pagetable.py:650-673``); pages a sibling job
  filled since are skipped and counted during prefill (``generator/job.py:1424-1436``);
  a token-level match inside the first uncached page copies keys from any page
  with the same predecessor (``job.py:1459-1499``), counted in ``cached_tokens``.
  Unreferenced pages keep their content until evicted. Pages a job reserves
  for new tokens are backed up and, if the job never writes them, restored on
  release (``pagetable.py:112-127``, ``153-177``); any prefill or decode write
  clears that (``job.py:1435,1497,1662``, ``generator.py:1678``). A page missing by
  hash is cleared with no backup (``pagetable.py:140-150``). A completed page
  whose hash another page holds takes over that page if referenced, else clears
  it (``job.py:652-697``).
- MTP (a drafter with ``caps["mtp_draft"]``): the page holding the last prompt
  token is left out of the reusable prefix and allocated fresh
  (``job.py:1329-1333``, ``pagetable.py:291-296``), and the token-level match
  leaves the last prompt token to prefill (``job.py:1476-1479``).
- ``Tokenizer.decode`` wants a tensor (anything with ``.tolist()`` here) and drops
  every EOS, pad and above-vocabulary id (``tokenizer/tokenizer.py:556-562``,
  ``608-613``). ``max_skips=None`` fails with ``TypeError`` once a job is skipped,
  as in 1.6.5 (``generator.py:2196``).
- ``"prefill"`` only when the pass advanced (``job.py:1682-1693``), with
  ``curr_progress`` up to ``len(prompt) - 1``: a fully cached, page-aligned prompt
  emits none (``job.py:1453``).
- Token acceptance (``job.py:781-1191``): stop tokens end the job without
  flushing the held text, which stays in ``"held"`` with the stop token's piece
  (``job.py:978-993``, ``948-962``); ``max_new_tokens`` flushes it; text with an
  incomplete UTF-8 character is held until it completes (``job.py:1005-1016``);
  a partial stop-string match is held, a full one ends the job with the rest in
  ``"held"`` (``job.py:1161-1183``, matching rules of
  ``exllamav3_ext/generator/strings.cpp:partial_strings_match``).
- ``"requeue": True`` when ``max_rq_tokens`` is reached (``job.py:815``,
  ``879``); the job object then re-initialises itself with its sequence as the
  prompt, keeps its serial and held text (``job.py:1194-1261``) and goes to the
  front of the queue (``generator.py:2126-2128``), so it emits ``"started"`` and
  ``"prefill"`` again mid-stream.
- EOS dict keys (``job.py:926-946``), ``accepted_draft_tokens``/
  ``rejected_draft_tokens`` only when the generator drafts (``job.py:942``);
  drafted positions past an EOS count as rejected and the EOS dict is patched
  (``generator.py:1925-1940``); after the first mismatch the rest of the window
  is rejected (``generator.py:1770-1775``, ``1956-1962``).
- A failure inside a job's prefill is contained: the job is dropped and an
  ``"error"`` dict with ``job``/``serial``/``stage``/``eos``/``error`` and no
  ``identifier`` is appended (``generator.py:2135-2162``, ``781-787``).
- ``enqueue`` asserts the job can ever fit, with 1.6.5's message
  (``job.py:1340-1344``), after capping ``max_new_tokens`` to the room left
  (``job.py:1287-1292``).
- ``decode_special_tokens`` picks the piece list of each sampled token
  (``job.py:971``) and the decode that repairs held text (``job.py:887-893``,
  ``1005-1016``), and survives a re-queue (``job.py:1246``); with ``True`` every
  special token is its text (``tokenizer/tokenizer.py:727-736``).
- ``Tokenizer.hf_chat_template`` renders with ``hf_tokenizer``, loading
  ``AutoTokenizer`` from the model directory on first use when none is set
  (``tokenizer/tokenizer.py:86``, ``866-876``); ``write_hf_tokenizer`` writes real
  ``transformers`` tokenizer files with the fake's ids.
- Faults out of ``iterate()``: ``NonFiniteLogits`` on a job's first sample
  (``job.py:21``, ``742-750``); a new ``Generator`` over the same cache supersedes
  the old one, which then drops its jobs and refuses to run (``generator.py:242-245``,
  ``741-749``); ``close()`` leaves model and cache for a replacement
  (``generator.py:839-871``). ``Model.device_error`` (fake-only) stands for a
  sticky CUDA error, which fails every later GPU call.
- ``Cache.layers`` report ``storage_size``/``overhead_size`` as FP16 and quantized
  cache layers compute them (``cache/fp16.py:92-98``, ``cache/quant.py:137-147``).
- Filters: ``Filter``, ``LLGuidanceFilter`` and ``create_ll_tokenizer`` are 1.6.5's
  (``generator/filter/filter.py``, ``llguidance.py``) over the real ``llguidance`` and a
  real ``tokenizers`` vocabulary with the fake's ids (``Tokenizer.tokenizer``). Filters
  are attached and reset when the job starts (``Job.activate``, ``job.py:1764-1773``,
  from ``iterate_start_jobs``, ``generator.py:2204``), not on a re-queue; fed every
  sampled token first (``job.py:807-811``); a completed filter with
  ``eos_after_completed`` ends the job as ``"end_filter"`` after the stop-token and
  ``max_new_tokens`` checks (``job.py:992-1002``). Masks apply to every sampled
  position, drafted ones included, with the filter advanced by the tokens accepted
  before it (``generator.py:1958-1983``): a draft token is accepted only if it equals the
  masked sample. Stop tokens are masked before ``min_new_tokens`` (``job.py:461-462``).
  Under a mask the fake model's choice falls to the allowed token with the lowest id.
- Probabilities: the fake model's raw distribution is ``raw_probs(script choice)``;
  ``return_probs``/``return_top_tokens`` report it whatever the mask, bias or sampler
  settings did (softmax of the raw logits, ``job.py:764-778``), buffered with the held
  tokens and sent with their ``token_ids`` (``job.py:902-907``, ``981-985``), in ``held``
  at a stop token (``job.py:949-961``), carried over a re-queue (``job.py:1217-1219``).
- Vision (``mm_embedding.py``, ``model.VisionModel``): a config with a ``vision_config``
  has a ``"vision"`` component (``model/model.py:186-190``); its ``get_image_embeddings``
  returns an ``MMEmbedding`` whose ids come from one per-process allocator counting from
  1,000,000,000 (``tokenizer/mm_embedding.py:4-21``), wrapped in the start and end tokens
  (``architecture/qwen3_vl.py:405-407``). ``Job(embeddings=...)`` keeps them over a
  re-queue (``generator/job.py:1254``) and refuses image ids no embedding covers (fake-only:
  1.6.5 would read uninitialised rows). Pages from the first one holding an image id on are
  ``persistable = False`` (``generator/pagetable.py:295-297``). ``decode`` drops image ids
  (``tokenizer/tokenizer.py:567-568``). MRoPE positions, atomic multimodal prefill and
  aligned embeddings' model side are not modelled.
- ``hf_chat_template`` forwards keywords (``tools``) to ``apply_chat_template``
  (``tokenizer/tokenizer.py:830-832``, ``870-876``); ``hf_tokenizer(template)`` makes a
  real ``transformers`` tokenizer with any template (``QWEN_TOOLS_TEMPLATE`` renders tools).

Deliberately stricter than 1.6.5: ``Job``, ``Generator``, ``Cache`` and
``ComboSampler`` take exactly the 1.6.5 parameter names and no ``**kwargs``, so a
(``CustomSampler`` and the ``SS_*`` steps the backend's XTC stack uses record their
arguments; a logit bias of ``-inf`` bans its token, as ``LogitBias`` does)
misspelt keyword fails here instead of being ignored; features the worker does
not use (token healing, banned strings, ``return_logits``, loop
detection, recurrent models) raise ``NotImplementedError``. N-gram drafting follows 1.6.5's
suffix automaton (``_SuffixAutomaton``); the drafting *model* is the script, so acceptance
rates are the fake model's, not a real one's.

The fake is laid out like the wheel's modules (``Tokenizer`` in ``tokenizer.py``, ``Job``
in ``job.py``, the page table in ``pagetable.py``, and so on; each module's docstring says
what of the wheel it mirrors), and this package re-exports them all, so
``from tests.fakes import exllamav3`` serves as ``import exllamav3``. ``make_handle``
(``handle.py``) is a test helper, not the wheel's.
"""

from __future__ import annotations

from .cache import Cache, CacheLayer_fp16, CacheLayer_quant
from .cache import _CacheLayerSize as _CacheLayerSize
from .constants import PAGE_SIZE
from .filter import FJ_ACCEPT, FJ_COMPLETE, FJ_PASS, FJ_TRIGGER, Filter, LLGuidanceFilter, create_ll_tokenizer
from .generator import Generator
from .handle import make_handle, vision_model
from .job import Job
from .mm_embedding import FIRST_MM_EMBEDDING_INDEX, MMEmbedding
from .model import (
    DEFAULT_SCRIPT,
    DOMINANT_BIAS,
    RAW_LOGIT_FIRST,
    RAW_LOGIT_SECOND,
    Config,
    Model,
    NonFiniteLogits,
    Script,
    VisionModel,
    by_prompt,
    image_rows,
    raw_probs,
    reply,
    top_k,
)
from .ngram import _SuffixAutomaton as _SuffixAutomaton
from .pagetable import _chain_hash as _chain_hash
from .pagetable import _Page as _Page
from .pagetable import _PageTable as _PageTable
from .sampler import (
    SS_DRY,
    SS_XTC,
    ComboSampler,
    CustomSampler,
    SS_LogitBias,
    SS_MinP,
    SS_PresFreqP,
    SS_RepP,
    SS_Sample,
    SS_Temperature,
    SS_TopK,
    SS_TopP,
)
from .tensor import FakeArray, FakeTensor
from .tokenizer import (
    BOS,
    CHATML_TEMPLATE,
    EOS,
    IM_END,
    IM_START,
    QWEN_TOOLS_TEMPLATE,
    SPECIAL_PIECES,
    VOCAB_SIZE,
    ChatMLTemplate,
    Tokenizer,
    hf_tokenizer,
    write_hf_tokenizer,
)
from .tokenizer import _byte_symbols as _byte_symbols

__version__ = "1.6.5+fake"

__all__ = [
    "BOS",
    "CHATML_TEMPLATE",
    "DEFAULT_SCRIPT",
    "DOMINANT_BIAS",
    "EOS",
    "FIRST_MM_EMBEDDING_INDEX",
    "FJ_ACCEPT",
    "FJ_COMPLETE",
    "FJ_PASS",
    "FJ_TRIGGER",
    "IM_END",
    "IM_START",
    "PAGE_SIZE",
    "QWEN_TOOLS_TEMPLATE",
    "RAW_LOGIT_FIRST",
    "RAW_LOGIT_SECOND",
    "SPECIAL_PIECES",
    "SS_DRY",
    "SS_XTC",
    "VOCAB_SIZE",
    "Cache",
    "CacheLayer_fp16",
    "CacheLayer_quant",
    "ChatMLTemplate",
    "ComboSampler",
    "Config",
    "CustomSampler",
    "FakeArray",
    "FakeTensor",
    "Filter",
    "Generator",
    "Job",
    "LLGuidanceFilter",
    "MMEmbedding",
    "Model",
    "NonFiniteLogits",
    "SS_LogitBias",
    "SS_MinP",
    "SS_PresFreqP",
    "SS_RepP",
    "SS_Sample",
    "SS_Temperature",
    "SS_TopK",
    "SS_TopP",
    "Script",
    "Tokenizer",
    "VisionModel",
    "by_prompt",
    "create_ll_tokenizer",
    "hf_tokenizer",
    "image_rows",
    "make_handle",
    "raw_probs",
    "reply",
    "top_k",
    "vision_model",
    "write_hf_tokenizer",
]
