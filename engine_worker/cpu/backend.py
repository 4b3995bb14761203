"""``CpuBackend``: the ``engine_worker.backend.Backend`` on CPU with torch: loading
(the embedded model or a Hugging Face folder, quantized weights kept per CPU by
``weight_cache``, kernels chosen by measured speed in ``kernel_choice``), prompts
(``prompt``), the vocabulary's tables (``vocab_tables``), and one ``Scheduler``
that steps the running sequences (``scheduler``: prefill chunks, batched decode,
n-gram drafting, the prefix cache). Each sequence's text goes through its
``engine_worker.requests.output.SequenceOutput``.

With ``SamplingParams.logprobs`` the sampler also scores each chosen token
(``TokenSampler.sample_scored``) and a ``LogprobTrail`` lines the entries up with
the text each ``TokenDelta`` carries. Without it neither runs. A grammar is
compiled in ``prepare`` (the loop's prepare thread); each choice decodes with its
own copy, and a complete grammar ends the sequence with ``stop``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from llguidance import LLMatcher

from engine_worker.admission import full_reservation
from engine_worker.backend import Backend, ModelInfo, Prepared, check_token_ids
from engine_worker.constraints import TokenConstraint
from engine_worker.cpu import kernel_choice, weight_cache
from engine_worker.cpu.llama import BLOCK_TOKENS, LlamaRunner, Segment
from engine_worker.cpu.model_store import LoadedModel, load_embedded, load_model
from engine_worker.cpu.ngram import NgramDrafter
from engine_worker.cpu.prefix_cache import PrefixCache
from engine_worker.cpu.prompt import PromptRenderer, end_ids
from engine_worker.cpu.quant import Quantization
from engine_worker.cpu.sampling import TokenSampler
from engine_worker.cpu.scheduler import Scheduler, Sequence
from engine_worker.cpu.vocab_tables import VocabTables
from engine_worker.kv_events import MEDIUM_CPU, BatchSink, KvEvents
from engine_worker.load_stages import LoadReporter, Stage
from engine_worker.reasoning import Plan, choose
from engine_worker.reasoning.base import VocabFromHF
from engine_worker.requests.banned import BannedStrings
from engine_worker.requests.detokenize import IncrementalDetokenizer
from engine_worker.requests.logprobs import LogprobTrail
from engine_worker.requests.output import SequenceOutput
from engine_worker.requests.stops import StopMatcher
from engine_worker.requests.turns import thinking_budget
from engine_worker.settings import DraftMode, WorkerSettings
from protocol.messages import Event, SamplingParams, Submit

logger = logging.getLogger(__name__)

# Prompt tokens decoded together with the first output tokens (leading spaces).
_DETOKENIZER_CONTEXT = 4


@dataclass(frozen=True, slots=True)
class _Prompt:
    """``Prepared.prompt`` of this backend: the token ids, and the request's
    grammar compiled on the prepare thread (``None`` without one)."""

    ids: list[int]
    grammar: str | None = None
    matcher: LLMatcher | None = None
    reasoning: Plan | None = None  # with a reasoning parser: the request's plan (engine_worker.reasoning)


class CpuBackend:
    """Runs a Llama-family causal LM on CPU; the embedded SmolLM2-135M-Instruct by default.

    ``CpuBackend(config)`` loads the model named by ``config`` (converting the
    embedded GGUF on first use, see ``model_store``); ``loaded`` (or
    ``from_loaded``) uses an already loaded model and tokenizer instead.
    Raises ``model_store.ModelNotFound`` when the model is missing and
    ``llama.UnsupportedModel`` for an architecture the runner lacks.
    """

    def __init__(
        self,
        config: WorkerSettings,
        *,
        loaded: LoadedModel | None = None,
        runner_class: type[LlamaRunner] = LlamaRunner,
        stages: LoadReporter | None = None,
    ) -> None:
        # Resolved per backend when the settings were built (BACKEND_DEFAULTS).
        assert config.max_seq_len and config.chunk_size and config.num_draft_tokens and config.ngram_match_max
        self._max_seq_len: int = config.max_seq_len
        self._chunk_size: int = config.chunk_size
        self._num_draft_tokens: int = config.num_draft_tokens
        self._ngram_match_max: int = config.ngram_match_max
        self._ngram = config.draft_mode is DraftMode.NGRAM
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        quantization = Quantization(config.quantization)
        # Quantized weights are made from float32 ones; --dtype applies without quantization.
        dtype = config.dtype if quantization is Quantization.NONE else "float32"
        stages = stages or LoadReporter()
        if loaded is None:
            if config.model_dir is not None:
                loaded = load_model(config.model_dir, dtype=dtype, stages=stages)
            else:
                loaded = load_embedded(config.cache_dir, dtype=dtype, stages=stages)
        self._config = config
        # The runner copies what it needs; the transformers model is not kept
        # (its float32 weights would double the memory of the worker).
        self._generation_config: Any = getattr(loaded.model, "generation_config", None)
        self._tokenizer: Any = loaded.tokenizer
        # prepare() runs on the loop's prepare thread while step() decodes with
        # self._tokenizer; transformers may reconfigure a fast tokenizer's backend
        # (truncation, padding) on encode, so the two threads never share one.
        self._prompt_tokenizer: Any = copy.deepcopy(loaded.tokenizer)
        self._prompts = PromptRenderer(self._prompt_tokenizer)
        text_config = loaded.model.config.get_text_config(decoder=True)
        self._text_config: Any = text_config
        self._vocab_size = int(text_config.vocab_size)
        max_positions = getattr(text_config, "max_position_embeddings", None) or self._max_seq_len
        self._max_context = min(self._max_seq_len, int(max_positions))
        self._runner = self._build_runner(runner_class, loaded, quantization, stages)
        self._end_ids = end_ids(self._tokenizer, self._generation_config, text_config, self._vocab_size)
        self._reasoning = choose(
            config.reasoning_parser, self._prompt_tokenizer.chat_template, VocabFromHF(self._prompt_tokenizer)
        )
        if self._reasoning is not None:
            self._end_ids = self._end_ids - self._reasoning.not_stops
        # Grammars and logprobs' token bytes, XTC's and DRY's masks: built on first use.
        self._tables = VocabTables(self._tokenizer, self._vocab_size, self._end_ids)
        # Prefix-cache hits land on block boundaries (Scheduler.reusable): the runner's
        # blocks, or the chunks themselves when they are shorter.
        self._block = min(BLOCK_TOKENS, self._chunk_size)
        self._prefix_cache = PrefixCache(config.prefix_cache_mb * 2**20, self._block)
        self._scheduler = Scheduler(
            self._runner,
            self._prefix_cache,
            chunk_size=self._chunk_size,
            num_draft_tokens=self._num_draft_tokens,
            max_context=self._max_context,
            block=self._block,
            vocab_size=self._vocab_size,
        )
        vocab = self._tokenizer.get_vocab()
        self._info = ModelInfo(
            model_id=loaded.model_id,
            max_context_tokens=self._max_context,
            drafting=config.drafting,
            kv_cache_tokens=config.kv_cache_mb * 2**20 // self._runner.kv_bytes_per_token(),
            max_batch_size=config.max_batch_size or 1,
            # Byte-level BPE pieces spell each byte as one character, so a piece is
            # never shorter than the text it decodes to: a safe upper bound.
            longest_token_chars=max((len(t) for t in vocab), default=0),
            grammar=True,
            logprobs=True,
            banned_strings=True,
            vocab_size=self._vocab_size,
            # The proxy reads the model's tool-call format from it; this engine
            # passes no tools to its template, so tools come as a system prompt.
            chat_template=self._prompt_tokenizer.chat_template,
            # Prefix-cache hits and entries end at multiples of the block (Scheduler.reusable).
            kv_block_tokens=self._block,
            cache_salt=True,
            reasoning_parser=self._reasoning.name if self._reasoning is not None else None,
            kernels=tuple(self._runner.kernels.names().items()),
            reasoning_budget=config.reasoning_budget,
            # A grammar's matcher and the logprob trail would have to rewind with the text.
            banned_strings_alone=True,
        )
        stages.stage(Stage.WARM_UP, "warm up (one forward pass)")
        self._warm_up()

    def _build_runner(
        self,
        runner_class: type[LlamaRunner],
        loaded: LoadedModel,
        quantization: Quantization,
        stages: LoadReporter,
    ) -> LlamaRunner:
        """The forward pass over ``loaded``: its quantized weights read back from the
        ``weight_cache`` when an earlier start kept them, else quantized (the
        ``quantize`` stage, by layer) and kept for the next start."""
        config = self._config
        stages.stage(Stage.KERNELS, "choose kernels (measured speed)")
        choice = kernel_choice.resolve(
            loaded.model,
            quantization,
            forced=config.cpu_kernels,
            cache_dir=config.cache_dir if loaded.folder is not None else None,
        )
        logger.info("%s", choice.line())
        self._kernel_choice = choice
        cache_path = None
        quantized = None
        if quantization is not Quantization.NONE and loaded.folder is not None:
            cache_path = weight_cache.cache_file(
                config.cache_dir,
                loaded.folder,
                quantization.value,
                config.dense_prefill,
                choice.kernels.layers,
            )
            quantized = weight_cache.load(cache_path)
        layers = int(getattr(self._text_config, "num_hidden_layers", 0) or 0)
        label = f"{'read' if quantized is not None else 'quantize'} weights ({quantization.value})"
        stages.stage(Stage.QUANTIZE, label, total=layers, unit="layers")
        try:
            runner = runner_class(
                loaded.model,
                quantization,
                self._max_context,
                config.dense_prefill,
                quantized=quantized,
                progress=stages.advance,
                kernels=choice.kernels,
            )
        except KeyError as e:  # a cached file of another shape: quantize again
            logger.warning("the cached quantized weights lack %s; quantizing again", e)
            runner = runner_class(
                loaded.model,
                quantization,
                self._max_context,
                config.dense_prefill,
                progress=stages.advance,
                kernels=choice.kernels,
            )
            quantized = None
        if quantized is None and cache_path is not None:
            weight_cache.save(cache_path, runner.quantized_state())
        return runner

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        config: WorkerSettings | None = None,
        runner_class: type[LlamaRunner] = LlamaRunner,
    ) -> CpuBackend:
        """A backend over an already loaded model (tests, benchmarks);
        ``runner_class`` replaces the forward pass (tests script its logits)."""
        return cls(config or WorkerSettings(), loaded=loaded, runner_class=runner_class)

    @property
    def kernel_choice(self) -> kernel_choice.Choice:
        """How the kernels were chosen at start (``kernel_choice.resolve``)."""
        return self._kernel_choice

    @property
    def runner(self) -> LlamaRunner:
        """The forward pass (read-only use: shapes, weight bytes)."""
        return self._runner

    # ------------------------------------------------------------------ Backend

    @property
    def info(self) -> ModelInfo:
        return self._info

    def attach_kv_events(self, sink: BatchSink) -> KvEvents:
        """Publish the prefix cache's entries as blocks of ``info.kv_block_tokens`` (its
        entries end at multiples of it, ``Scheduler.reusable``), medium ``CPU``."""
        events = KvEvents(sink, block_size=self._info.kv_block_tokens, medium=MEDIUM_CPU)
        self._prefix_cache.listen(
            lambda tokens, salt: events.store_tokens(tokens.tolist(), salt),
            lambda tokens, salt: events.evict_tokens(tokens.tolist(), salt),
        )
        return events

    @property
    def prefix_cache(self) -> PrefixCache:
        """The cross-request prefix cache (read-only use: size, entries)."""
        return self._prefix_cache

    def active_ids(self) -> Collection[str]:
        return self._scheduler.sequences.keys()

    def prepare(self, submit: Submit) -> Prepared:
        """Tokenize (applying the chat template to ``messages``) and compile the
        grammar, if any. Sampling and the context are the loop's to check
        (``engine_worker.admission``).

        Raises ``RequestRejected`` (``INVALID_REQUEST``) for messages the chat
        template refuses and for a grammar that does not compile (``param`` =
        ``params.grammar_param``).
        """
        params = submit.params
        budget = thinking_budget(params, self._config.reasoning_budget)
        prompt_ids, param = self._prompts.tokenize(submit, budget)
        plan = None
        if self._reasoning is not None:
            plan = self._reasoning.plan(prompt_ids, budget)
            prompt_ids = plan.prompt_ids
        matcher = None
        if params.grammar is not None:
            # Compiled here, off the engine thread; start() copies it per choice.
            matcher = self._tables.compile(params, self._prompt_tokenizer)
        elif params.logprobs is not None:
            self._tables.load_vocabulary(self._prompt_tokenizer)  # token bytes, built here too
        return Prepared(submit, _Prompt(prompt_ids, params.grammar, matcher, plan), len(prompt_ids), param)

    def prompt_ids(self, prepared: Prepared) -> list[int]:
        prompt: _Prompt = prepared.prompt
        return list(prompt.ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        check_token_ids(token_ids, self._vocab_size)
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def text_prefix_ids(self) -> list[int]:
        return self._prompts.text_prefix_ids()

    def reservation(self, prepared: Prepared) -> int:
        """Prompt plus every completion token the sequence may produce: its KV never
        grows past that, so admitted sequences never exceed ``kv_cache_mb``."""
        return full_reservation(prepared)

    def kv_reserved(self) -> int:
        return sum(s.reservation for s in self._scheduler.sequences.values())

    def start(self, request_id: str, prepared: Prepared, params: SamplingParams) -> None:
        """Admit one sequence of ``prepared``, sampling with ``params``. Raises
        ``RequestRejected`` when ``params`` has a grammar ``prepare`` did not
        compile and it does not compile."""
        prompt: _Prompt = prepared.prompt
        prompt_ids = prompt.ids
        constraint = None
        if params.grammar is not None:
            if prompt.matcher is not None and prompt.grammar == params.grammar:
                matcher = prompt.matcher.deep_copy()
            else:  # params other than the prepared request's: compile on this thread
                matcher = self._tables.compile(params, self._tokenizer)
            constraint = TokenConstraint(matcher, self._vocab_size, params.grammar_param)
        trail = None
        if params.logprobs is not None:
            self._tables.load_vocabulary(self._tokenizer)
            trail = LogprobTrail(self._tables.token_info)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._end_ids)
        drafter = None
        if self._ngram and not params.banned_strings:  # a rewind would leave the drafter's index behind
            drafter = NgramDrafter(prompt_ids, self._config.ngram_match_min, self._ngram_match_max)
        sampler = TokenSampler(
            params,
            prompt_ids,
            self._vocab_size,
            stop_ids,
            eos_ids=self._end_ids,
            protected=self._tables.xtc_protected() if params.xtc_probability > 0.0 else None,
            breakers=self._tables.dry_breakers(params.dry_sequence_breakers)
            if params.dry_multiplier > 0
            else None,
        )

        def observe(token: int) -> None:
            sampler.observe(token)
            if drafter is not None:
                drafter.observe(token)

        context = prompt_ids[-_DETOKENIZER_CONTEXT:]
        out = SequenceOutput(
            request_id=request_id,
            params=params,
            prompt_len=len(prompt_ids),
            max_new=prepared.max_new_tokens,
            stop_ids=stop_ids,
            detokenizer=IncrementalDetokenizer(
                self._tokenizer, context, skip_special_tokens=params.skip_special_tokens is not False
            ),
            stopper=StopMatcher(params.stop),
            observe=observe,
            restart=lambda output: sampler.rewind(prompt_ids, output),
            tokens=list(prompt_ids),
            constraint=constraint,
            trail=trail,
            banned=BannedStrings(params.banned_strings) if params.banned_strings else None,
        )
        if prompt.reasoning is not None:
            out.splitter = prompt.reasoning.new_splitter()
            out.thinker = IncrementalDetokenizer(self._tokenizer, context)
        self._scheduler.add(
            Sequence(
                request_id=request_id,
                source=prompt,
                prompt_ids=prompt_ids,
                t_added=time.perf_counter(),
                sampler=sampler,
                drafter=drafter,
                reservation=self.reservation(prepared),
                out=out,
                cache_salt=prepared.submit.cache_salt,
            )
        )

    def abort(self, request_id: str) -> None:
        """Drop the request now; its valid KV (prompt processed so far, fed output
        tokens) is kept in the prefix cache."""
        self._scheduler.abort(request_id)

    def step(self) -> list[Event]:
        """One forward pass over every running sequence (``Scheduler.step``)."""
        return self._scheduler.step()

    def close(self) -> None:
        """Drop all requests, the prefix cache and the model."""
        self._scheduler.close()
        self._prefix_cache.clear()

    def _warm_up(self) -> None:
        """One small forward pass, so the first request does not pay for paging in
        the weights and for the kernels' first-call setup."""
        with torch.inference_mode():
            self._runner.forward([Segment(self._runner.new_kv(8), [0, 0, 0, 0], 1)])


if TYPE_CHECKING:

    def _conforms_to_backend(backend: CpuBackend) -> Backend:  # checked by mypy only
        return backend
