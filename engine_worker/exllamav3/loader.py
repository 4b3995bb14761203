"""Load an EXL3 model with ExLlamaV3 1.6.5 and wrap it in an ``EngineHandle``.

``torch`` and ``exllamav3`` are imported inside the functions: importing
exllamav3 compiles its CUDA extension, so nothing here may run at import time
of the worker package (the proxy and the tests import it without a GPU).

The load order follows ExLlamaV3's own ``model_init.py`` (1.6.5):

1. ``Config.from_directory`` and ``Model.from_config`` (``model_init.py:283``);
   an MTP head is ``Model.from_config(config, component="mtp")``
   (``model_init.py:284-288``, ``model/model.py:171-194``).
2. The caches, BEFORE any ``load()``: cache tensors are allocated by the loader
   for caches already attached (``cache/cache.py:143-147``). A draft cache has
   the main cache's size (``generator/generator.py:257``); ``max_history``
   covers the draft window for recurrent models (``model_init.py:291-297``).
3. The drafter's ``load`` before the main model's, which gets ``draft_model=``
   for its split (``model_init.py:379-405``). ``Model.load_gen`` yields
   ``(modules_done, modules_total)`` (``model/model_ls.py:140``,
   ``model/model_tp.py:615``): that drives the console progress bar.
4. ``Model.warmup`` before a generator owns the cache (``model/model.py:203``, ``232-233``).
5. ``Tokenizer.from_config`` (which extends ``config.eos_token_id_list`` from
   ``tokenizer_config.json``/``generation_config.json``, ``tokenizer/tokenizer.py:199-215``),
   then ``Generator``. Every keyword passed exists in ``Generator.__init__``
   (``generator/generator.py:41-73``), which would silently swallow a typo.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.exllamav3.config import PAGE_SIZE, CacheMode, parse_split
from engine_worker.exllamav3.engine import EngineHandle
from engine_worker.settings import DraftMode, WorkerSettings

log = logging.getLogger(__name__)

DEFAULT_NGRAM_DRAFT_TOKENS = 4
"""Draft window when none is configured (``generator/generator.py:275``)."""


def _round_up_pages(n: int) -> int:
    return -(-n // PAGE_SIZE) * PAGE_SIZE


def _cache_kwargs(ex: Any, mode: CacheMode) -> dict[str, Any]:
    if mode.bits is None:
        return {"layer_type": ex.CacheLayer_fp16}
    k_bits, v_bits = mode.bits
    return {"layer_type": ex.CacheLayer_quant, "k_bits": k_bits, "v_bits": v_bits}


def _progress_bar(steps: Iterable[Any], label: str) -> None:
    """Drain a ``load_gen``-style generator of ``(done, total)`` with a tqdm bar on stderr."""
    from tqdm import tqdm

    with tqdm(desc=label, unit="module", file=sys.stderr, dynamic_ncols=True) as bar:
        for step in steps:
            if isinstance(step, tuple) and len(step) == 2:
                done, total = step
                bar.total = int(total)
                bar.n = int(done)
                bar.refresh()


def _start_moe_cpu_hosts(model: Any) -> None:
    """What ``Model.load`` does after draining ``load_gen`` (``model/model.py:767-772``):
    make sure the worker processes of CPU-offloaded MoE experts are up before the first
    forward pass. ``ensure_started`` is idempotent; configs without offload have none."""
    for host in getattr(model.config, "moe_cpu_hosts", {}).values():
        host.ensure_started()


def _wants_bos(tokenizer: Any) -> bool:
    """Whether the model's own tokenizer puts BOS in front of plain text: ``add_bos_token``
    in ``tokenizer_config.json`` (Llama 2, Mistral, Gemma) or a post-processor that adds it
    (Llama 3). Models like Qwen have a ``bos_token_id`` in ``config.json`` but do not use it."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    cfg = getattr(tokenizer, "tokenizer_config_dict", None) or {}
    if cfg.get("add_bos_token") is True:
        return True
    try:
        return list(tokenizer.tokenizer.encode("a", add_special_tokens=True).ids[:1]) == [bos]
    except Exception:
        return False


def load_engine(config: WorkerSettings) -> EngineHandle:
    """Load model, drafter, caches, tokenizer and generator as ``config`` says.

    Shows a progress bar per model load on stderr. Raises ``RuntimeError`` without
    CUDA, ``ValueError`` for a configuration the model cannot serve (no MTP head),
    and whatever ExLlamaV3 raises for an unreadable model directory or too little VRAM.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the exllamav3 backend needs a CUDA GPU (torch.cuda.is_available() is False)")
    import exllamav3 as ex

    mode = config.draft_mode
    model_dir = config.model_dir
    assert model_dir is not None  # checked by exllamav3.config.validate
    ex_config = ex.Config.from_directory(str(model_dir))
    mpe = int(getattr(ex_config, "max_position_embeddings", 0) or 0)
    if config.max_seq_len:
        max_seq_len = config.max_seq_len
        # A no-op in 1.6.5 (model/config.py:337-343); kept because later versions use it to pick
        # the RoPE factors of models with two sets (Phi) before the model is created.
        ex_config.override_dynamic_seq_len(max_seq_len)
    elif config.cache_size:
        max_seq_len = min(mpe, config.cache_size) if mpe else config.cache_size
    else:
        max_seq_len = mpe or 4096
    model = ex.Model.from_config(ex_config)
    recurrent = bool(model.caps.get("recurrent_states"))
    max_batch = config.max_batch_size or (4 if recurrent else 32)

    draft_model: Any = None
    draft_label = ""
    if mode is DraftMode.DRAFT_MODEL:
        assert config.draft_model_dir is not None  # checked by exllamav3.config.validate
        draft_config = ex.Config.from_directory(str(config.draft_model_dir))
        draft_model = ex.Model.from_config(draft_config)
        draft_label = f"draft model {config.draft_model_dir.name}"
    elif mode is DraftMode.MTP:
        if "mtp" not in getattr(ex_config, "model_classes", {}):
            raise ValueError(
                f"draft_mode=mtp: {model_dir} ({ex_config.architecture}) has no MTP head in ExLlamaV3"
            )
        draft_model = ex.Model.from_config(ex_config, component="mtp")
        draft_label = "MTP head"

    if config.num_draft_tokens is not None:
        draft_window = config.num_draft_tokens
    elif draft_model is not None:
        draft_window = int(draft_model.caps.get("default_draft_size", DEFAULT_NGRAM_DRAFT_TOKENS))
    elif mode is DraftMode.NGRAM:
        draft_window = DEFAULT_NGRAM_DRAFT_TOKENS
    else:
        draft_window = 0
    cache_size = config.cache_size or _round_up_pages(max_seq_len + 1 + draft_window)

    cache = ex.Cache(
        model,
        max_num_tokens=cache_size,
        max_batch_size=max_batch,
        max_history=draft_window,
        **_cache_kwargs(ex, CacheMode.parse(config.cache_mode)),
    )
    draft_cache = None
    if draft_model is not None:
        draft_cache = ex.Cache(
            draft_model,
            max_num_tokens=cache_size,
            max_batch_size=max_batch,
            max_history=draft_window,
            **_cache_kwargs(ex, CacheMode.parse(config.draft_cache_mode, "draft_cache_mode")),
        )

    gpu_split = parse_split(config.gpu_split, "gpu_split")
    split = list(gpu_split) if gpu_split else None
    with torch.inference_mode():
        if draft_model is not None:
            # use_per_device counts on top of what is already allocated (model/model.py:522-526):
            # reusing gpu_split here would let drafter + model take about twice the split.
            draft_gpu_split = parse_split(config.draft_gpu_split, "draft_gpu_split")
            draft_split = list(draft_gpu_split) if draft_gpu_split else None
            _progress_bar(
                draft_model.load_gen(use_per_device=draft_split, max_chunk_size=config.chunk_size),
                f"Loading {draft_label}",
            )
            _start_moe_cpu_hosts(draft_model)
        _progress_bar(
            model.load_gen(
                use_per_device=split,
                tensor_p=config.tensor_parallel,
                tp_backend=config.tensor_parallel_backend,
                max_chunk_size=config.chunk_size,
                draft_model=draft_model,
            ),
            f"Loading {model_dir.name}",
        )
        _start_moe_cpu_hosts(model)
    if config.warmup:
        log.info("exllamav3: warming up (kernel compilation and tuning)")
        failed = model.warmup(cache=cache, max_chunk_size=config.chunk_size, max_batch_size=max_batch)
        # warmup() reports a failing pass and goes on; it returns their labels (model/model.py:252-253).
        if failed:
            log.warning(
                "exllamav3: warmup passes failed (first use will compile them): %s", ", ".join(failed)
            )

    tokenizer = ex.Tokenizer.from_config(ex_config)
    eos_ids = tuple(dict.fromkeys(int(e) for e in ex_config.eos_token_id_list))
    generator = ex.Generator(
        model=model,
        cache=cache,
        tokenizer=tokenizer,
        max_batch_size=max_batch,
        max_chunk_size=config.chunk_size,
        draft_model=draft_model,
        draft_cache=draft_cache,
        num_draft_tokens=config.num_draft_tokens if mode is not DraftMode.NONE else None,
        ngram_match_min=config.ngram_match_min if mode is DraftMode.NGRAM else 0,
    )
    bos_ok = _wants_bos(tokenizer)
    bos_text = getattr(tokenizer, "bos_token", None) or None

    def encode(text: str, add_bos: bool) -> Any:
        # A prompt that already starts with the BOS text (a pre-rendered template) gets no second one.
        bos = add_bos and bos_ok and not (bos_text and text.startswith(bos_text))
        return tokenizer.encode(text, add_bos=bos, encode_special_tokens=True)

    def encode_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> Any:
        return tokenizer.hf_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(torch.tensor(ids, dtype=torch.long), decode_special_tokens=False))

    def close() -> None:
        generator.close()
        model.unload()
        if draft_model is not None:
            draft_model.unload()

    return EngineHandle(
        generator=generator,
        new_job=ex.Job,
        new_sampler=ex.ComboSampler,
        encode=encode,
        encode_chat=encode_chat,
        decode=decode,
        pieces=tokenizer.get_id_to_piece_list(False),
        eos_token_ids=eos_ids,
        vocab_size=int(tokenizer.actual_vocab_size),
        max_position_embeddings=mpe or max_seq_len,
        cache_tokens=int(generator.max_total_tokens),
        max_draft_tokens=int(generator.max_draft_tokens),
        drafting=config.drafting,
        model_id=model_dir.name,
        close=close,
        max_batch_size=max_batch,
    )


def build_backend(config: WorkerSettings) -> ExLlamaV3Backend:
    """Load the model (progress bar on stderr) and return the backend serving it."""
    handle = load_engine(config)
    backend = ExLlamaV3Backend(handle, config)
    info = backend.info
    log.info(
        "exllamav3: %s loaded: context %d tokens, cache %d tokens (%s), drafting %s",
        info.model_id,
        info.max_context_tokens,
        handle.cache_tokens,
        CacheMode.parse(config.cache_mode),
        info.drafting or "off",
    )
    return backend
