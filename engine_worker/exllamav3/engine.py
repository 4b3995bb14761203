"""The surface of ExLlamaV3 the backend drives, as typed protocols.

``ExLlamaV3Backend`` never imports ``exllamav3`` or ``torch``: it receives an
``EngineHandle`` built by ``engine_worker.exllamav3.loader`` (real engine) or by
the tests (``tests/fakes/exllamav3``). Everything the backend calls is listed
here, with the 1.6.5 source it stands for:

- ``GeneratorLike``: ``exllamav3.Generator`` (``generator/generator.py``):
  ``enqueue`` (line 613), ``cancel`` (649), ``iterate`` (674).
- ``EngineHandle.new_job``: ``exllamav3.Job`` (``generator/job.py:54``). Its
  ``**kwargs`` swallows misspelt names silently, so the fake's ``Job`` takes
  exactly the 1.6.5 parameter list and nothing else.
- ``EngineHandle.new_sampler``: ``exllamav3.ComboSampler``
  (``generator/sampler/presets.py``, class ``ComboSampler``).
- ``EngineHandle.new_filter``: ``exllamav3.LLGuidanceFilter``
  (``generator/filter/llguidance.py:32``), through
  ``engine_worker.exllamav3.grammar.contained_filter_class``.
- ``EngineHandle.ll_tokenizer``: ``create_ll_tokenizer``
  (``generator/filter/llguidance.py:17-29``), the llguidance tokenizer those
  filters share (cached per ``Tokenizer``).
- Token id tensors are only used through ``.shape`` and ``.tolist()``, which a
  ``torch.LongTensor`` of shape ``(1, n)`` has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine_worker.exllamav3.chat_template import TurnImages
from engine_worker.exllamav3.vision import Vision
from engine_worker.options.exllamav3 import EXLLAMAV3_MAX_BATCH_SIZE
from protocol.messages import PromptPiece


class IdTensor(Protocol):
    """A ``(1, n)`` tensor of token ids (``torch.LongTensor`` in the real engine)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def tolist(self) -> Any: ...


class GeneratorLike(Protocol):
    """What the backend calls on ``exllamav3.Generator``, always from one thread."""

    def enqueue(self, job: Any) -> int:
        """Queue a job; returns its serial. Raises ``AssertionError`` when it can never fit the
        cache (``generator/job.py:1342``)."""
        ...

    def cancel(self, job: Any) -> None: ...

    def iterate(self) -> list[dict[str, Any]]: ...

    def num_remaining_jobs(self) -> int: ...

    @property
    def pagetable(self) -> Any:
        """The ``PageTable`` (``generator/generator.py:242``), read by ``kv_pages`` after ``iterate``."""
        ...


@dataclass(frozen=True, slots=True)
class EngineHandle:
    """A loaded model ready to serve, plus the conversions the backend needs.

    - ``generator``: the one ``Generator`` over the model's cache.
    - ``new_job(**kwargs)`` / ``new_sampler(**kwargs)``: ``Job`` / ``ComboSampler`` constructors.
    - ``encode(text, add_bos)``: raw prompt -> ``(1, n)`` ids, special tokens in the text parsed.
    - ``encode_chat(messages, add_generation_prompt, tools, prefix, variables, images)``: the model's
      chat template applied and tokenized (``chat_template.chat_encoder``); ``messages`` are
      ``{"role", "content"}`` dicts, with ``tool_calls`` (a list of call objects), ``tool_call_id``
      and ``name`` where a turn has them; ``tools`` (OpenAI's ``tools`` array) goes to the template
      as its ``tools`` variable, ``None`` passes nothing; ``prefix`` (``Submit.forced_prefix``) is
      tokenized after it; ``variables``, extra template variables (``chat_template_kwargs``) or
      ``None``; ``images``, each message's ``(offset, embedding)`` pairs or ``None``.
    - ``decode(ids)``: token ids -> text, special tokens as their text (``Tokenizer.decode`` with
      ``decode_special_tokens=True``, as jobs decode).
    - ``decode_plain(ids)``: the same without special tokens (``decode_special_tokens=False``:
      EOS, pad and the other special tokens leave no text), ``/detokenize``'s
      ``skip_special_tokens``.
    - ``pieces``: token id -> the text ``Job`` appends for it (``get_id_to_piece_list`` with
      ``decode_special_tokens=True``, ``generator/job.py:971``).
    - ``eos_token_ids``: the model's end-of-sequence ids (``Config.eos_token_id_list``), plus the
      token that ends an assistant turn in the chat template when it is one token.
    - ``stop_strings``: the chat template's turn-end text (``<|im_end|>``), which also ends a
      completion when the model spells it out of ordinary tokens.
    - ``vocab_size``: ids ``0 .. vocab_size - 1`` are valid (``Tokenizer.actual_vocab_size``).
    - ``max_position_embeddings``: the model's trained context, tokens.
    - ``cache_tokens``: ``Generator.max_total_tokens``, the cache size in tokens.
    - ``max_draft_tokens``: ``Generator.max_draft_tokens``, 0 without drafting.
    - ``drafting``: ``Ready.drafting`` name or ``None``.
    - ``close``: free the generator, model and cache.
    - ``max_batch_size``: the generator's ``max_batch_size``, most jobs running at once.
    - ``rebuild_generator()``: close ``generator`` and return a new one over the same model and
      cache (``Generator.close``, ``generator/generator.py:839-871``: "the model and cache stay
      loaded for a replacement generator"); ``None`` where the engine cannot.
    - ``check_device()``: raises when the GPU can no longer run work (a sticky CUDA error);
      ``None`` where there is nothing to check.
    - ``warmup_s``: seconds the start-up warm-up through the generator took (0 without one).
    - ``chat_template``: the chat template's source (``Ready.chat_template``), ``None`` if unknown.
    - ``rq_boundary``: where a re-queued segment's budget ends, tokens: a page, or the
      generator's ``recurrent_checkpoint_interval`` on recurrent models
      (``generator/job.py:1295-1306``).
    - ``new_filter(grammar)``: a grammar filter for one job (``SamplingParams.grammar``, passed as
      ``llg_grammar``; ending the job once the grammar is complete); raises ``ValueError`` for a
      grammar that does not compile. ``None`` where the engine has none.
    - ``ll_tokenizer()``: the ``llguidance.LLTokenizer`` of the model (token bytes for logprobs),
      built on the first call (about a second for a 150k vocabulary); ``None`` where unavailable.
    - ``new_xtc_sampler(xtc_probability, xtc_threshold, **sampler_kwargs)``: a sampler with XTC
      (``engine_worker.exllamav3.sampling.xtc_sampler`` bound to the module and tokenizer);
      ``None`` where the engine has none (XTC is then refused).
    - ``new_answer_filter(new_splitter, grammar=None, stops=(), min_tokens=0)``: the filter of a
      reasoning model's job, which forces the end of the thinking once its budget is spent and
      keeps a grammar and the client's stop strings to the answer
      (``grammar.answer_filter_factory``); ``None``: budgets above 0 are refused, and so are
      grammars and logprobs while the model may think.
    - ``as_ids(ids)``: a list of ids as the ``(1, n)`` tensor jobs take (a prompt the reasoning
      plan extended); ``None`` where unavailable.
    - ``vision``: the model's vision component (``engine_worker.exllamav3.vision.Vision``), loaded
      where the model has one (``"vision" in Config.model_classes``, ``model/model.py:186-189``);
      ``None``: images are refused.
    """

    generator: GeneratorLike
    new_job: Callable[..., Any]
    new_sampler: Callable[..., Any]
    encode: Callable[[str, bool], IdTensor]
    encode_chat: Callable[
        [
            list[dict[str, Any]],
            bool,
            list[Any] | None,
            Sequence[PromptPiece],
            dict[str, Any] | None,
            TurnImages | None,
        ],
        IdTensor,
    ]
    decode: Callable[[list[int]], str]
    decode_plain: Callable[[list[int]], str]
    pieces: Sequence[str]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_position_embeddings: int
    cache_tokens: int
    max_draft_tokens: int
    drafting: str | None
    model_id: str
    close: Callable[[], None]
    max_batch_size: int = EXLLAMAV3_MAX_BATCH_SIZE
    stop_strings: tuple[str, ...] = ()
    rebuild_generator: Callable[[], GeneratorLike] | None = None
    check_device: Callable[[], None] | None = None
    warmup_s: float = 0.0
    chat_template: str | None = None
    rq_boundary: int = 256
    new_filter: Callable[[str], Any] | None = None
    ll_tokenizer: Callable[[], Any] | None = None
    new_xtc_sampler: Callable[..., Any] | None = None
    as_ids: Callable[[list[int]], IdTensor] | None = None
    new_answer_filter: Callable[..., Any] | None = None
    vision: Vision | None = None


def id_list(ids: Any) -> list[int]:
    """Token ids of a tensor as ExLlamaV3 returns them (shape ``(1, n)`` or
    ``(n,)``; ``None``: none) as a list."""
    if ids is None:
        return []
    rows = ids.tolist()
    return [int(t) for t in (rows[0] if rows and isinstance(rows[0], list) else rows)]
