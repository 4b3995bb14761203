"""Test helpers: ``make_handle``, the ``EngineHandle`` that
``engine_worker.exllamav3.loader.load_engine`` would build, over the fake generator. No wheel
module."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from engine_worker.exllamav3.sampling import xtc_sampler

from .cache import Cache
from .filter import Filter, LLGuidanceFilter, create_ll_tokenizer
from .generator import Generator
from .job import Job
from .model import DEFAULT_SCRIPT, Model, Script, VisionModel
from .sampler import ComboSampler
from .tensor import FakeTensor
from .tokenizer import CHATML_TEMPLATE, EOS, IM_END, VOCAB_SIZE, ChatMLTemplate, Tokenizer, hf_tokenizer


def _int32_words(n: int) -> Any:
    """A ``(1, n)`` int32 mask of zeros (numpy where 1.6.5 has a CPU torch tensor)."""
    import numpy as np

    return np.zeros((1, n), dtype=np.int32)


def make_handle(
    *,
    script: Script = DEFAULT_SCRIPT,
    cache_tokens: int = 4096,
    max_position_embeddings: int = 8192,
    max_chunk_size: int = 512,
    max_batch_size: int = 8,
    drafting: str | None = None,
    num_draft_tokens: int | None = None,
    ngram_match_min: int = 2,
    draft_script: Script | None = None,
    fail_prefill: Callable[[Sequence[int]], bool] | None = None,
    eos_token_ids: tuple[int, ...] = (EOS, IM_END),
    stop_strings: tuple[str, ...] = (),
    special_pieces: bool = True,
    chat_template: str | None = None,
    vision: bool = False,
) -> Any:
    """An ``EngineHandle`` over a fake generator, as ``loader.load_engine`` would build it.
    The generator is ``handle.generator`` (a ``Generator``); ``rebuild_generator`` makes a
    new one over the same model and cache, as the loader's does, and ``check_device`` raises
    ``model.device_error`` (``handle.generator.model``) once it is set. Chat renders with
    ``ChatMLTemplate``, or with a real ``transformers`` tokenizer holding ``chat_template``
    when one is given (``hf_tokenizer``). Grammars use ``LLGuidanceFilter`` as the loader
    does (``grammar.contained_filter_class``). ``vision``: a vision component
    (``VisionModel``, reached with ``vision_model(handle)``), images opened and sized as the
    loader does (``LoadedEngine.open_image``, ``embedding_bytes``)."""
    from engine_worker.exllamav3.chat_template import chat_encoder
    from engine_worker.exllamav3.engine import EngineHandle
    from engine_worker.exllamav3.grammar import answer_filter_factory, contained_filter_class, filter_factory
    from engine_worker.exllamav3.loader import LoadedEngine
    from engine_worker.exllamav3.vision import Vision

    model = Model(script=script, fail_prefill=fail_prefill)
    cache = Cache(model, cache_tokens)
    draft_model = draft_cache = None
    if drafting in ("draft_model", "mtp"):
        draft_model = Model(
            component="text" if drafting == "draft_model" else "mtp", script=draft_script or script
        )
        draft_cache = Cache(draft_model, cache_tokens)
    model.load()
    if draft_model is not None:
        draft_model.load()
    vision_model = VisionModel() if vision else None
    if vision_model is not None:
        vision_model.load()
    tok = Tokenizer(special_pieces=special_pieces)
    if chat_template is not None:
        tok.hf_tokenizer = hf_tokenizer(chat_template)
    gen_kwargs: dict[str, Any] = {
        "model": model,
        "cache": cache,
        "tokenizer": tok,
        "max_batch_size": max_batch_size,
        "max_chunk_size": max_chunk_size,
        "draft_model": draft_model,
        "draft_cache": draft_cache,
        "num_draft_tokens": num_draft_tokens,
        "ngram_match_min": ngram_match_min if drafting == "ngram" else 0,
    }
    gen = Generator(**gen_kwargs)
    current = [gen]

    def encode(text: str, add_bos: bool) -> FakeTensor:
        return tok.encode(text, add_bos=add_bos and not text.startswith("<s>"), encode_special_tokens=True)

    # As the loader builds it: rendered to text, tokenized in pieces (chat_template.chat_encoder).
    encode_chat = chat_encoder(
        tok.hf_tokenizer if chat_template is not None else ChatMLTemplate(), tok, FakeTensor
    )

    def decode(ids: list[int]) -> str:
        return str(tok.decode(FakeTensor(ids, flat=True), decode_special_tokens=True))

    def decode_plain(ids: list[int]) -> str:
        return str(tok.decode(FakeTensor(ids, flat=True), decode_special_tokens=False))

    def rebuild_generator() -> Generator:
        current[0].close()
        current[0] = Generator(**gen_kwargs)
        return current[0]

    def check_device() -> None:
        if model.device_error is not None:
            raise model.device_error

    return EngineHandle(
        generator=gen,
        new_job=Job,
        new_sampler=ComboSampler,
        new_xtc_sampler=functools.partial(xtc_sampler, sys.modules[__name__.rpartition(".")[0]], tok),
        encode=encode,
        encode_chat=encode_chat,
        decode=decode,
        decode_plain=decode_plain,
        pieces=tok.get_id_to_piece_list(True),
        eos_token_ids=eos_token_ids,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_position_embeddings,
        cache_tokens=gen.max_total_tokens,
        max_draft_tokens=gen.max_draft_tokens,
        drafting=drafting,
        model_id="fake-exl3",
        close=lambda: current[0].close(),
        max_batch_size=max_batch_size,
        stop_strings=stop_strings,
        rebuild_generator=rebuild_generator,
        check_device=check_device,
        chat_template=chat_template if chat_template is not None else CHATML_TEMPLATE,
        new_filter=filter_factory(contained_filter_class(LLGuidanceFilter), tok),
        ll_tokenizer=lambda: create_ll_tokenizer(tok),
        as_ids=FakeTensor,
        new_answer_filter=answer_filter_factory(
            Filter, tok, VOCAB_SIZE, _int32_words, tok.get_id_to_piece_list(True), decode
        ),
        vision=None
        if vision_model is None
        else Vision(
            LoadedEngine.open_image,
            _VisionCall(vision_model, tok),
            LoadedEngine.embedding_bytes,
        ),
    )


class _VisionCall:
    """``Vision.embed`` over the fake vision component: ``model`` is that component."""

    def __init__(self, model: VisionModel, tokenizer: Tokenizer) -> None:
        self.model, self._tokenizer = model, tokenizer

    def __call__(self, image: Any) -> Any:
        return self.model.get_image_embeddings(tokenizer=self._tokenizer, image=image)


def vision_model(handle: Any) -> VisionModel:
    """The fake vision component of a ``make_handle(vision=True)`` handle."""
    call = handle.vision.embed
    assert isinstance(call, _VisionCall)
    return call.model
