"""``CpuBackend``: the ``engine_worker.backend.Backend`` on CPU with torch
(``engine_worker.cpu.llama``: quantized weights, batched passes).

Each request owns a ``SequenceKV``. One ``step`` is one forward pass over every
running sequence (batched decode; each sequence attends over its own KV length):

- prefill: chunks of the prompt, at most ``chunk_size`` prompt tokens per pass
  shared by the sequences in prefill (oldest first), after seeding the KV cache
  with the longest matching prefix from the ``PrefixCache`` (at most
  ``prompt_tokens - 1`` positions: the last prompt token is always fed, to get the
  logits of the first completion token). Decoding sequences ride in the same
  pass, so a long prompt holds them up by one chunk's compute per token;
- decode: the last token, plus, with n-gram drafting, up to ``num_draft_tokens``
  drafted tokens verified in the same pass. Each position's logits go through
  the request's ``TokenSampler`` in order and a draft token is accepted while it
  equals the target's own choice, so the output is exactly what plain decoding
  would produce (greedy: identical tokens; sampling: the target distribution).
  The KV of rejected positions is cropped.

With a grammar (``SamplingParams.grammar``, ``engine_worker.constraints``), each
position's logits are masked by the sequence's matcher before sampling and the
chosen token is consumed by it, positions of a verify pass included, so drafted
tokens are judged under the same mask plain decoding would use; drafts are first
cut to the prefix the grammar allows (no pass verifies a token it forbids). The
grammar is compiled in ``prepare`` (the loop's prepare thread); each choice
decodes with its own copy. A complete grammar ends the sequence with ``stop``.

With ``SamplingParams.logprobs`` the sampler also scores each chosen token
(``TokenSampler.sample_scored``) and a ``LogprobTrail`` lines the entries up with
the text each ``TokenDelta`` carries. Without it neither runs.

Choices of one request (``n > 1``: one ``Prepared`` started several times) share
one prefill. The first choice prefills the prompt; the later ones wait, with no
events, until its last prompt chunk has run, then start from it in that same
step: a copy of its prompt KV and the logits of its last prompt position, from
which each samples its first token with its own sampler. That is bitwise what
their own prefill would have computed (chunks at the same multiples of
``chunk_size``, rows computed as alone: ``docs/performance.md#batch-invariance``),
so greedy output is unchanged, and ``cached_tokens`` is then the whole prompt,
none of which they computed. If the first choice ends before its prefill does,
the next one prefills in its place.

Events follow ``protocol.messages``: ``Started``, ``PrefillProgress`` (first with
``processed == cached``, one after every chunk, last with ``processed == total``),
``TokenDelta``, then ``Finished`` or ``RequestError``. A finished or aborted
sequence's valid KV goes into the prefix cache; a failed one's is dropped (its
KV may be half-written).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from llguidance import LLMatcher

from engine_worker.admission import full_reservation
from engine_worker.backend import Backend, ModelInfo, Prepared, RequestRejected, check_token_ids
from engine_worker.client_text import ControlTokens, control_tokens
from engine_worker.constraints import GrammarUnsupported, TokenConstraint, Vocabulary, compile_grammar
from engine_worker.cpu import kernel_choice, weight_cache
from engine_worker.cpu.banned import BannedStrings
from engine_worker.cpu.detokenize import IncrementalDetokenizer
from engine_worker.cpu.kv_cache import SequenceKV
from engine_worker.cpu.llama import BLOCK_TOKENS, LlamaRunner, Quantization, Segment
from engine_worker.cpu.logprobs import LogprobTrail
from engine_worker.cpu.model_store import LoadedModel, load_embedded, load_model
from engine_worker.cpu.ngram import NgramDrafter
from engine_worker.cpu.prefix_cache import PrefixCache
from engine_worker.cpu.sampling import Scored, TokenSampler
from engine_worker.kv_events import MEDIUM_CPU, BatchSink, KvEvents
from engine_worker.load_stages import LoadReporter, Stage
from engine_worker.reasoning import Plan, Splitter, choose, template_kwargs
from engine_worker.reasoning.base import VocabFromHF
from engine_worker.settings import DraftMode, WorkerSettings
from engine_worker.stops import StopMatcher
from protocol.messages import (
    Channel,
    ErrorCode,
    Event,
    Finished,
    FinishReason,
    PrefillProgress,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
)

logger = logging.getLogger(__name__)

# Special tokens that end an assistant turn or a document in common chat
# templates (ChatML, Llama 3, Gemma, Phi-3); only those the tokenizer has count.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")
# and the document end of GPT-2-style vocabularies, which raw completions emit
_END_OF_TEXT_TOKENS = ("<|endoftext|>",)
# Prompt tokens decoded together with the first output tokens (leading spaces).
_DETOKENIZER_CONTEXT = 4
# First KV allocation beyond the prompt, tokens; the cache grows when needed.
_INITIAL_DECODE_ROOM = 256


@dataclass(frozen=True, slots=True)
class _Prompt:
    """``Prepared.prompt`` of this backend: the token ids, and the request's
    grammar compiled on the prepare thread (``None`` without one)."""

    ids: list[int]
    grammar: str | None = None
    matcher: LLMatcher | None = None
    reasoning: Plan | None = None  # with a reasoning parser: the request's plan (engine_worker.reasoning)


@dataclass(eq=False)
class _Request:
    """One admitted sequence and its engine state."""

    request_id: str
    params: SamplingParams
    source: _Prompt  # the prepared prompt; choices of one request share it (and one prefill)
    prompt_ids: list[int]
    max_new: int  # completion budget: max_tokens within the context (Prepared.max_new_tokens)
    t_added: float
    sampler: TokenSampler
    detokenizer: IncrementalDetokenizer
    stopper: StopMatcher
    drafter: NgramDrafter | None
    stop_ids: frozenset[int]
    reservation: int  # KV tokens reserved for it out of kv_cache_mb
    constraint: TokenConstraint | None = None  # the grammar, when the request has one
    cache_salt: str | None = None  # prefix-cache entries are shared within one salt only
    trail: LogprobTrail | None = None  # when the request asked for logprobs
    banned: BannedStrings | None = None  # when the request has banned strings
    rewound: bool = False  # a banned string rewound it during this step's token
    splitter: Splitter | None = None  # thinking vs answer, with a reasoning parser
    thinker: IncrementalDetokenizer | None = None  # the thinking's own text, with a splitter
    thinking: list[str] = field(default_factory=list)  # thinking text not yet in a TokenDelta
    unreported_thinking: int = 0  # of `unreported`, thinking tokens (markers included)
    unsplit: list[Scored | None] = field(default_factory=list)  # scores of tokens the splitter holds
    tokens: list[int] = field(default_factory=list)  # prompt + output; tokens[:kv.length] have KV
    kv: SequenceKV | None = None
    processed: int = 0
    cached: int = 0
    unreported: int = 0  # output tokens not yet counted in a TokenDelta
    draft_accepted: int = 0
    draft_rejected: int = 0
    t_start: float = 0.0
    t_prefill_end: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class _Work:
    """One sequence's part of a step's pass: a prompt chunk (``drafts`` is
    ``None``) or its last token followed by ``drafts``."""

    req: _Request
    segment: Segment
    drafts: list[int] | None


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
        self._control_tokens = ControlTokens(control_tokens(self._prompt_tokenizer))
        text_config = loaded.model.config.get_text_config(decoder=True)
        self._text_config: Any = text_config
        self._vocab_size = int(text_config.vocab_size)
        max_positions = getattr(text_config, "max_position_embeddings", None) or self._max_seq_len
        self._max_context = min(self._max_seq_len, int(max_positions))
        self._runner = self._build_runner(runner_class, loaded, quantization, stages)
        self._end_ids = self._find_end_ids()
        self._reasoning = choose(
            config.reasoning_parser, self._prompt_tokenizer.chat_template, VocabFromHF(self._prompt_tokenizer)
        )
        if self._reasoning is not None:
            self._end_ids = self._end_ids - self._reasoning.not_stops
        # Grammars and logprobs' token bytes; built on the first request that needs them.
        self._vocabulary = Vocabulary(self._vocab_size, self._end_ids)
        self._token_info_cache: dict[int, tuple[str, bytes]] = {}
        self._protected: torch.Tensor | None = None  # XTC's held-out tokens, built on first use
        self._texts: list[str] | None = None  # every token's text, built on first use (XTC, DRY)
        self._breaker_masks: dict[tuple[str, ...] | None, torch.Tensor] = {}
        # Prefix-cache hits land on block boundaries (_reusable): the runner's
        # blocks, or the chunks themselves when they are shorter.
        self._block = min(BLOCK_TOKENS, self._chunk_size)
        self._prefix_cache = PrefixCache(config.prefix_cache_mb * 2**20, self._block)
        self._requests: dict[str, _Request] = {}
        self._prefill_turn = 0  # which sequence in prefill goes first in the next pass
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
            # Prefix-cache hits and entries end at multiples of the block (_reusable).
            kv_block_tokens=self._block,
            cache_salt=True,
            reasoning_parser=self._reasoning.name if self._reasoning is not None else None,
            kernels=tuple(self._runner.kernels.names().items()),
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
        entries end at multiples of it, ``_reusable``), medium ``CPU``."""
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
        return self._requests.keys()

    def prepare(self, submit: Submit) -> Prepared:
        """Tokenize (applying the chat template to ``messages``) and compile the
        grammar, if any. Sampling and the context are the loop's to check
        (``engine_worker.admission``).

        Raises ``RequestRejected`` (``INVALID_REQUEST``) for messages the chat
        template refuses and for a grammar that does not compile (``param`` =
        ``params.grammar_param``).
        """
        params = submit.params
        if params.banned_strings and (params.grammar is not None or params.logprobs is not None):
            # Both would need rewinding with the text (a grammar's matcher, the logprob trail).
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                "banned_strings cannot be combined with structured output or logprobs on this engine",
                param="banned_strings",
            )
        budget = (
            params.reasoning_budget if params.reasoning_budget is not None else self._config.reasoning_budget
        )
        prompt_ids, param = self._tokenize(submit, budget)
        plan = None
        if self._reasoning is not None:
            plan = self._reasoning.plan(prompt_ids, budget)
            prompt_ids = plan.prompt_ids
        matcher = None
        if params.grammar is not None:
            # Compiled here, off the engine thread; start() copies it per choice.
            matcher = self._compile(params, self._prompt_tokenizer)
        elif params.logprobs is not None:
            self._load_vocabulary(self._prompt_tokenizer)  # token bytes, built here too
        return Prepared(submit, _Prompt(prompt_ids, params.grammar, matcher, plan), len(prompt_ids), param)

    def prompt_ids(self, prepared: Prepared) -> list[int]:
        prompt: _Prompt = prepared.prompt
        return list(prompt.ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        check_token_ids(token_ids, self._vocab_size)
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def text_prefix_ids(self) -> list[int]:
        bos = self._prompt_tokenizer.bos_token_id
        empty = self._prompt_tokenizer("", add_special_tokens=True)["input_ids"]
        return [bos] if isinstance(bos, int) and list(empty[:1]) == [bos] else []

    def reservation(self, prepared: Prepared) -> int:
        """Prompt plus every completion token the sequence may produce: its KV never
        grows past that, so admitted sequences never exceed ``kv_cache_mb``."""
        return full_reservation(prepared)

    def kv_reserved(self) -> int:
        return sum(r.reservation for r in self._requests.values())

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
                matcher = self._compile(params, self._tokenizer)
            constraint = TokenConstraint(matcher, self._vocab_size, params.grammar_param)
        trail = None
        if params.logprobs is not None:
            self._load_vocabulary(self._tokenizer)
            trail = LogprobTrail(self._token_info)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._end_ids)
        drafter = None
        if self._ngram and not params.banned_strings:  # a rewind would leave the drafter's index behind
            drafter = NgramDrafter(prompt_ids, self._config.ngram_match_min, self._ngram_match_max)
        self._requests[request_id] = _Request(
            request_id=request_id,
            params=params,
            source=prompt,
            prompt_ids=prompt_ids,
            max_new=prepared.max_new_tokens,
            t_added=time.perf_counter(),
            sampler=TokenSampler(
                params,
                prompt_ids,
                self._vocab_size,
                stop_ids,
                eos_ids=self._end_ids,
                protected=self._xtc_protected() if params.xtc_probability > 0.0 else None,
                breakers=self._dry_breakers(params.dry_sequence_breakers)
                if params.dry_multiplier > 0
                else None,
            ),
            detokenizer=IncrementalDetokenizer(
                self._tokenizer,
                prompt_ids[-_DETOKENIZER_CONTEXT:],
                skip_special_tokens=params.skip_special_tokens is not False,
            ),
            stopper=StopMatcher(params.stop),
            drafter=drafter,
            stop_ids=stop_ids,
            reservation=self.reservation(prepared),
            constraint=constraint,
            cache_salt=prepared.submit.cache_salt,
            trail=trail,
            banned=BannedStrings(params.banned_strings) if params.banned_strings else None,
            tokens=list(prompt_ids),
        )
        if prompt.reasoning is not None:
            req = self._requests[request_id]
            req.splitter = prompt.reasoning.new_splitter()
            req.thinker = IncrementalDetokenizer(self._tokenizer, prompt_ids[-_DETOKENIZER_CONTEXT:])

    def abort(self, request_id: str) -> None:
        """Drop the request now; its valid KV (prompt processed so far, fed output
        tokens) is kept in the prefix cache."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._release(req, keep_kv=True)

    def step(self) -> list[Event]:
        """One forward pass over every running sequence; the events produced, in order.

        A step that admits new requests (prefix-cache lookup, ``Started`` and the
        first ``PrefillProgress``) runs no forward pass, so those events reach the
        client at once instead of after a pass.

        Otherwise one pass (``LlamaRunner.forward``) carries every decoding
        sequence's last token and drafts, plus at most ``chunk_size`` prompt
        tokens of the sequences still in prefill, oldest first: a long prompt
        delays the others' next token by one chunk's compute at most. When the
        batched pass raises, each of its sequences is run alone, so only the one
        that fails gets an error.
        """
        if not self._requests:
            return []
        events: list[Event] = []
        with torch.inference_mode():
            waiting = self._startable()
            if waiting:
                for req in waiting:
                    self._guarded(req, events, self._start, req, events)
                return events
            work = self._plan()
            results = self._run(work, events)
            for item, logits in results:
                self._guarded(item.req, events, self._apply, item, logits, events)
        return events

    def _startable(self) -> list[_Request]:
        """Admitted sequences to start now: all but the later choices of a request
        whose first choice is still before the end of its prefill (they start from
        it, ``_follow``)."""
        prefilling: set[int] = set()  # id() of the prompts a choice is prefilling
        out: list[_Request] = []
        for req in self._requests.values():
            key = id(req.source)
            if req.kv is None and key not in prefilling:
                out.append(req)
            if req.kv is None or req.processed < req.prompt_len:
                prefilling.add(key)
        return out

    def _plan(self) -> list[_Work]:
        """This step's segments: every decoding sequence (its drafts proposed and
        cut to the grammar), and prompt chunks within ``chunk_size`` tokens.

        Chunks end at multiples of ``chunk_size`` (``_reusable``). Sequences in
        prefill take turns at going first, so a short prompt behind a long one
        waits one chunk, not the whole long prefill."""
        work: list[_Work] = []
        prefilling: list[_Request] = []
        for req in self._requests.values():
            if req.kv is None:
                continue  # a later choice waiting for its first one's prefill
            if req.processed < req.prompt_len:
                prefilling.append(req)
                continue
            drafts = self._propose(req)
            inputs = [req.tokens[-1], *drafts]
            work.append(_Work(req, Segment(req.kv, inputs, len(inputs)), drafts))
        if not prefilling:
            return work
        first = self._prefill_turn % len(prefilling)
        self._prefill_turn = first + 1
        budget = self._chunk_size
        for req in prefilling[first:] + prefilling[:first]:
            begin = req.processed // self._chunk_size * self._chunk_size  # where this chunk starts
            end = min(begin + self._chunk_size, req.prompt_len)
            if end - req.processed <= budget:
                assert req.kv is not None
                budget -= end - req.processed
                chunk = req.prompt_ids[req.processed : end]
                logits = 1 if end == req.prompt_len else 0
                # After a prefix-cache hit inside a chunk only its tail runs, on the
                # path the whole chunk takes (Segment.chunk_tokens).
                segment = Segment(req.kv, chunk, logits, chunk_tokens=end - begin)
                work.append(_Work(req, segment, None))
        return work

    def _run(self, work: list[_Work], events: list[Event]) -> list[tuple[_Work, torch.Tensor | None]]:
        """The pass over ``work``; each item with its logits. A failing batched pass
        is retried item by item, and the items that fail alone get an error."""
        try:
            logits = self._runner.forward([item.segment for item in work])
            return list(zip(work, logits, strict=True))
        except Exception:
            if len(work) == 1:
                self._fail(work[0].req, events)
                return []
            logger.warning("a batched pass of %d sequences failed; running them one by one", len(work))
        results: list[tuple[_Work, torch.Tensor | None]] = []
        for item in work:
            try:
                results.append((item, self._runner.forward([item.segment])[0]))
            except Exception:
                self._fail(item.req, events)
        return results

    def _fail(self, req: _Request, events: list[Event]) -> None:
        """End ``req`` with an internal error after its pass raised; its KV is
        dropped (it may be half-written)."""
        logger.exception("request %s failed", req.request_id)
        if self._requests.pop(req.request_id, None) is not None:
            self._release(req, keep_kv=False)
        exc = sys.exc_info()[1]
        events.append(
            RequestError(
                request_id=req.request_id,
                code=ErrorCode.INTERNAL,
                message=f"CPU engine error: {type(exc).__name__}: {exc}",
            )
        )

    def _guarded(self, req: _Request, events: list[Event], action: Callable[..., None], *args: Any) -> None:
        """Run ``action(*args)`` for ``req``; an exception ends ``req`` alone."""
        try:
            action(*args)
        except RequestRejected as exc:  # the request's own fault (its grammar failed): its KV is sound
            logger.info("request %s rejected while decoding: %s", req.request_id, exc.message)
            if self._requests.pop(req.request_id, None) is not None:
                self._release(req, keep_kv=True)
            events.append(RequestError(req.request_id, exc.code, exc.message, exc.param))
        except Exception:  # one request's failure must not end the others
            self._fail(req, events)

    def close(self) -> None:
        """Drop all requests, the prefix cache and the model."""
        self._requests.clear()
        self._prefix_cache.clear()

    def _warm_up(self) -> None:
        """One small forward pass, so the first request does not pay for paging in
        the weights and for the kernels' first-call setup."""
        with torch.inference_mode():
            self._runner.forward([Segment(self._runner.new_kv(8), [0, 0, 0, 0], 1)])

    # ------------------------------------------------------------------ admission

    def _load_vocabulary(self, tokenizer: Any) -> None:
        """Build llguidance's vocabulary from ``tokenizer`` (one the calling thread
        owns) unless built; without it, logprobs fall back on decoded token text."""
        with contextlib.suppress(GrammarUnsupported):
            self._vocabulary.load(tokenizer)

    def _compile(self, params: SamplingParams, tokenizer: Any) -> LLMatcher:
        assert params.grammar is not None
        try:
            ll_tokenizer = self._vocabulary.load(tokenizer)
        except GrammarUnsupported as exc:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(exc), param=params.grammar_param) from exc
        return compile_grammar(ll_tokenizer, params.grammar, params.grammar_param)

    def _token_info(self, token_id: int) -> tuple[str, bytes]:
        """A token's text (its bytes decoded, invalid UTF-8 replaced) and raw bytes."""
        info = self._token_info_cache.get(token_id)
        if info is None:
            if self._vocabulary.loaded:
                raw = self._vocabulary.token_bytes(token_id)
            else:  # no llguidance vocabulary for this tokenizer: its decoded text
                raw = str(self._tokenizer.decode([token_id], skip_special_tokens=False)).encode()
            info = self._token_info_cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return info

    def _xtc_protected(self) -> torch.Tensor:
        """The ``[vocab]`` bool mask of tokens XTC never excludes: every token whose
        text has a newline, and every special or added token, as ExLlamaV3's
        ``xtc_default_protected_token_ids`` (``generator/sampler/custom.py``)."""
        if self._protected is None:
            self._protected = self._pieces_with(("\n",)) | self._added_mask()
        return self._protected

    def _dry_breakers(self, strings: tuple[str, ...] | None) -> torch.Tensor | None:
        """DRY's sequence breakers as a ``[vocab]`` bool mask: every token whose text
        contains one of ``strings`` (ExLlamaV3's ``dry_sequence_breaker_tokens``), or
        for ``None`` its default set (``dry_default_sequence_breaker_tokens``: the
        characters ``.,!?<>[](){}``, newline, tab and ``"``, plus every added token);
        ``None`` for no breakers. The last few masks are kept."""
        mask = self._breaker_masks.get(strings)
        if mask is None:
            if strings is None:
                mask = self._pieces_with(tuple('.,!?<>[](){}\n\t"')) | self._added_mask()
            else:
                mask = self._pieces_with(tuple(s for s in strings if s))
            if len(self._breaker_masks) >= 8:
                self._breaker_masks.pop(next(iter(self._breaker_masks)))
            self._breaker_masks[strings] = mask
        return mask if bool(mask.any()) else None

    def _pieces_with(self, strings: tuple[str, ...]) -> torch.Tensor:
        """``[vocab]`` bool: the tokens whose text (special tokens written out) has one of ``strings``."""
        if self._texts is None:
            ids = [[i] for i in range(self._vocab_size)]
            self._texts = [str(t) for t in self._tokenizer.batch_decode(ids, skip_special_tokens=False)]
        return torch.tensor([any(s in t for s in strings) for t in self._texts], dtype=torch.bool)

    def _added_mask(self) -> torch.Tensor:
        """``[vocab]`` bool: the tokenizer's added (special) tokens, ExLlamaV3's ``extended_id_to_piece``."""
        mask = torch.zeros(self._vocab_size, dtype=torch.bool)
        added = [i for i in self._tokenizer.added_tokens_decoder if 0 <= i < self._vocab_size]
        if added:
            mask[torch.tensor(added, dtype=torch.long)] = True
        return mask

    def _find_end_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        generation_config = self._generation_config
        for source in (
            self._tokenizer.eos_token_id,
            getattr(generation_config, "eos_token_id", None),
            self._text_config.eos_token_id,
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list | tuple):
                ids.update(int(i) for i in source)
        special = set(self._tokenizer.all_special_tokens)
        for name in (*_END_OF_TURN_TOKENS, *_END_OF_TEXT_TOKENS):
            if name in special:
                token_id = self._tokenizer.convert_tokens_to_ids(name)
                if isinstance(token_id, int) and token_id >= 0:
                    ids.add(token_id)
        return frozenset(i for i in ids if 0 <= i < self._vocab_size)

    def _tokenize(self, submit: Submit, budget: int | None = None) -> tuple[list[int], str]:
        """Prompt token ids and the request field they came from; ``budget`` (thinking
        tokens) may switch the template's thinking off (``reasoning.template_kwargs``)."""
        if submit.messages and submit.prompt is not None:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "send either messages or prompt, not both")
        if submit.prompt is not None:
            # The caller's own template: its control tokens' text is parsed as such. Without
            # BOS (add_bos False) nothing is added, and a BOS the text itself writes stays.
            added = submit.add_bos is not False
            raw = [
                int(i) for i in self._prompt_tokenizer(submit.prompt, add_special_tokens=added)["input_ids"]
            ]
            return self._bos(raw, submit.add_bos), "prompt"
        if not submit.messages:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "messages is empty", param="messages")
        if self._prompt_tokenizer.chat_template is None:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "this model has no chat template; use prompt", param="messages"
            )
        guard = self._control_tokens.guard()
        conversation: list[dict[str, str]] = []
        for m in submit.messages:
            turn = {"role": m.role, "content": m.content}
            if m.reasoning is not None:
                # The names templates read a turn's thinking by (Qwen3/DeepSeek; GPT-OSS).
                turn["reasoning_content"] = turn["thinking"] = m.reasoning
            conversation.append(turn)
        try:
            extra = template_kwargs(submit.template_kwargs_json, self._prompt_tokenizer.chat_template, budget)
        except ValueError as exc:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(exc), param="chat_template_kwargs") from exc
        try:
            text = self._prompt_tokenizer.apply_chat_template(
                guard.escape(conversation),
                add_generation_prompt=submit.add_generation_prompt,
                tokenize=False,
                **guard.escape(extra),
            )
            pieces = guard.pieces(text)
        except Exception as exc:  # the template itself rejects e.g. unsupported roles
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        # The call's opening the proxy wrote for a named tool (Submit.forced_prefix).
        pieces += self._control_tokens.prefix_pieces(submit.forced_prefix)
        # Control tokens only where the template (or the proxy's prefix) wrote them;
        # the rest, client text included, with special-token parsing off
        # (engine_worker.client_text).
        texts = [p.text for p in pieces if not p.control]
        encoded = iter(
            self._prompt_tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if texts
            else []
        )
        ids: list[int] = []
        for piece in pieces:
            if piece.control:
                ids.append(int(self._prompt_tokenizer.convert_tokens_to_ids(piece.text)))
            else:
                ids += (int(i) for i in next(encoded))
        return ids, "messages"

    def _bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        """A raw prompt's ids with (``True``) a leading BOS; ``None`` or ``False``: as
        the tokenizer made them (``False`` tokenized with nothing added, so a BOS the
        text writes stays, as ExLlamaV3's ``encode(add_bos=False)`` keeps it). Raises
        ``RequestRejected`` for ``True`` when the model has no BOS token."""
        bos = self._prompt_tokenizer.bos_token_id
        if not add_bos:
            return ids
        if not isinstance(bos, int):
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "this model has no BOS token", param="add_bos_token"
            )
        return ids if ids[:1] == [bos] else [bos, *ids]

    # ------------------------------------------------------------------ stepping

    def _start(self, req: _Request, events: list[Event]) -> None:
        req.t_start = time.perf_counter()
        room = min(req.max_new, _INITIAL_DECODE_ROOM) + self._num_draft_tokens + 1
        # Positions never exceed the context: drafts are limited to fit in it.
        req.kv = self._runner.new_kv(min(req.prompt_len + room, self._max_context))
        cached = 0
        if self._prefix_cache.capacity_bytes > 0:
            hit = self._prefix_cache.lookup(req.prompt_ids, req.prompt_len - 1, req.cache_salt)
            if hit is not None and self._reusable(hit.length):
                cached = self._reusable(hit.length)  # hit.length already is: whole blocks
                req.kv.seed(hit.entry.kv, cached)
        req.cached = req.processed = cached
        events.append(Started(req.request_id, req.prompt_len, cached))
        events.append(PrefillProgress(req.request_id, req.prompt_len, cached, cached, 0))

    def _apply(self, item: _Work, logits: torch.Tensor | None, events: list[Event]) -> None:
        """What a pass's logits mean for one sequence: progress, tokens, finish."""
        req = item.req
        if item.drafts is None:
            self._prefilled(req, len(item.segment.tokens), logits, events)
        else:
            assert logits is not None
            self._verify(req, item.drafts, logits, events)

    def _prefilled(self, req: _Request, count: int, logits: torch.Tensor | None, events: list[Event]) -> None:
        req.processed += count
        now = time.perf_counter()
        events.append(
            PrefillProgress(
                req.request_id, req.prompt_len, req.cached, req.processed, int((now - req.t_start) * 1000)
            )
        )
        if req.processed == req.prompt_len:
            assert logits is not None
            req.t_prefill_end = now
            for later in [r for r in self._requests.values() if r.source is req.source and r.kv is None]:
                self._guarded(later, events, self._follow, later, req, logits[-1], events)
            token, scored = self._choose(req, logits[-1])
            text, reason = self._append_token(req, token, scored)
            self._settle_rewind(req)
            self._report(req, text, reason, events)

    def _follow(self, req: _Request, first: _Request, logits: torch.Tensor, events: list[Event]) -> None:
        """Start ``req``, a later choice, from ``first``, which has just prefilled
        their prompt: its prompt KV copied, its last prompt ``logits`` sampled with
        ``req``'s own sampler (module docstring)."""
        assert first.kv is not None and first.kv.length == req.prompt_len
        req.t_start = req.t_prefill_end = time.perf_counter()
        room = min(req.max_new, _INITIAL_DECODE_ROOM) + self._num_draft_tokens + 1
        req.kv = self._runner.new_kv(min(req.prompt_len + room, self._max_context))
        req.kv.seed(first.kv.view(), req.prompt_len)
        req.cached = req.processed = req.prompt_len
        events.append(Started(req.request_id, req.prompt_len, req.cached))
        events.append(PrefillProgress(req.request_id, req.prompt_len, req.cached, req.processed, 0))
        token, scored = self._choose(req, logits.clone())  # the sampler may work in place
        text, reason = self._append_token(req, token, scored)
        self._settle_rewind(req)
        self._report(req, text, reason, events)

    def _propose(self, req: _Request) -> list[int]:
        """Drafted tokens to verify after ``req``'s last token (n-gram drafting),
        within its completion budget (so within the context) and the grammar."""
        if req.drafter is None:
            return []
        room = min(self._num_draft_tokens, req.max_new - req.num_output - 1)
        drafts = req.drafter.propose(room)
        if drafts and req.constraint is not None and (req.splitter is None or not req.splitter.free):
            drafts = drafts[: req.constraint.valid_prefix(drafts)]
        return drafts

    def _verify(self, req: _Request, drafts: list[int], logits: torch.Tensor, events: list[Event]) -> None:
        """Sample each fed position in order; a draft is accepted while it equals
        the target's own choice. ``logits``: ``[1 + len(drafts), vocab]``."""
        assert req.kv is not None
        history_len = len(req.tokens)
        pieces: list[str] = []
        reason: FinishReason | None = None
        accepted = 0
        for position in range(len(drafts) + 1):
            token, scored = self._choose(req, logits[position])
            is_draft = position < len(drafts) and token == drafts[position]
            text, reason = self._append_token(req, token, scored)
            pieces.append(text)
            if not is_draft:
                break  # the target's own token: correction or bonus
            accepted += 1
            if reason is not None:
                break  # drafts past a stop are rejected
        req.draft_accepted += accepted
        req.draft_rejected += len(drafts) - accepted
        # Positions fed: tokens[-1] and the drafts; keep the last token and the accepted drafts.
        # After a banned string's rewind, all but the last kept token (it is fed next).
        req.kv.truncate(len(req.tokens) - 1 if req.rewound else history_len + accepted)
        req.rewound = False
        self._report(req, "".join(pieces), reason, events)

    def _choose(self, req: _Request, logits: torch.Tensor) -> tuple[int, Scored | None]:
        """The token for one position's logits, within the grammar, and its score
        when the request asked for logprobs."""
        forbidden = self._forbidden(req)
        if req.banned is not None and req.banned.blocked():
            # After a banned string's rewind: its first token may not come again here.
            forbidden = (
                torch.zeros(self._vocab_size, dtype=torch.bool) if forbidden is None else forbidden.clone()
            )
            forbidden[torch.tensor(req.banned.blocked(), dtype=torch.long)] = True
        if req.trail is None:
            return req.sampler.sample(logits, forbidden), None
        assert req.params.logprobs is not None
        scored = req.sampler.sample_scored(logits, req.params.logprobs, forbidden)
        return scored.token, scored

    def _forbidden(self, req: _Request) -> torch.Tensor | None:
        """``[vocab]`` bool, the tokens ``req`` may not sample next (``None``: any): the
        grammar's, on the answer only; with a reasoning splitter, all but the forced
        token once the thinking budget is spent (``engine_worker.reasoning``)."""
        splitter = req.splitter
        if splitter is None:
            return req.constraint.forbidden() if req.constraint is not None else None
        forced = splitter.forced()
        if forced is not None:
            only = torch.ones(self._vocab_size, dtype=torch.bool)
            only[forced] = False
            return only
        forbidden = None
        if req.constraint is not None and not splitter.free:
            forbidden = req.constraint.forbidden()
            allowed = splitter.allow_with_grammar
            if allowed is not None:
                forbidden[allowed] = False
        banned = splitter.banned()
        if banned is not None:
            if forbidden is None:
                forbidden = torch.zeros(self._vocab_size, dtype=torch.bool)
            forbidden[banned] = True
        return forbidden

    def _append_token(
        self, req: _Request, token: int, scored: Scored | None = None
    ) -> tuple[str, FinishReason | None]:
        """Add one generated token (``scored`` when logprobs are on); returns its
        emittable answer text and the finish reason if generation ends with it (thinking
        text goes to ``req.thinking``)."""
        req.tokens.append(token)
        req.unreported += 1
        req.sampler.observe(token)
        if req.drafter is not None:
            req.drafter.observe(token)
        if token in req.stop_ids:
            # Stop and end-of-sequence tokens contribute no text.
            return "", FinishReason.STOP
        if req.splitter is None:
            emit, stopped = self._answer_token(req, token, scored)
        else:
            req.unsplit.append(scored)
            emit, stopped = self._split(req, req.splitter.feed(token))
        if stopped:
            return emit, FinishReason.STOP
        if req.num_output >= req.max_new:
            return emit, FinishReason.LENGTH
        return emit, None

    def _split(self, req: _Request, settled: list[tuple[Channel | None, int]]) -> tuple[str, bool]:
        """Route the tokens a splitter settled: thinking to ``req.thinking``, markers
        nowhere, the answer through ``_answer_token``; ``(answer text, stopped)``."""
        emit = ""
        for channel, token in settled:
            scored = req.unsplit.pop(0) if req.unsplit else None
            if channel is Channel.CONTENT:
                text, stopped = self._answer_token(req, token, scored)
                emit += text
                if stopped:
                    return emit, True
                continue
            req.unreported_thinking += 1
            if channel is Channel.REASONING:
                assert req.thinker is not None
                if text := req.thinker.add(token):
                    req.thinking.append(text)
        return emit, False

    def _answer_token(self, req: _Request, token: int, scored: Scored | None) -> tuple[str, bool]:
        """One answer token through the grammar, the detokenizer, logprobs and stop
        strings: ``(emittable text, stopped)`` (a stop string, or the grammar complete)."""
        complete = False
        if req.constraint is not None:
            req.constraint.consume(token)
            complete = req.constraint.stopped
        if req.banned is not None:
            state = req.detokenizer.state()
            verdict = req.banned.feed(req.detokenizer.add(token), token, req.num_output - 1, state)
            text = verdict.emit
            if verdict.rewind is not None:
                self._rewind(req, verdict.rewind.position, verdict.rewind.state)
                if req.banned.exhausted:
                    emit, _ = req.stopper.feed(text) if text else ("", False)
                    return emit, True
        else:
            text = req.detokenizer.add(token)
        if req.trail is not None:
            assert scored is not None
            req.trail.add(scored, text)
        emit, stopped = (
            req.stopper.feed(text, check=req.num_output >= req.params.min_tokens) if text else ("", False)
        )
        if req.trail is not None:
            req.trail.emitted(emit)
        return emit, stopped or complete

    def _rewind(self, req: _Request, position: int, state: Any) -> None:
        """Back to ``position`` output tokens (a banned string began after them):
        the tokens since dropped, the sampler and detokenizer as they were then;
        the KV follows in ``_verify`` (``_Request.rewound``)."""
        dropped = req.num_output - position
        del req.tokens[req.prompt_len + position :]
        req.unreported = max(0, req.unreported - dropped)
        req.sampler.rewind(req.prompt_ids, req.tokens[req.prompt_len :])
        req.detokenizer.restore(state)
        req.rewound = True

    def _settle_rewind(self, req: _Request) -> None:
        """The KV after a first token's rewind: the prompt but its last token, which
        the next pass feeds again."""
        if req.rewound:
            assert req.kv is not None
            req.kv.truncate(len(req.tokens) - 1)
            req.rewound = False

    def _report(self, req: _Request, text: str, reason: FinishReason | None, events: list[Event]) -> None:
        """Emit a delta for ``text`` (after one for the thinking, if any) and, when
        ``reason`` is set, finish the request."""
        if req.splitter is not None:
            if reason is not None and not req.stopper.stopped:
                held, _ = self._split(req, req.splitter.flush())  # a marker that never completed
                text += held
            if reason is not None and req.thinker is not None:
                req.thinking.append(req.thinker.flush())
            thinking = "".join(req.thinking)
            req.thinking.clear()
            if thinking:
                events.append(
                    TokenDelta(req.request_id, thinking, req.unreported_thinking, channel=Channel.REASONING)
                )
                req.unreported -= req.unreported_thinking
                req.unreported_thinking = 0
        if reason is not None and not req.stopper.stopped:
            # Generation ended without a stop string: release held-back text.
            tail = (req.banned.flush() if req.banned is not None else "") + req.detokenizer.flush()
            emit, stopped = req.stopper.feed(tail) if tail else ("", False)
            released = emit if stopped else emit + req.stopper.flush()
            text += released
            if req.trail is not None:
                req.trail.released_tail(tail)
                req.trail.emitted(released)
            if stopped:
                reason = FinishReason.STOP
        if req.trail is not None:
            # Cut at a token boundary: the rest of `text` comes with the next delta.
            text, logprobs = req.trail.take(final=reason is not None, cut=req.stopper.stopped)
            if text or logprobs:
                events.append(
                    TokenDelta(req.request_id, text, req.unreported - req.unreported_thinking, logprobs)
                )
                req.unreported = req.unreported_thinking
        elif text:
            events.append(TokenDelta(req.request_id, text, req.unreported - req.unreported_thinking))
            req.unreported = req.unreported_thinking
        if reason is not None:
            self._finish(req, reason, events)

    def _finish(self, req: _Request, reason: FinishReason, events: list[Event]) -> None:
        now = time.perf_counter()
        drafting = req.drafter is not None
        events.append(
            Finished(
                request_id=req.request_id,
                finish_reason=reason,
                prompt_tokens=req.prompt_len,
                cached_tokens=req.cached,
                completion_tokens=req.num_output,
                draft_accepted=req.draft_accepted if drafting else None,
                draft_rejected=req.draft_rejected if drafting else None,
                time_queued=req.t_start - req.t_added,
                time_prefill=req.t_prefill_end - req.t_start,
                time_decode=now - req.t_prefill_end,
                reasoning_tokens=req.splitter.reasoning_tokens if req.splitter is not None else 0,
            )
        )
        del self._requests[req.request_id]
        self._release(req, keep_kv=True)

    def _release(self, req: _Request, keep_kv: bool) -> None:
        """Drop ``req``'s KV; with ``keep_kv``, its prompt's whole blocks go into
        the prefix cache (``_reusable``)."""
        kv, req.kv = req.kv, None
        if kv is None or not keep_kv or self._prefix_cache.capacity_bytes == 0:
            return
        length = self._reusable(min(req.processed, kv.length))
        if length:
            kv.truncate(length)
            self._prefix_cache.insert(req.prompt_ids[:length], kv.export(), req.cache_salt)

    def _reusable(self, positions: int) -> int:
        """How many of a prompt's first ``positions`` computed positions a later
        prompt may reuse: whole blocks (``BLOCK_TOKENS`` positions, or the chunk
        when ``chunk_size`` is smaller).

        A prompt is cut into chunks at multiples of ``chunk_size`` from its first
        token, whatever is cached, and the dense weights cut a chunk's rows at
        block boundaries (``llama.BLOCK_TOKENS``), so the positions after a hit
        meet the same kernels as without it; their bits may still differ in the
        last place where a kernel's row depends on the rows beside it
        (``docs/performance.md#batch-invariance``;
        ``tests/unit/engine_worker/cpu/test_cpu_engine.py`` checks the output of
        a hit inside a chunk of the embedded model's shape). Generated tokens are
        never reused: their KV came from decode, not prefill."""
        return positions // self._block * self._block


if TYPE_CHECKING:

    def _conforms_to_backend(backend: CpuBackend) -> Backend:  # checked by mypy only
        return backend
