"""Load an EXL3 model with ExLlamaV3 1.6.5 and wrap it in an ``EngineHandle``.

``torch`` and ``exllamav3`` are imported inside the functions: importing
exllamav3 compiles its CUDA extension, so nothing here may run at import time
of the worker package (the proxy and the tests import it without a GPU).

The load order follows ExLlamaV3's own ``model_init.py`` (1.6.5), with the
tokenizer first; ``load_engine`` runs one function per step:

0. ``load_text``: ``Config.from_directory``, ``Tokenizer.from_config`` (which extends
   ``config.eos_token_id_list`` from ``tokenizer_config.json``/``generation_config.json``,
   ``tokenizer/tokenizer.py:199-215``) and the chat template
   (``engine_worker.exllamav3.chat_template``): a model that cannot render chat
   stops the worker before any weight is read. The template's turn-end text
   becomes a stop string, and its token a stop token when it is one.
1. ``create_models``: ``Model.from_config`` (``model_init.py:283``); an MTP head is
   ``Model.from_config(config, component="mtp")`` (``model_init.py:284-288``,
   ``model/model.py:171-194``), the vision component ``component="vision"`` where the
   architecture has one (``"vision" in config.model_classes``, ``model/model.py:186-189``)
   and ``vision`` is on.
2. ``plan_sizes``: context, batch, draft window and cache size; what ``config`` leaves
   unset is resolved for the model by ``WorkerSettings.exllamav3_*``, where every
   default lives.
3. ``create_caches``, BEFORE any ``load()``: cache tensors are allocated by the loader
   for caches already attached (``cache/cache.py:143-147``). A draft cache has
   the main cache's size (``generator/generator.py:257``); ``max_history``
   covers the draft window for recurrent models (``model_init.py:291-297``).
   When cache and weights will not fit the free VRAM, a warning says so
   (``warn_if_cache_exceeds_vram``).
4. ``load_weights``: the vision component first, as exllamav3's ``examples/multimodal.py``
   does, then the drafter's ``load`` before the main model's, which gets
   ``draft_model=`` for its split (``model_init.py:379-405``). ``Model.load_gen`` yields
   ``(modules_done, modules_total)`` (``model/model_ls.py:140``,
   ``model/model_tp.py:615``): that drives the console progress bar. Then
   ``Model.warmup`` before a generator owns the cache (``model/model.py:203``, ``232-233``).
5. ``generator_kwargs`` and ``LoadedEngine``: the ``Generator``; every keyword passed
   exists in ``Generator.__init__`` (``generator/generator.py:41-73``), which would
   silently swallow a typo. With warm-up on, one short job runs through it
   (``_warm_generator``).
6. ``LoadedEngine.handle``: the ``EngineHandle``, its callables the engine's methods.

The handle can rebuild the generator over the same model and cache and probe
the GPU, which the backend uses to recover from a fault in a step. It also
carries the chat template's source (``Ready.chat_template``), renders chat with
``tools`` (``hf_chat_template`` forwards keywords to ``apply_chat_template``,
``tokenizer/tokenizer.py:830-832``, ``870-876``), builds 1.6.5's
``LLGuidanceFilter`` per grammar (``engine_worker.exllamav3.grammar``) and
reaches the llguidance tokenizer those filters share (``create_ll_tokenizer``,
``generator/filter/llguidance.py:17-29``; built on first use, for token bytes).
"""

from __future__ import annotations

import functools
import io
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_worker.exllamav3 import chat_template, sizes
from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.exllamav3.chat_template import TurnImages
from engine_worker.exllamav3.engine import EngineHandle, id_list
from engine_worker.exllamav3.grammar import answer_filter_factory, contained_filter_class, filter_factory
from engine_worker.exllamav3.sampling import xtc_sampler
from engine_worker.exllamav3.vision import Vision
from engine_worker.load_stages import LoadReporter, Stage
from engine_worker.options.exllamav3 import PAGE_SIZE, CacheMode, parse_split
from engine_worker.settings import DraftMode, WorkerSettings
from protocol.messages import PromptPiece

log = logging.getLogger(__name__)

GIB = 1024**3


def _cache_kwargs(ex: Any, mode: CacheMode) -> dict[str, Any]:
    if mode.bits is None:
        return {"layer_type": ex.CacheLayer_fp16}
    k_bits, v_bits = mode.bits
    return {"layer_type": ex.CacheLayer_quant, "k_bits": k_bits, "v_bits": v_bits}


def _progress_bar(steps: Iterable[Any], label: str, stages: LoadReporter | None = None) -> None:
    """Drain a ``load_gen``-style generator of ``(done, total)`` with a tqdm bar on stderr,
    and as the ``load_weights`` stage of ``stages`` (``label``, modules done of total)."""
    from tqdm import tqdm

    if stages is not None:
        stages.stage(Stage.LOAD_WEIGHTS, label.lower(), unit="modules")
    with tqdm(desc=label, unit="module", file=sys.stderr, dynamic_ncols=True) as bar:
        for step in steps:
            if isinstance(step, tuple) and len(step) == 2:
                done, total = step
                bar.total = int(total)
                bar.n = int(done)
                bar.refresh()
                if stages is not None:
                    stages.set_total(int(total))
                    stages.advance(int(done))


def _start_moe_cpu_hosts(model: Any) -> None:
    """What ``Model.load`` (``model/model.py:767-772``) does after draining ``load_gen``:
    make sure the worker processes of CPU-offloaded MoE experts are up before the first
    forward pass. ``ensure_started`` is idempotent; configs without offload have none."""
    for host in getattr(model.config, "moe_cpu_hosts", {}).values():
        host.ensure_started()


def _int32_words(n: int) -> Any:
    """A ``(1, n)`` int32 CPU tensor of zeros: a filter mask as 1.6.5's are (``llguidance.py:146-153``)."""
    import torch

    return torch.zeros((1, n), dtype=torch.int32)


def _as_ids(ids: list[int]) -> Any:
    """The ``(1, n)`` token tensor ExLlamaV3's jobs take."""
    import torch

    return torch.tensor([ids], dtype=torch.long)


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


@dataclass(frozen=True)
class Text:
    """What start-up learns before any weight is read: the ExLlamaV3 config and tokenizer,
    the Hugging Face tokenizer that renders the chat template, and the stops."""

    ex_config: Any
    tokenizer: Any
    hf_tokenizer: Any
    eos_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]


def load_text(ex: Any, config: WorkerSettings) -> Text:
    """Step 0: ``Config``, ``Tokenizer`` and the chat template, checked by rendering a short
    conversation (raises ``ChatTemplateError``). The template's turn-end text becomes a stop
    string, and its token a stop token when it is one."""
    model_dir = config.model_dir
    assert model_dir is not None  # checked by options.exllamav3.validate
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
        ids = id_list(tokenizer.encode(turn_end, encode_special_tokens=True))
        if len(ids) == 1 and ids[0] not in eos_ids:
            eos_ids.append(ids[0])
    log.info("exllamav3: chat template loaded; a turn ends with %r; stop tokens %s", turn_end, eos_ids)
    return Text(ex_config, tokenizer, hf_tokenizer, tuple(eos_ids), stop_strings)


@dataclass(frozen=True)
class Models:
    """Step 1: the main model and the drafter (draft model or MTP head), created, not loaded."""

    model: Any
    draft_model: Any
    draft_label: str
    vision_model: Any = None
    """The vision component, ``None`` for a text-only model (or ``vision`` off)."""


def create_models(ex: Any, config: WorkerSettings, text: Text) -> Models:
    """``Model.from_config`` for the main model, its vision component where it has one (and
    ``vision`` is on) and, by ``draft_mode``, the draft model's own ``Config``/``Model`` or the
    MTP head (``component="mtp"``). Raises ``ValueError`` for ``mtp`` on a model without a head."""
    ex_config = text.ex_config
    if config.max_seq_len:
        # A no-op in 1.6.5 (model/config.py:337-343); kept because later versions use it to pick
        # the RoPE factors of models with two sets (Phi) before the model is created.
        ex_config.override_dynamic_seq_len(config.max_seq_len)
    model = ex.Model.from_config(ex_config)
    components = getattr(ex_config, "model_classes", {})
    vision = None
    if "vision" in components:
        if config.vision:
            vision = ex.Model.from_config(ex_config, component="vision")
        else:
            log.info("exllamav3: %s has a vision component; not loaded (--no-vision)", ex_config.architecture)
    if config.draft_mode is DraftMode.DRAFT_MODEL:
        assert config.draft_model_dir is not None  # checked by options.exllamav3.validate
        draft_config = ex.Config.from_directory(str(config.draft_model_dir))
        drafter = ex.Model.from_config(draft_config)
        return Models(model, drafter, f"draft model {config.draft_model_dir.name}", vision)
    if config.draft_mode is DraftMode.MTP:
        if "mtp" not in components:
            raise ValueError(
                f"draft_mode=mtp: {config.model_dir} ({ex_config.architecture}) has no MTP head in ExLlamaV3"
            )
        return Models(model, ex.Model.from_config(ex_config, component="mtp"), "MTP head", vision)
    return Models(model, None, "", vision)


@dataclass(frozen=True)
class Sizes:
    """Step 2: the token counts the caches and the generator are built with."""

    max_position_embeddings: int
    """The model's trained context, 0 when its config has none."""
    max_seq_len: int
    max_batch_size: int
    draft_tokens: int
    """The draft window: the cache's ``max_history``, 0 without drafting."""
    cache_size: int


def plan_sizes(config: WorkerSettings, text: Text, models: Models) -> Sizes:
    """The sizes ``config`` asks for, its unset ones resolved for these models
    (``sizes``)."""
    mpe = int(getattr(text.ex_config, "max_position_embeddings", 0) or 0)
    max_seq_len = sizes.max_seq_len(config, mpe)
    recurrent = bool(models.model.caps.get("recurrent_states"))
    drafter_default = None
    if models.draft_model is not None:
        size = models.draft_model.caps.get("default_draft_size")
        drafter_default = None if size is None else int(size)
    draft_tokens = sizes.draft_tokens(config, drafter_default)
    return Sizes(
        max_position_embeddings=mpe,
        max_seq_len=max_seq_len,
        max_batch_size=sizes.max_batch_size(config, recurrent),
        draft_tokens=draft_tokens,
        cache_size=sizes.cache_size(config, max_seq_len, draft_tokens),
    )


def create_caches(ex: Any, config: WorkerSettings, models: Models, sizes: Sizes) -> tuple[Any, Any]:
    """Step 3: the main cache and the drafter's (same size, ``generator/generator.py:257``),
    built BEFORE any ``load()``: the loader allocates tensors for caches already attached
    (``cache/cache.py:143-147``). Then the VRAM check (``warn_if_cache_exceeds_vram``)."""

    def cache(model: Any, mode: str, setting: str) -> Any:
        return ex.Cache(
            model,
            max_num_tokens=sizes.cache_size,
            max_batch_size=sizes.max_batch_size,
            max_history=sizes.draft_tokens,
            **_cache_kwargs(ex, CacheMode.parse(mode, setting)),
        )

    main = cache(models.model, config.cache_mode, "cache_mode")
    draft = None
    if models.draft_model is not None:
        draft = cache(models.draft_model, config.draft_cache_mode, "draft_cache_mode")
    _warn_about_vram(config, main, draft, sizes.cache_size)
    return main, draft


def _warn_about_vram(config: WorkerSettings, cache: Any, draft_cache: Any, cache_size: int) -> None:
    assert config.model_dir is not None
    kv_bytes = _cache_bytes(cache)
    if kv_bytes is not None and draft_cache is not None:
        draft_kv = _cache_bytes(draft_cache)
        kv_bytes = None if draft_kv is None else kv_bytes + draft_kv
    weights = _weights_bytes(config.model_dir)
    if config.draft_mode is DraftMode.DRAFT_MODEL and config.draft_model_dir is not None:
        weights += _weights_bytes(config.draft_model_dir)
    split, draft_split = _splits(config)
    budget = None if split is None else [a + b for a, b in _zip_longest(split, draft_split or [])]
    warn_if_cache_exceeds_vram(
        kv_bytes, weights, _free_vram_bytes(budget), cache_size, defaulted=not config.cache_size
    )


def _splits(config: WorkerSettings) -> tuple[list[float] | None, list[float] | None]:
    """``gpu_split`` and ``draft_gpu_split``, GB per GPU, ``None`` for an automatic split."""
    main = parse_split(config.gpu_split, "gpu_split")
    draft = parse_split(config.draft_gpu_split, "draft_gpu_split")
    return (list(main) if main else None), (list(draft) if draft else None)


def load_weights(
    config: WorkerSettings, models: Models, cache: Any, sizes: Sizes, stages: LoadReporter | None = None
) -> None:
    """Step 4: the vision component's weights, the drafter's, then the main model's with
    ``draft_model=`` for its split (``model_init.py:379-405``), a progress bar each; then, with
    ``warmup``, ``Model.warmup`` before a generator owns the cache (``model/model.py:203``,
    ``232-233``)."""
    import torch

    assert config.model_dir is not None
    split, draft_split = _splits(config)
    with torch.inference_mode():
        if models.vision_model is not None:
            # Placed automatically, first, as examples/multimodal.py loads it: the text model's
            # split then counts on top of it, as it does for the drafter.
            _progress_bar(models.vision_model.load_gen(), "Loading the vision component", stages)
        if models.draft_model is not None:
            # use_per_device counts on top of what is already allocated (model/model.py:522-526):
            # reusing gpu_split here would let drafter + model take about twice the split.
            _progress_bar(
                models.draft_model.load_gen(use_per_device=draft_split, max_chunk_size=config.chunk_size),
                f"Loading {models.draft_label}",
                stages,
            )
            _start_moe_cpu_hosts(models.draft_model)
        _progress_bar(
            models.model.load_gen(
                use_per_device=split,
                tensor_p=config.tensor_parallel,
                tp_backend=config.tensor_parallel_backend,
                max_chunk_size=config.chunk_size,
                draft_model=models.draft_model,
            ),
            f"Loading {config.model_dir.name}",
            stages,
        )
        _start_moe_cpu_hosts(models.model)
    if config.warmup:
        if stages is not None:
            stages.stage(Stage.WARM_UP, "warm up (kernel compilation and tuning)")
        log.info("exllamav3: warming up (kernel compilation and tuning)")
        failed = models.model.warmup(
            cache=cache, max_chunk_size=config.chunk_size, max_batch_size=sizes.max_batch_size
        )
        # warmup() reports a failing pass and goes on; it returns their labels (model/model.py:252-253).
        if failed:
            log.warning(
                "exllamav3: warmup passes failed (first use will compile them): %s", ", ".join(failed)
            )


def generator_kwargs(
    config: WorkerSettings, text: Text, models: Models, caches: tuple[Any, Any], sizes: Sizes
) -> dict[str, Any]:
    """Step 5: the ``Generator`` keywords; every one exists in ``Generator.__init__``
    (``generator/generator.py:41-73``), which would silently swallow a typo."""
    mode = config.draft_mode
    return {
        "model": models.model,
        "cache": caches[0],
        "tokenizer": text.tokenizer,
        "max_batch_size": sizes.max_batch_size,
        "max_chunk_size": config.chunk_size,
        "draft_model": models.draft_model,
        "draft_cache": caches[1],
        "num_draft_tokens": config.num_draft_tokens if mode is not DraftMode.NONE else None,
        "ngram_match_min": config.ngram_match_min if mode is DraftMode.NGRAM else 0,
    }


class LoadedEngine:
    """Step 6: the loaded model, its cache and generator, and the calls the backend makes on
    them (``EngineHandle``'s callables are this object's methods)."""

    def __init__(
        self, ex: Any, config: WorkerSettings, text: Text, models: Models, gen_kwargs: dict[str, Any]
    ):
        self.ex, self.config, self.text, self.models = ex, config, text, models
        self.gen_kwargs = gen_kwargs
        self.generator = ex.Generator(**gen_kwargs)
        tokenizer = text.tokenizer
        self.bos_ok = _wants_bos(tokenizer)
        self.bos_text: str | None = getattr(tokenizer, "bos_token", None) or None
        self._encode_chat = chat_template.chat_encoder(text.hf_tokenizer, tokenizer, _as_ids)

    def warm(self) -> float:
        """One short job through the generator (``_warm_generator``); seconds taken."""
        seconds = _warm_generator(
            self.ex, self.generator, self.text.tokenizer, int(self.generator.max_draft_tokens) + 4
        )
        log.info("exllamav3: generator warm-up (sampling and draft passes) took %.1f s", seconds)
        return seconds

    def encode(self, text: str, add_bos: bool) -> Any:
        # A prompt that already starts with the BOS text (a pre-rendered template) gets no second one.
        bos = add_bos and self.bos_ok and not (self.bos_text and text.startswith(self.bos_text))
        return self.text.tokenizer.encode(text, add_bos=bos, encode_special_tokens=True)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[Any] | None,
        prefix: Sequence[PromptPiece] = (),
        variables: dict[str, Any] | None = None,
        images: TurnImages | None = None,
    ) -> Any:
        # Client text tokenized as text, control tokens only where the template
        # (or the proxy's prefix, Submit.forced_prefix) wrote them; images where their parts were.
        return self._encode_chat(messages, add_generation_prompt, tools, prefix, variables, images)

    def decode(self, ids: list[int], special: bool = True) -> str:
        import torch

        return str(
            self.text.tokenizer.decode(torch.tensor(ids, dtype=torch.long), decode_special_tokens=special)
        )

    def decode_plain(self, ids: list[int]) -> str:
        return self.decode(ids, special=False)

    def ll_tokenizer(self) -> Any:
        # The llguidance tokenizer LLGuidanceFilter builds and caches per Tokenizer
        # (generator/filter/llguidance.py:17-29): token bytes for logprobs, shared with the filters.
        from exllamav3.generator.filter.llguidance import create_ll_tokenizer

        return create_ll_tokenizer(self.text.tokenizer)

    def rebuild_generator(self) -> Any:
        import torch

        try:
            self.generator.close()
        except Exception:
            log.exception("exllamav3: closing the faulted generator failed")
        # Blocks freed by an out-of-memory fault go back to the driver before the new
        # generator's buffers are allocated.
        torch.cuda.empty_cache()
        self.generator = self.ex.Generator(**self.gen_kwargs)
        return self.generator

    def check_device(self) -> None:
        import torch

        # A sticky CUDA error (illegal address, ECC) fails every later call in the
        # process; a synchronize and a tiny kernel on each device show it.
        for i in range(torch.cuda.device_count()):
            with torch.cuda.device(i):
                torch.cuda.synchronize()
                probe = torch.ones(8, device=f"cuda:{i}")
                if float((probe * 2).sum().item()) != 16.0:
                    raise RuntimeError(f"cuda:{i} computes wrong results")

    def close(self) -> None:
        self.generator.close()
        self.models.model.unload()
        for other in (self.models.draft_model, self.models.vision_model):
            if other is not None:
                other.unload()

    @staticmethod
    def open_image(data: bytes) -> Any:
        # The proxy checked the file (format, pixels, a full decode: proxy.core.images); the
        # model's own preprocessing converts it to RGB (architecture/mm_processing/common.py:4-16).
        from PIL import Image

        image = Image.open(io.BytesIO(data))
        image.load()  # a GIF's first frame
        return image

    def embed_image(self, image: Any) -> Any:
        import torch

        with torch.inference_mode():
            embedding = self.models.vision_model.get_image_embeddings(
                tokenizer=self.text.tokenizer, image=image
            )
            # Done before the GPU turn ends: a step after it may capture a CUDA graph.
            torch.cuda.synchronize()
        return embedding

    @staticmethod
    def embedding_bytes(embedding: Any) -> int:
        tensors = [embedding.embeddings, *(getattr(embedding, "deepstack_embeddings", None) or ())]
        return sum(int(t.numel()) * int(t.element_size()) for t in tensors if t is not None)

    def handle(self, sizes: Sizes, warmup_s: float) -> EngineHandle:
        tokenizer, generator = self.text.tokenizer, self.generator
        assert self.config.model_dir is not None
        return EngineHandle(
            generator=generator,
            new_job=self.ex.Job,
            new_sampler=self.ex.ComboSampler,
            new_xtc_sampler=functools.partial(xtc_sampler, self.ex, tokenizer),
            encode=self.encode,
            encode_chat=self.encode_chat,
            as_ids=_as_ids,
            decode=self.decode,
            decode_plain=self.decode_plain,
            pieces=tokenizer.get_id_to_piece_list(True),
            eos_token_ids=self.text.eos_ids,
            vocab_size=int(tokenizer.actual_vocab_size),
            max_position_embeddings=sizes.max_position_embeddings or sizes.max_seq_len,
            cache_tokens=int(generator.max_total_tokens),
            max_draft_tokens=int(generator.max_draft_tokens),
            drafting=self.config.drafting,
            model_id=self.config.model_dir.name,
            close=self.close,
            max_batch_size=sizes.max_batch_size,
            stop_strings=self.text.stop_strings,
            rebuild_generator=self.rebuild_generator,
            check_device=self.check_device,
            warmup_s=warmup_s,
            chat_template=chat_template.source(self.text.hf_tokenizer),
            rq_boundary=int(generator.recurrent_checkpoint_interval)
            if getattr(generator, "recurrent_cache", None) is not None
            else PAGE_SIZE,
            new_filter=filter_factory(contained_filter_class(self.ex.LLGuidanceFilter), tokenizer),
            new_answer_filter=answer_filter_factory(
                self.ex.Filter,
                tokenizer,
                int(tokenizer.actual_vocab_size),
                _int32_words,
                tokenizer.get_id_to_piece_list(True),
                self.decode,
            ),
            ll_tokenizer=self.ll_tokenizer,
            vision=None
            if self.models.vision_model is None
            else Vision(self.open_image, self.embed_image, self.embedding_bytes),
        )


def load_engine(config: WorkerSettings, stages: LoadReporter | None = None) -> EngineHandle:
    """Load tokenizer and chat template, model, drafter, caches and generator as
    ``config`` says, in the steps above.

    Shows a progress bar per model load on stderr. Raises ``RuntimeError`` without
    CUDA, ``ValueError`` for a configuration the model cannot serve (no MTP head,
    no usable chat template: ``ChatTemplateError``, before any weight is read), and
    whatever ExLlamaV3 raises for an unreadable model directory or too little VRAM.
    ``stages`` hears the load stages (``engine_worker.load_stages``).
    """
    if stages is not None:
        stages.stage(Stage.IMPORT, "import torch and exllamav3")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the exllamav3 backend needs a CUDA GPU (torch.cuda.is_available() is False)")
    import exllamav3 as ex

    if stages is not None:
        stages.stage(Stage.LOAD_WEIGHTS, "tokenizer, chat template and caches")
    text = load_text(ex, config)
    models = create_models(ex, config, text)
    sizes = plan_sizes(config, text, models)
    caches = create_caches(ex, config, models, sizes)
    load_weights(config, models, caches[0], sizes, stages)
    engine = LoadedEngine(ex, config, text, models, generator_kwargs(config, text, models, caches, sizes))
    if config.warmup and stages is not None:
        stages.stage(Stage.WARM_UP, "warm up the generator (sampling and draft passes)")
    warmup_s = engine.warm() if config.warmup else 0.0
    return engine.handle(sizes, warmup_s)


def _zip_longest(a: list[float], b: list[float]) -> list[tuple[float, float]]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0.0, b[i] if i < len(b) else 0.0) for i in range(n)]


def build_backend(config: WorkerSettings, stages: LoadReporter | None = None) -> ExLlamaV3Backend:
    """Load the model (progress bar on stderr, stages to ``stages``) and return the
    backend serving it."""
    handle = load_engine(config, stages)
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
