"""Load an EXL3 model with ExLlamaV3 1.6.5 and wrap it in an ``EngineHandle``.

``torch`` and ``exllamav3`` are imported inside the functions: importing
exllamav3 compiles its CUDA extension, so nothing here may run at import time
of the worker package (the proxy and the tests import it without a GPU).

The load order follows ExLlamaV3's own ``model_init.py`` (1.6.5), with the
tokenizer first:

0. ``Config.from_directory``, ``Tokenizer.from_config`` (which extends
   ``config.eos_token_id_list`` from ``tokenizer_config.json``/``generation_config.json``,
   ``tokenizer/tokenizer.py:199-215``) and the chat template
   (``engine_worker.exllamav3.chat_template``): a model that cannot render chat
   stops the worker before any weight is read. The template's turn-end text
   becomes a stop string, and its token a stop token when it is one.
1. ``Model.from_config`` (``model_init.py:283``); an MTP head is
   ``Model.from_config(config, component="mtp")`` (``model_init.py:284-288``,
   ``model/model.py:171-194``).
2. The caches, BEFORE any ``load()``: cache tensors are allocated by the loader
   for caches already attached (``cache/cache.py:143-147``). A draft cache has
   the main cache's size (``generator/generator.py:257``); ``max_history``
   covers the draft window for recurrent models (``model_init.py:291-297``).
   When cache and weights will not fit the free VRAM, a warning says so
   (``warn_if_cache_exceeds_vram``).
3. The drafter's ``load`` before the main model's, which gets ``draft_model=``
   for its split (``model_init.py:379-405``). ``Model.load_gen`` yields
   ``(modules_done, modules_total)`` (``model/model_ls.py:140``,
   ``model/model_tp.py:615``): that drives the console progress bar.
4. ``Model.warmup`` before a generator owns the cache (``model/model.py:203``, ``232-233``).
5. ``Generator``: every keyword passed exists in ``Generator.__init__``
   (``generator/generator.py:41-73``), which would silently swallow a typo.
   With warm-up on, one short job runs through it (``_warm_generator``).

The handle can rebuild the generator over the same model and cache and probe
the GPU, which the backend uses to recover from a fault in a step. It also
carries the chat template's source (``Ready.chat_template``), renders chat with
``tools`` (``hf_chat_template`` forwards keywords to ``apply_chat_template``,
``tokenizer/tokenizer.py:830-832``, ``870-876``), builds 1.6.5's
``LLGuidanceFilter`` per grammar (``engine_worker.exllamav3.grammar``) and
reaches the llguidance tokenizer those filters share (``create_ll_tokenizer``,
``generator/filter/llguidance.py:180-192``; built on first use, for token bytes).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine_worker.exllamav3 import chat_template
from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.exllamav3.config import PAGE_SIZE, CacheMode, parse_split
from engine_worker.exllamav3.engine import EngineHandle
from engine_worker.exllamav3.grammar import contained_filter_class, filter_factory
from engine_worker.settings import DraftMode, WorkerSettings

log = logging.getLogger(__name__)

DEFAULT_NGRAM_DRAFT_TOKENS = 4
"""Draft window when none is configured (``generator/generator.py:275``)."""

GIB = 1024**3


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


def _cache_bytes(cache: Any) -> int | None:
    """VRAM the cache's tensors will take: ``storage_size`` plus ``overhead_size`` of each
    layer (``cache/fp16.py:92-98``, ``cache/quant.py:137-147``); ``None`` if unknown."""
    try:
        return sum(int(layer.storage_size()) + int(layer.overhead_size()) for layer in cache.layers.values())
    except Exception:
        return None


def _weights_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def _free_vram_bytes(split: list[float] | None) -> int:
    """Free memory on the visible GPUs, bounded by ``split`` (GB per GPU) when given."""
    import torch

    free = 0
    for i in range(torch.cuda.device_count()):
        avail = int(torch.cuda.mem_get_info(i)[0])
        if split is not None:
            avail = min(avail, int(split[i] * GIB)) if i < len(split) else 0
        free += avail
    return free


def warn_if_cache_exceeds_vram(
    cache_bytes: int | None, weights_bytes: int, free_bytes: int, cache_size: int, defaulted: bool
) -> bool:
    """Log a warning when the KV cache and the weights together exceed the free VRAM
    (a default cache is the model's whole context: tens of GB for 1M-token models).
    Returns whether it warned."""
    if cache_bytes is None or cache_bytes + weights_bytes <= free_bytes:
        return False
    source = "the model's context (no --cache-size)" if defaulted else "--cache-size"
    log.warning(
        "exllamav3: the KV cache of %d tokens (%s) takes %.1f GiB; with %.1f GiB of weights that exceeds "
        "the %.1f GiB of free VRAM: loading will likely fail. Lower --cache-size or --max-seq-len, or "
        "quantize the cache (--cache-mode 8,8)",
        cache_size,
        source,
        cache_bytes / GIB,
        weights_bytes / GIB,
        free_bytes / GIB,
    )
    return True


def _warm_generator(ex: Any, generator: Any, tokenizer: Any, new_tokens: int) -> float:
    """Run one short job through ``generator``: ``Model.warmup`` skips MTP and DFlash
    drafters (``model/model.py:259-260``, "the generator's own draft passes warm
    those"), so without this the first request would compile their kernels inside a
    step. Returns the seconds it took."""
    t0 = time.monotonic()
    job = ex.Job(
        input_ids=tokenizer.encode("Warm-up: one, two, three, one, two, three,"),
        max_new_tokens=new_tokens,
        sampler=ex.ComboSampler(temperature=0.0),
        stop_conditions=[],
        decode_special_tokens=True,
        identifier="warm-up",
    )
    generator.enqueue(job)
    for _ in range(10 * new_tokens + 100):
        if not generator.num_remaining_jobs():
            break
        generator.iterate()
    else:
        generator.cancel(job)  # never left waiting beside the first requests
    return time.monotonic() - t0


def load_engine(config: WorkerSettings) -> EngineHandle:
    """Load tokenizer and chat template, model, drafter, caches and generator as
    ``config`` says.

    Shows a progress bar per model load on stderr. Raises ``RuntimeError`` without
    CUDA, ``ValueError`` for a configuration the model cannot serve (no MTP head,
    no usable chat template: ``ChatTemplateError``, before any weight is read), and
    whatever ExLlamaV3 raises for an unreadable model directory or too little VRAM.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the exllamav3 backend needs a CUDA GPU (torch.cuda.is_available() is False)")
    import exllamav3 as ex

    mode = config.draft_mode
    model_dir = config.model_dir
    assert model_dir is not None  # checked by exllamav3.config.validate
    ex_config = ex.Config.from_directory(str(model_dir))

    tokenizer = ex.Tokenizer.from_config(ex_config)
    hf_tokenizer = chat_template.load_hf_tokenizer(model_dir, trust_remote_code=config.trust_remote_code)
    render = chat_template.check(hf_tokenizer, model_dir)
    # Where hf_chat_template looks before loading one itself (tokenizer/tokenizer.py:866-867).
    tokenizer.hf_tokenizer = hf_tokenizer
    eos_ids = list(dict.fromkeys(int(e) for e in ex_config.eos_token_id_list))
    turn_end = chat_template.turn_end(render)
    stop_strings: tuple[str, ...] = ()
    if turn_end is not None:
        stop_strings = (turn_end,)
        ids = _id_list(tokenizer.encode(turn_end, encode_special_tokens=True))
        if len(ids) == 1 and ids[0] not in eos_ids:
            eos_ids.append(ids[0])
    log.info(
        "exllamav3: chat template loaded; a turn ends with %r; stop tokens %s",
        turn_end,
        eos_ids,
    )

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
    draft_gpu_split = parse_split(config.draft_gpu_split, "draft_gpu_split")
    draft_split = list(draft_gpu_split) if draft_gpu_split else None
    kv_bytes = _cache_bytes(cache)
    if kv_bytes is not None and draft_cache is not None:
        draft_kv = _cache_bytes(draft_cache)
        kv_bytes = None if draft_kv is None else kv_bytes + draft_kv
    weights = _weights_bytes(model_dir)
    if mode is DraftMode.DRAFT_MODEL and config.draft_model_dir is not None:
        weights += _weights_bytes(config.draft_model_dir)
    budget_split = None if split is None else [a + b for a, b in _zip_longest(split, draft_split or [])]
    warn_if_cache_exceeds_vram(
        kv_bytes, weights, _free_vram_bytes(budget_split), cache_size, defaulted=not config.cache_size
    )

    with torch.inference_mode():
        if draft_model is not None:
            # use_per_device counts on top of what is already allocated (model/model.py:522-526):
            # reusing gpu_split here would let drafter + model take about twice the split.
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

    gen_kwargs: dict[str, Any] = {
        "model": model,
        "cache": cache,
        "tokenizer": tokenizer,
        "max_batch_size": max_batch,
        "max_chunk_size": config.chunk_size,
        "draft_model": draft_model,
        "draft_cache": draft_cache,
        "num_draft_tokens": config.num_draft_tokens if mode is not DraftMode.NONE else None,
        "ngram_match_min": config.ngram_match_min if mode is DraftMode.NGRAM else 0,
    }
    generator = ex.Generator(**gen_kwargs)
    warmup_s = 0.0
    if config.warmup:
        warmup_s = _warm_generator(ex, generator, tokenizer, int(generator.max_draft_tokens) + 4)
        log.info("exllamav3: generator warm-up (sampling and draft passes) took %.1f s", warmup_s)
    bos_ok = _wants_bos(tokenizer)
    bos_text = getattr(tokenizer, "bos_token", None) or None

    def encode(text: str, add_bos: bool) -> Any:
        # A prompt that already starts with the BOS text (a pre-rendered template) gets no second one.
        bos = add_bos and bos_ok and not (bos_text and text.startswith(bos_text))
        return tokenizer.encode(text, add_bos=bos, encode_special_tokens=True)

    # Client text tokenized as text, control tokens only where the template wrote them.
    encode_chat = chat_template.chat_encoder(
        hf_tokenizer, tokenizer, lambda ids: torch.tensor([ids], dtype=torch.long)
    )

    def ll_tokenizer() -> Any:
        # The llguidance tokenizer LLGuidanceFilter builds and caches per Tokenizer
        # (generator/filter/llguidance.py:180-192): token bytes for logprobs, shared with the filters.
        from exllamav3.generator.filter.llguidance import create_ll_tokenizer

        return create_ll_tokenizer(tokenizer)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(torch.tensor(ids, dtype=torch.long), decode_special_tokens=True))

    def rebuild_generator() -> Any:
        nonlocal generator
        try:
            generator.close()
        except Exception:
            log.exception("exllamav3: closing the faulted generator failed")
        # Blocks freed by an out-of-memory fault go back to the driver before the new
        # generator's buffers are allocated.
        torch.cuda.empty_cache()
        generator = ex.Generator(**gen_kwargs)
        return generator

    def check_device() -> None:
        # A sticky CUDA error (illegal address, ECC) fails every later call in the
        # process; a synchronize and a tiny kernel on each device show it.
        for i in range(torch.cuda.device_count()):
            with torch.cuda.device(i):
                torch.cuda.synchronize()
                probe = torch.ones(8, device=f"cuda:{i}")
                if float((probe * 2).sum().item()) != 16.0:
                    raise RuntimeError(f"cuda:{i} computes wrong results")

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
        pieces=tokenizer.get_id_to_piece_list(True),
        eos_token_ids=tuple(eos_ids),
        vocab_size=int(tokenizer.actual_vocab_size),
        max_position_embeddings=mpe or max_seq_len,
        cache_tokens=int(generator.max_total_tokens),
        max_draft_tokens=int(generator.max_draft_tokens),
        drafting=config.drafting,
        model_id=model_dir.name,
        close=close,
        max_batch_size=max_batch,
        stop_strings=stop_strings,
        rebuild_generator=rebuild_generator,
        check_device=check_device,
        warmup_s=warmup_s,
        chat_template=chat_template.source(hf_tokenizer),
        rq_boundary=int(generator.recurrent_checkpoint_interval)
        if getattr(generator, "recurrent_cache", None) is not None
        else PAGE_SIZE,
        new_filter=filter_factory(contained_filter_class(ex.LLGuidanceFilter), tokenizer),
        ll_tokenizer=ll_tokenizer,
    )


def _zip_longest(a: list[float], b: list[float]) -> list[tuple[float, float]]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0.0, b[i] if i < len(b) else 0.0) for i in range(n)]


def _id_list(ids: Any) -> list[int]:
    rows = ids.tolist()
    return [int(t) for t in (rows[0] if rows and isinstance(rows[0], list) else rows)]


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
