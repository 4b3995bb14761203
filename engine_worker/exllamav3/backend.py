"""``ExLlamaV3Backend``: drives the synchronous ExLlamaV3 ``Generator`` and turns
its result dicts into ``protocol.messages`` events, at this one place
(``results``: one job's dicts; ``segments``: the pages a job takes).

The worker loop calls ``add``/``abort``/``step`` on one thread, so ``enqueue``,
``cancel`` and ``iterate`` all run on that thread, as ExLlamaV3 requires; a call
from another thread raises ``RuntimeError`` instead of corrupting the page table.
An exception out of ``iterate()`` fails the jobs the generator had started and
carries the queued ones over into a new ``Generator`` (``_recover``), or raises
``EngineFailed`` when the GPU no longer runs work or faults keep coming. Choices
of one request follow ``engine_worker.requests.choices``: the later ones are held
back until the first has finished its prefill, and then find the whole prompt
cached. What 1.6.5 returns and how each piece is converted, with the source lines
it was read from: ``docs/exllamav3.md``, "How iterate() results become events".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import msgspec

from engine_worker.backend import EngineFailed, ModelInfo, Prepared, RequestRejected, check_token_ids
from engine_worker.client_text import TemplateMangled
from engine_worker.constraints import grammar_failure
from engine_worker.exllamav3 import logprobs as lp
from engine_worker.exllamav3.engine import EngineHandle, GeneratorLike, id_list
from engine_worker.exllamav3.grammar import compile_filter, failure_of
from engine_worker.exllamav3.kv_pages import PageTableEvents
from engine_worker.exllamav3.results import AnswerText, JobRecord, Phase, ResultConverter
from engine_worker.exllamav3.sampling import FLOAT32_MAX, breaker_ids, job_settings
from engine_worker.exllamav3.segments import SegmentSizes
from engine_worker.exllamav3.vision import GpuTurns, ImageEmbeddings, distinct
from engine_worker.kv_events import MEDIUM_GPU, BatchSink, KvEvents
from engine_worker.options.exllamav3 import PAGE_SIZE
from engine_worker.reasoning import Plan, VocabFromTables, choose, template_kwargs
from engine_worker.reasoning.text_split import TextSplitter
from engine_worker.requests.choices import startable
from engine_worker.requests.events import Recent
from engine_worker.requests.turns import template_turns, thinking_budget
from engine_worker.settings import WorkerSettings
from protocol.messages import (
    ErrorCode,
    Event,
    RequestError,
    SamplingParams,
    Submit,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Prompt:
    """``Prepared.prompt`` of this backend: the ``(1, n)`` token ids, and the grammar
    filters compiled on the prepare thread, one per choice (taken by ``start``)."""

    ids: Any
    filters: list[Any] = dataclasses.field(default_factory=list)
    reasoning: Plan | None = None  # with a reasoning parser: the request's plan
    embeddings: list[Any] = dataclasses.field(default_factory=list)  # the images' MMEmbeddings, each once


def _token_count(ids: Any) -> int:
    return int(ids.shape[-1]) if ids is not None else 0


def _template_tools(submit: Submit) -> list[Any] | None:
    if submit.tools_json is None:
        return None
    try:
        tools = json.loads(submit.tools_json)
    except ValueError as e:
        raise RequestRejected(ErrorCode.INVALID_REQUEST, f"tools: not JSON: {e}", "tools") from e
    if not isinstance(tools, list):
        raise RequestRejected(ErrorCode.INVALID_REQUEST, "tools: expected an array", "tools")
    return tools


def resolve_max_context(config: WorkerSettings, handle: EngineHandle) -> int:
    """Longest prompt + completion a request may have, in tokens.

    ``max_seq_len`` (default: the model's ``max_position_embeddings``, capped by the
    cache like TabbyAPI does), and never more than the cache can hold for one job:
    ``Job.prepare_for_queue`` keeps one token and the draft window free
    (``job.py:1287-1291``).
    """
    max_seq_len = config.max_seq_len or min(handle.max_position_embeddings, handle.cache_tokens)
    return max(1, min(max_seq_len, handle.cache_tokens - 1 - handle.max_draft_tokens))


class ExLlamaV3Backend:
    """``engine_worker.backend.Backend`` over an ExLlamaV3 ``Generator``.

    ``handle`` comes from ``engine_worker.exllamav3.loader.load_engine`` (or a
    fake in tests); ``config`` supplies the context limit, prompt options and
    the fault limits (``max_engine_faults`` within ``engine_fault_window``).
    ``longest_step_s`` is the longest ``iterate()`` so far, seconds.
    """

    def __init__(self, handle: EngineHandle, config: WorkerSettings) -> None:
        self._h = handle
        self._config = config
        self._max_context = resolve_max_context(config, handle)
        self._breaker_ids: Recent[tuple[str, ...], frozenset[int]] = Recent(
            lambda strings: breaker_ids(handle.pieces, strings)
        )
        vocab = VocabFromTables(
            handle.pieces, lambda t: id_list(handle.encode(t, False)), lambda ids: handle.decode(list(ids))
        )
        self._reasoning = choose(config.reasoning_parser, handle.chat_template, vocab)
        not_stops = self._reasoning.not_stops if self._reasoning is not None else frozenset()
        # Harmony's <|end|> ends a message, not the turn (engine_worker.reasoning.gpt_oss).
        self._eos_ids = tuple(i for i in handle.eos_token_ids if i not in not_stops)
        dropped = {handle.pieces[i] for i in not_stops if 0 <= i < len(handle.pieces)}
        self._stop_strings = tuple(s for s in handle.stop_strings if s not in dropped)
        self._info = ModelInfo(
            handle.model_id,
            self._max_context,
            handle.drafting,
            kv_cache_tokens=handle.cache_tokens,
            max_batch_size=handle.max_batch_size,
            longest_token_chars=max((len(p) for p in handle.pieces), default=0),
            grammar=handle.new_filter is not None,
            logprobs=True,
            banned_strings=True,
            chat_template=handle.chat_template,
            template_tools=True,
            kv_block_tokens=PAGE_SIZE,
            vocab_size=handle.vocab_size,
            max_logit_bias=FLOAT32_MAX,
            logit_bias_ban=True,
            context_settings="settings: max_seq_len, cache_size",
            reasoning_parser=self._reasoning.name if self._reasoning is not None else None,
            xtc=handle.new_xtc_sampler is not None,
            reasoning_budget=config.reasoning_budget,
            thinking_budget=handle.new_answer_filter is not None,
            # The answer filter keeps grammar and stop strings to the answer (grammar.answer_filter_factory),
            # and only the answer's tokens carry logprobs (results.ResultConverter).
            grammar_while_thinking=handle.new_answer_filter is not None,
            logprobs_while_thinking=handle.new_answer_filter is not None,
            vision=handle.vision is not None,
        )
        # The vision forward pass and iterate() take turns on the GPU (vision module docstring).
        self._gpu: AbstractContextManager[None] = nullcontext()
        self._images: ImageEmbeddings | None = None
        if handle.vision is not None:
            turns = GpuTurns()
            self._gpu = turns
            self._images = ImageEmbeddings(handle.vision, turns, config.image_cache_mb << 20)
        self._token_bytes = lp.TokenBytes(handle.ll_tokenizer, handle.pieces)
        self._sizes = sizes = SegmentSizes(
            config.max_rq_tokens if config.output_chunking else None,
            handle.max_draft_tokens,
            handle.rq_boundary,
            handle.cache_tokens,
        )
        self._results = ResultConverter(handle.pieces, handle.decode, self._token_bytes, sizes)
        self._requests: dict[str, JobRecord] = {}
        self._by_serial: dict[int, JobRecord] = {}
        self._held: list[JobRecord] = []  # later choices waiting for their first choice's prefill
        self._faults: deque[float] = deque()
        self._owner: int | None = None
        self._pages: PageTableEvents | None = None
        self.longest_step_s = 0.0

    @property
    def info(self) -> ModelInfo:
        return self._info

    def attach_kv_events(self, sink: BatchSink) -> KvEvents:
        """Publish the page table's complete pages (``kv_pages``), blocks of ``PAGE_SIZE``
        tokens, medium ``GPU``. Salted requests are refused by this backend
        (``ModelInfo.cache_salt`` is off), so no page is a salted one."""
        events = KvEvents(sink, block_size=PAGE_SIZE, medium=MEDIUM_GPU)
        self._pages = PageTableEvents(events)
        return events

    def _sync_pages(self) -> None:
        if self._pages is not None:
            self._pages.sync(self._gen.pagetable)

    def active_ids(self) -> Collection[str]:
        return self._requests.keys()

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError(
                "ExLlamaV3Backend used from two threads: Generator.enqueue/cancel must run on the "
                "thread that calls iterate()"
            )

    # ------------------------------------------------------------------ admission

    def _tokenize(self, submit: Submit, budget: int | None) -> tuple[Any, str, list[Any]]:
        """``(ids, param, embeddings)``: the prompt, what names it, the images' embeddings."""
        if submit.prompt is not None:
            add_bos = self._config.add_bos if submit.add_bos is None else submit.add_bos
            return self._h.encode(submit.prompt, add_bos), "prompt", []
        if not submit.messages:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "messages must not be empty", "messages")
        messages = template_turns(submit, tool_fields=True)
        tools = _template_tools(submit)
        try:
            extra = template_kwargs(submit.template_kwargs_json, self._h.chat_template, budget)
        except ValueError as e:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(e), "chat_template_kwargs") from e
        images = None
        if any(m.images for m in submit.messages):
            assert self._images is not None  # refused by admission.check_images otherwise
            images = self._images.for_turns([m.images for m in submit.messages])
        try:
            ids = self._h.encode_chat(
                messages, submit.add_generation_prompt, tools, submit.forced_prefix, extra or None, images
            )
        except TemplateMangled as e:
            if e.image is None:
                raise
            param = [i.param for m in submit.messages for i in m.images][e.image]
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"could not build the prompt: {e}: '{param}'", param
            ) from e
        return ids, "messages", distinct(e for turn in images or () for _, e in turn)

    def prepare(self, submit: Submit) -> Prepared:
        """Tokenize (chat template for ``messages``, with ``tools_json`` and the turns'
        tool fields) and compile the grammar (one filter per choice). Sampling and the
        context are the loop's to check (``engine_worker.admission``).

        Raises ``RequestRejected`` (``INVALID_REQUEST``) for a chat template that
        refuses the messages, a grammar that does not compile (``param =
        params.grammar_param``).
        """
        # No _check_thread(): this runs on the loop's prepare thread, and only the
        # tokenizer, chat template and grammar compiler are used, never the generator.
        params = submit.params
        param = "prompt" if submit.prompt is not None else "messages"
        budget = thinking_budget(params, self._config.reasoning_budget)
        try:
            input_ids, param, embeddings = self._tokenize(submit, budget)
        except RequestRejected:
            raise
        except Exception as e:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"could not build the prompt: {type(e).__name__}: {e}", param
            ) from e
        plan = None
        if self._reasoning is not None:
            plan = self._reasoning.plan(id_list(input_ids), budget)
            if _token_count(input_ids) != len(plan.prompt_ids):  # the span closed in the prompt
                if self._h.as_ids is None:
                    raise RequestRejected(ErrorCode.INTERNAL, "the engine cannot extend a prompt", param)
                input_ids = self._h.as_ids(plan.prompt_ids)
        n = _token_count(input_ids)
        filters = []
        if params.grammar is not None:
            filters = [self._compile(params) for _ in range(max(1, submit.n))]
        if params.logprobs is not None:
            self._token_bytes.load()
        return Prepared(submit, _Prompt(input_ids, filters, plan, embeddings), n, param)

    def _compile(self, params: SamplingParams) -> Any:
        assert params.grammar is not None
        if self._h.new_filter is None:
            param = params.grammar_param or "response_format"
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "constrained decoding is not available on this engine", param
            )
        return compile_filter(self._h.new_filter, params.grammar, params.grammar_param)

    def _dry_breakers(self, params: SamplingParams) -> frozenset[int] | None:
        """The token ids of the request's DRY breakers (``None``: ExLlamaV3's default);
        the last few sets are kept, as resolving one reads every piece."""
        strings = params.dry_sequence_breakers
        if params.dry_multiplier == 0.0 or strings is None:
            return None
        return self._breaker_ids(strings)

    def prompt_ids(self, prepared: Prepared) -> list[int]:
        prompt: _Prompt = prepared.prompt
        return id_list(prompt.ids)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        check_token_ids(token_ids, self._h.vocab_size)
        return (self._h.decode_plain if skip_special_tokens else self._h.decode)(token_ids)

    def text_prefix_ids(self) -> list[int]:
        # What encode puts before an empty text: BOS where the model's config adds it.
        return id_list(self._h.encode("", self._config.add_bos))

    def reservation(self, prepared: Prepared) -> int:
        """The KV a job takes when it starts, in whole pages (``SegmentSizes.tokens``): what
        the engine itself will allocate, so that a job the loop admits finds its pages
        free. A job that re-queues (output chunking) takes its sequence so far plus a new
        window: its reservation grows then (``kv_reserved``)."""
        return self._sizes.tokens(self._sizes.first(prepared.prompt_tokens, prepared.max_new_tokens))

    def kv_reserved(self) -> int:
        return sum(r.reservation for r in self._requests.values())

    def start(self, request_id: str, prepared: Prepared, params: SamplingParams) -> None:
        """Enqueue one job; a later choice of a ``prepared`` whose first choice is
        still before its first token is held back until then (see the module
        docstring).

        Raises ``RequestRejected``: ``CONTEXT_LENGTH_EXCEEDED`` when the job can never
        fit the cache, ``INVALID_REQUEST`` for a job the engine refuses, ``INTERNAL``
        for anything unexpected.
        """
        self._check_thread()
        prompt: _Prompt = prepared.prompt
        rid, n, input_ids = request_id, prepared.prompt_tokens, prompt.ids
        max_new = prepared.max_new_tokens
        h = self._h
        budget = thinking_budget(params, self._config.reasoning_budget)
        # While the model may think, the client's stop strings are matched in the answer
        # only: by the answer filter (which ends the job) and the converter (which cuts the
        # text), not by the Job, which would match them in the thinking too.
        answer_only = prompt.reasoning is not None and h.new_answer_filter is not None
        settings = job_settings(
            msgspec.structs.replace(params, stop=()) if answer_only and params.stop else params,
            max_new_tokens=max_new,
            eos_token_ids=self._eos_ids,
            stop_strings=self._stop_strings,
            dry_breakers=self._dry_breakers(params),
        )
        segment = self._sizes.first(n, max_new)
        grammar = None
        if params.grammar is not None:
            # One filter per choice, compiled by prepare; more starts than choices (a test
            # driving start directly) compile here.
            grammar = prompt.filters.pop() if prompt.filters else self._compile(params)
        filters = [grammar] if grammar is not None else []
        stops = tuple(s for s in params.stop if s) if answer_only else ()
        if answer_only and (grammar is not None or stops or budget is not None):
            assert h.new_answer_filter is not None and prompt.reasoning is not None
            # The budget's forced end, and the grammar and stop strings on the answer only
            # (grammar.answer_filter_factory); it holds the grammar filter itself.
            grammar = h.new_answer_filter(prompt.reasoning.new_splitter, grammar, stops, params.min_tokens)
            filters = [grammar]

        def new_job() -> Any:
            kwargs = dict(settings.job_kwargs)
            if settings.xtc is None:
                sampler = h.new_sampler(**settings.sampler_kwargs)
            else:
                assert h.new_xtc_sampler is not None  # validate refused XTC otherwise
                sampler = h.new_xtc_sampler(*settings.xtc, **settings.sampler_kwargs)
            if filters:
                kwargs["filters"] = list(filters)
            if prompt.embeddings:
                kwargs["embeddings"] = list(prompt.embeddings)
            return h.new_job(
                input_ids=input_ids,
                sampler=sampler,
                identifier=rid,
                max_rq_tokens=segment.rq,
                **kwargs,
            )

        try:
            job = new_job()
        except AssertionError as e:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, f"rejected by the engine: {e}") from e
        except Exception as e:
            log.exception("exllamav3: creating the job of %s failed", rid)
            raise RequestRejected(ErrorCode.INTERNAL, f"enqueue failed: {type(e).__name__}: {e}") from e
        req = JobRecord(
            rid,
            job,
            -1,
            n,
            self._sizes.tokens(segment),
            new_job,
            prepared,
            segment,
            logprobs=params.logprobs,
            grammar=grammar,
        )
        if prompt.reasoning is not None:
            decode = self._h.decode
            req.split = TextSplitter(prompt.reasoning.new_splitter(), lambda ids: decode(list(ids)))
            req.answer = AnswerText(stops, params.min_tokens)
        # Same prompt and budget as the first choice, which enqueue() accepted: a held
        # choice fits the cache too, so holding it back cannot hide a rejection.
        if req in self._startable([*self._requests.values(), req]):
            self._enqueue(req, prepared.param)
        else:
            self._held.append(req)
        self._requests[rid] = req

    def _enqueue(self, req: JobRecord, param: str | None) -> None:
        try:
            req.serial = int(self._gen.enqueue(req.job))
        except AssertionError as e:
            text = str(e)
            if "pages" in text:
                raise RequestRejected(
                    ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                    f"the request does not fit the KV cache (cache_size): {text}",
                    param,
                ) from e
            raise RequestRejected(ErrorCode.INVALID_REQUEST, f"rejected by the engine: {text}") from e
        except Exception as e:
            log.exception("exllamav3: enqueue of %s failed", req.request_id)
            raise RequestRejected(ErrorCode.INTERNAL, f"enqueue failed: {type(e).__name__}: {e}") from e
        self._by_serial[req.serial] = req

    @property
    def _gen(self) -> GeneratorLike:
        return self._h.generator

    def abort(self, request_id: str) -> None:
        """Cancel the job now (its pages return to the cache); unknown ids are ignored."""
        self._check_thread()
        req = self._requests.get(request_id)
        if req is None:
            return
        self._finish(req)
        if req.serial >= 0:
            self._gen.cancel(req.job)
            self._sync_pages()  # released reservations may give pages their old content back

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Event]:
        """One ``Generator.iterate()`` and the events of its results, in order.
        Raises ``EngineFailed`` when a fault cannot be repaired in this process."""
        self._check_thread()
        if not self._requests:
            return []
        t0 = time.monotonic()
        try:
            with self._gpu:
                results = self._gen.iterate()
        except Exception as e:
            return self._recover(e)
        finally:
            self.longest_step_s = max(self.longest_step_s, time.monotonic() - t0)
        self._sync_pages()
        now = time.monotonic()
        events: list[Event] = []
        self._fail_broken_grammars(events)
        for r in results:
            req = self._by_serial.get(r.get("serial", -1))
            if req is not None and self._results.convert(req, r, t0, now, events):
                self._finish(req)
        self._release_held(events)
        return events

    @staticmethod
    def _startable(requests: Iterable[JobRecord]) -> list[JobRecord]:
        """Of ``requests``, the held ones that may be enqueued now."""
        return startable(
            requests,
            group=lambda r: id(r.prepared),
            waiting=lambda r: r.serial < 0,
            prefilled=lambda r: r.phase is Phase.DECODE,
        )

    def _fail_broken_grammars(self, events: list[Event]) -> None:
        """Fail the requests whose grammar ran into a matcher error in this step, before
        any of their results is converted: the errored matcher allowed only EOS, so the
        step's output of those jobs does not follow the grammar (``grammar`` module)."""
        for req in [r for r in self._requests.values() if failure_of(r.grammar)]:
            param = req.prepared.submit.params.grammar_param
            message = grammar_failure(failure_of(req.grammar) or "")
            log.warning("exllamav3: %s: %s", req.request_id, message)
            self._finish(req)
            if req.serial >= 0:
                self._gen.cancel(req.job)
            events.append(RequestError(req.request_id, ErrorCode.INVALID_REQUEST, message, param))

    def _finish(self, req: JobRecord) -> None:
        self._requests.pop(req.request_id, None)
        self._by_serial.pop(req.serial, None)
        if req in self._held:
            self._held.remove(req)

    def _release_held(self, events: list[Event]) -> None:
        """Enqueue the held choices that may start (``engine_worker.requests.choices``):
        all of a request whose first choice is past its prefill, the next one of a
        request whose first choice ended before that."""
        if not self._held:
            return
        for req in self._startable(self._requests.values()):
            self._held.remove(req)
            try:
                self._enqueue(req, req.prepared.param)
            except RequestRejected as e:
                self._finish(req)
                events.append(RequestError(req.request_id, e.code, e.message, e.param))

    # ------------------------------------------------------------------ faults

    def _recover(self, error: Exception) -> list[Event]:
        """Fail the requests of the faulted step, rebuild the generator, carry the
        queued ones over (module docstring). Raises ``EngineFailed``."""
        what = f"{type(error).__name__}: {error}"
        if len(what) > 500:
            what = what[:500] + "..."
        log.error("exllamav3: engine fault in a step: %s", what, exc_info=error)
        now = time.monotonic()
        self._faults.append(now)
        while self._faults and now - self._faults[0] > self._config.engine_fault_window:
            self._faults.popleft()
        if len(self._faults) >= self._config.max_engine_faults:
            raise EngineFailed(
                f"{len(self._faults)} engine faults within {self._config.engine_fault_window:g} s "
                f"(max_engine_faults), the last: {what}"
            ) from error
        try:
            if self._h.check_device is not None:
                self._h.check_device()
        except Exception as e:
            raise EngineFailed(f"the GPU no longer runs work after {what}: {type(e).__name__}: {e}") from e
        if self._h.rebuild_generator is None:
            raise EngineFailed(f"the generator cannot be rebuilt after {what}") from error
        pending = getattr(self._gen, "pending_jobs", None)
        untouched = {id(j) for j in pending} if pending is not None else set()
        try:
            self._h = dataclasses.replace(self._h, generator=self._h.rebuild_generator())
        except Exception as e:
            raise EngineFailed(
                f"rebuilding the generator after {what} failed: {type(e).__name__}: {e}"
            ) from e
        if self._pages is not None:
            self._pages.reset()  # a new generator, a new, empty page table

        out_of_memory = "out of memory" in str(error).lower()
        code = ErrorCode.OVERLOADED if out_of_memory else ErrorCode.INTERNAL
        message = f"engine fault, the engine was reset and this request dropped: {what}"
        events: list[Event] = []
        for req in list(self._requests.values()):
            if req.serial < 0:
                continue  # held back: no job in the old generator
            self._by_serial.pop(req.serial, None)
            # A re-queued job (output chunking) waits in pending_jobs too, but has streamed.
            if id(req.job) not in untouched or req.phase is not Phase.QUEUED:
                self._finish(req)
                events.append(RequestError(req.request_id, code, message))
                continue
            req.serial = -1
            try:
                req.job = req.new_job()
                self._enqueue(req, req.prepared.param)
            except Exception as e:
                self._finish(req)
                events.append(RequestError(req.request_id, ErrorCode.INTERNAL, f"{message}; re-queue: {e}"))
        log.warning(
            "exllamav3: generator rebuilt after a fault (%d of %d allowed within %g s); %d request(s) failed",
            len(self._faults),
            self._config.max_engine_faults,
            self._config.engine_fault_window,
            len(events),
        )
        self._release_held(events)
        return events

    def close(self) -> None:
        """Cancel what is left and release the generator, model and cache. After an
        ``EngineFailed`` the GPU may refuse this too; that is logged, not raised, so
        the worker still exits with its own status."""
        try:
            for req in list(self._requests.values()):
                if req.serial >= 0:
                    self._gen.cancel(req.job)
            self._h.close()
        except Exception:
            log.exception("exllamav3: releasing the engine failed")
        finally:
            self._requests.clear()
            self._by_serial.clear()
            self._held.clear()
