"""``ExLlamaV3Backend``: drives the synchronous ExLlamaV3 ``Generator`` and turns
its result dicts into ``protocol.messages`` events, at this one place.

The worker loop calls ``add``/``abort``/``step`` on one thread, so ``enqueue``,
``cancel`` and ``iterate`` all run on that thread, as ExLlamaV3 requires; a call
from another thread raises ``RuntimeError`` instead of corrupting the page table.

What 1.6.5's ``Generator.iterate()`` returns and how each piece is converted
(sources are paths under ``exllamav3/generator/`` in the 1.6.5 wheel):

- Several dicts per job per call, in order: ``"started"`` when pages are
  allocated (``generator.py:2214-2222``), at most one ``"prefill"`` per call
  (``job.py:1682-1693``), then one ``"streaming"`` dict per sampled token, so a
  speculative pass yields several (``generator.py:1897-1913``).
- ``Started`` and the first ``PrefillProgress`` (``processed == cached``) are
  emitted on the job's first ``"prefill"`` or ``"streaming"`` dict, not on
  ``"started"``: only its first prefill pass knows the reused prefix. That is
  the job's ``cached_pages`` (whole pages found by hash at allocation,
  ``pagetable.py:650-673``, plus pages a sibling job filled since,
  ``job.py:1430-1436``) and ``cached_tokens`` (the token-level match inside the
  first uncached page, ``job.py:1459-1499``), made in that pass; while other
  jobs decode, a started job's pass can wait several calls for its turn
  (``generator.py:757-787``). ``time_ms`` counts from the ``"started"`` call. A
  job that waits in the engine's queue (batch or cache full) gets its
  ``Started`` when the engine runs it.
- ``"prefill"``: ``curr_progress`` counts prompt tokens in the KV cache, reused
  ones included, up to ``len(prompt) - 1`` (``job.py:1687-1688``); the last
  prompt token is fed by the first decode step. A fully cached, page-aligned
  prompt produces no ``"prefill"`` at all (``job.py:1453``). The closing
  ``PrefillProgress`` with ``processed == total`` is emitted on the job's first
  ``"streaming"`` dict, before its first ``TokenDelta``, in every case.
- ``"requeue": True`` (``job.py:879``) re-queues a long completion with its text
  so far as the prompt (``job.py:1194-1261``): the same job object and serial
  then emit ``"started"``/``"prefill"`` again. Those, and any after the first
  token, are not progress of the client's prompt and are dropped.
- ``"text"`` is absent while output is held back (partial stop string,
  incomplete UTF-8). Tokens of empty-text dicts are credited to the next
  ``TokenDelta``; no ``TokenDelta`` has empty text.
- On ``eos_reason == "stop_token"`` the held-back text is not flushed into
  ``"text"`` but left in ``"held"`` together with the stop token's own piece
  (``job.py:978-993``, ``job.py:948-962``). It is flushed here, without that piece.
- ``"stage": "error"`` dicts carry ``job``/``serial``/``error`` and no
  ``identifier`` (``generator.py:2156-2162``): they are matched by serial, and
  only that request fails.
- EOS counters (``job.py:926-946``): ``cached_tokens`` (coerced to ``int``),
  ``new_tokens``, ``time_enqueued``/``time_prefill``/``time_generate`` (seconds),
  and ``accepted_draft_tokens``/``rejected_draft_tokens`` only when the generator
  drafts; absent keys stay ``None`` and nothing divides by them.
- ``eos_reason`` ``"max_new_tokens"`` -> ``finish_reason`` ``length`` (also when
  the context ended it: ``max_new_tokens`` is clamped to the room left);
  ``stop_token``/``stop_string``/``end_filter``/``loop_detected`` -> ``stop``.
- ``enqueue`` raises ``AssertionError("Job requires N pages (only M available)
  ...")`` when a job can never fit (``job.py:1342``): a 400
  ``context_length_exceeded``, never a crash. The context limit is checked
  before that too, so the error names the setting.

Faults. 1.6.5 contains failures of allocation and prefill to their job
(``"error"`` dicts, ``generator.py:2135-2162``); anything else raises out of
``iterate()``: a CUDA out-of-memory in a batched forward, ``NonFiniteLogits``
on a job's first sample (``job.py:21``, ``742-750``), a CUDA error. The batch's
state is then unknown and the results of that call are lost, so:

- every job the generator had started (``Generator.active_jobs``) fails with a
  ``RequestError``; jobs still in its queue (``pending_jobs``, untouched by any
  forward pass) are enqueued again, as new jobs, into
- a new ``Generator`` over the same model and cache (``EngineHandle.rebuild_generator``;
  ``Generator.close`` keeps model and cache for a replacement,
  ``generator.py:839-871``, and the new one takes the cache over with a fresh page
  table, ``generator.py:242-245``), after ``check_device`` showed the GPU still
  runs work;
- a GPU that no longer runs work (a sticky CUDA error poisons the process) or
  ``max_engine_faults`` faults within ``engine_fault_window`` seconds raise
  ``EngineFailed``: the worker exits and is restarted (``engine_worker/loop.py``).

Choices of one request (``n > 1``, one ``Prepared`` started several times) share
their prompt. Started together, each would find pages the others fill only
during prefill (``job.py:1424-1436``), so its ``Started``/first progress would
under-report the reused prefix that its usage reports at the end. The later
choices are therefore held back until the first has finished its prefill (or
ended), and then find the whole prompt cached.

Reservations and the engine's queue. ``reservation`` is what 1.6.5 itself
allocates when it starts the job (``_segment_tokens``: prompt, completion budget,
draft window, whole pages), and ``max_rq_tokens`` is passed only where it makes
that smaller, so a job the loop admits finds its pages free and starts in the
next ``iterate()``. 1.6.5 keeps a job in ``Generator.pending_jobs`` while it
needs more unreferenced pages than there are or the batch is full, and may
skip it for smaller ones up to ``max_skips`` times (``generator.py:2182-2205``);
admitted by the loop, that happens only when a re-queued segment (output
chunking: the sequence so far plus a new window) needs pages that jobs admitted
since hold. Its reservation grows at the re-queue, so the loop admits nothing
new until it fits again. A job waiting there emits nothing: no
``QueueProgress`` (that is the loop's queue), and no ``Started`` or progress,
which wait for its first prefill pass.

Requests also carry (sources in ``grammar``, ``logprobs``):

- a grammar (``SamplingParams.grammar``): one 1.6.5 ``LLGuidanceFilter`` per
  choice, compiled by ``prepare`` on the prepare thread (a grammar that does not
  compile is a ``RequestRejected`` naming ``grammar_param``), attached to the
  job with ``filters=[...]``; a completed grammar ends the job with
  ``"end_filter"`` (``stop``); a matcher error fails that request alone;
- logprobs (``SamplingParams.logprobs``): ``return_probs``/``return_top_tokens``,
  whose per-token rows arrive with the tokens' ``token_ids`` (or in ``held`` at a
  stop token) and become ``TokenDelta.logprobs``, one entry per token whose text
  the delta carries, joined equal to its text. 1.6.5's probabilities are the
  model's own distribution at temperature 1 (before bias, penalties, grammar
  mask, temperature and truncation), not the sampled-from one the contract
  describes; ``logprobs`` has the details;
- tools: ``Submit.tools_json`` goes to the chat template as ``tools`` and each
  turn's ``tool_calls``/``tool_call_id``/``name`` as template fields
  (``Tokenizer.hf_chat_template`` passes keywords on to
  ``apply_chat_template``, ``tokenizer/tokenizer.py:830-832``, ``870-876``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from engine_worker.backend import EngineFailed, ModelInfo, Prepared, RequestRejected, check_token_ids
from engine_worker.constraints import grammar_failure
from engine_worker.exllamav3 import logprobs as lp
from engine_worker.exllamav3.config import PAGE_SIZE
from engine_worker.exllamav3.engine import EngineHandle, GeneratorLike, id_list
from engine_worker.exllamav3.grammar import compile_filter, failure_of
from engine_worker.exllamav3.kv_pages import PageTableEvents
from engine_worker.exllamav3.sampling import FLOAT32_MAX, breaker_ids, job_settings
from engine_worker.kv_events import MEDIUM_GPU, BatchSink, KvEvents
from engine_worker.reasoning import Plan, VocabFromTables, choose, template_kwargs
from engine_worker.reasoning.text_split import TextSplitter
from engine_worker.settings import WorkerSettings
from protocol.messages import (
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
    TokenLogprob,
)

log = logging.getLogger(__name__)


class _Phase(enum.Enum):
    QUEUED = 1  # enqueued, the engine has not allocated pages yet
    PREFILL = 2  # Started sent, prompt being ingested
    DECODE = 3  # closing progress sent, tokens streaming


@dataclass(frozen=True, slots=True)
class _Prompt:
    """``Prepared.prompt`` of this backend: the ``(1, n)`` token ids, and the grammar
    filters compiled on the prepare thread, one per choice (taken by ``start``)."""

    ids: Any
    filters: list[Any] = dataclasses.field(default_factory=list)
    reasoning: Plan | None = None  # with a reasoning parser: the request's plan


@dataclass(frozen=True, slots=True)
class _Segment:
    """What the engine reserves for a job's current segment (``ExLlamaV3Backend._segment``):
    its prompt (the client's, or the sequence so far after a re-queue), the completion
    tokens it may still produce, the ``max_rq_tokens`` passed (``None``: no re-queue)."""

    prompt: int
    max_new: int
    rq: int | None


@dataclass(slots=True)
class _Request:
    request_id: str
    job: Any
    serial: int  # -1 while held back (not enqueued yet)
    prompt_tokens: int
    reservation: int
    new_job: Callable[[], Any]  # the same job again, for a rebuilt generator
    prepared: Prepared
    segment: _Segment
    logprobs: int | None = None  # alternatives per token when the request asked for logprobs
    grammar: Any = None  # the job's grammar filter
    phase: _Phase = _Phase.QUEUED
    cached: int = 0
    processed: int = 0
    started_at: float = 0.0  # monotonic seconds, start of the iterate() that started the job
    uncredited_tokens: int = 0  # tokens of empty-text dicts, credited to the next TokenDelta
    split: TextSplitter | None = None  # thinking vs answer, with a reasoning parser
    uncredited_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


def _as_int(x: Any) -> int:
    # cached_tokens is an int in 1.6.5; other code paths have produced floats.
    return round(float(x))


def _token_count(ids: Any) -> int:
    return int(ids.shape[-1]) if ids is not None else 0


def _pages(tokens: int) -> int:
    """``tokens`` rounded up to whole pages, in tokens."""
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def _template_messages(submit: Submit) -> list[dict[str, Any]]:
    """``Submit.messages`` as the chat template reads them: ``tool_calls`` decoded to
    objects, ``tool_call_id`` and ``name`` where a turn has them."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(submit.messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls_json is not None:
            try:
                msg["tool_calls"] = json.loads(m.tool_calls_json)
            except ValueError as e:
                raise RequestRejected(
                    ErrorCode.INVALID_REQUEST, f"messages[{i}].tool_calls: not JSON: {e}", "messages"
                ) from e
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        if m.reasoning is not None:
            # The names templates read a turn's thinking by (Qwen3/DeepSeek; GPT-OSS).
            msg["reasoning_content"] = msg["thinking"] = m.reasoning
        out.append(msg)
    return out


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
        self._breaker_ids: dict[tuple[str, ...], frozenset[int]] = {}
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
        )
        self._token_bytes = lp.TokenBytes(handle.ll_tokenizer, handle.pieces)
        self._requests: dict[str, _Request] = {}
        self._by_serial: dict[int, _Request] = {}
        self._held: list[_Request] = []  # later choices waiting for their first choice's prefill
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

    def _tokenize(self, submit: Submit, budget: int | None) -> tuple[Any, str]:
        if submit.prompt is not None:
            add_bos = self._config.add_bos if submit.add_bos is None else submit.add_bos
            return self._h.encode(submit.prompt, add_bos), "prompt"
        if not submit.messages:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "messages must not be empty", "messages")
        messages = _template_messages(submit)
        tools = _template_tools(submit)
        try:
            extra = template_kwargs(submit.template_kwargs_json, self._h.chat_template, budget)
        except ValueError as e:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(e), "chat_template_kwargs") from e
        ids = self._h.encode_chat(
            messages, submit.add_generation_prompt, tools, submit.forced_prefix, extra or None
        )
        return ids, "messages"

    def prepare(self, submit: Submit) -> Prepared:
        """Tokenize (chat template for ``messages``, with ``tools_json`` and the turns'
        tool fields) and compile the grammar (one filter per choice). Sampling and the
        context are the loop's to check (``engine_worker.admission``).

        Raises ``RequestRejected`` (``INVALID_REQUEST``) for a chat template that
        refuses the messages, a grammar that does not compile (``param =
        params.grammar_param``) or XTC on a handle without ``new_xtc_sampler``.
        """
        # No _check_thread(): this runs on the loop's prepare thread, and only the
        # tokenizer, chat template and grammar compiler are used, never the generator.
        params = submit.params
        if params.xtc_probability > 0.0 and self._h.new_xtc_sampler is None:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "XTC is not available on this engine", "xtc_probability"
            )
        param = "prompt" if submit.prompt is not None else "messages"
        budget = (
            params.reasoning_budget if params.reasoning_budget is not None else self._config.reasoning_budget
        )
        try:
            input_ids, param = self._tokenize(submit, budget)
        except RequestRejected:
            raise
        except Exception as e:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"could not build the prompt: {type(e).__name__}: {e}", param
            ) from e
        plan = None
        if self._reasoning is not None:
            plan = self._reasoning.plan(id_list(input_ids), budget)
            self._check_reasoning(params, budget)
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
        return Prepared(submit, _Prompt(input_ids, filters, plan), n, param)

    def _check_reasoning(self, params: SamplingParams, budget: int | None) -> None:
        """Refuse what this backend does not do yet for a model that may think: the
        engine's grammar filter and logprobs would cover the thinking too (the CPU
        engine keeps both to the answer), and a budget above 0 needs the handle's
        ``new_budget_filter``. ``budget == 0`` (no thinking) leaves only the answer:
        allowed."""
        if budget == 0:
            return
        if params.grammar is not None:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                "constrained output with a model that thinks is not available on the exllamav3 engine "
                "yet; switch thinking off (reasoning_effort 'none', thinking_budget_tokens 0)",
                params.grammar_param,
            )
        if params.logprobs is not None:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                "logprobs with a model that thinks are not available on the exllamav3 engine yet; "
                "switch thinking off (reasoning_effort 'none', thinking_budget_tokens 0)",
                "logprobs",
            )
        if budget is not None and self._h.new_budget_filter is None:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST,
                "a thinking budget other than 0 is not available on this engine",
                "thinking_budget_tokens",
            )

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
        ids = self._breaker_ids.get(strings)
        if ids is None:
            ids = breaker_ids(self._h.pieces, strings)
            if len(self._breaker_ids) >= 8:
                self._breaker_ids.pop(next(iter(self._breaker_ids)))
            self._breaker_ids[strings] = ids
        return ids

    def _segment(self, prompt_tokens: int, max_new: int) -> _Segment:
        """The first segment of a job: ``max_rq_tokens`` (output chunking) only where it
        makes the engine reserve less than the whole completion does."""
        rq = self._config.max_rq_tokens if self._config.output_chunking else None
        if rq is not None and self._segment_tokens(_Segment(prompt_tokens, max_new, rq)) >= (
            self._segment_tokens(_Segment(prompt_tokens, max_new, None))
        ):
            rq = None
        return _Segment(prompt_tokens, max_new, rq)

    def _segment_tokens(self, seg: _Segment) -> int:
        """The pages, in tokens, 1.6.5 allocates for a job segment when it starts
        (``Job.prepare_for_queue``, ``job.py:1288-1324``; ``Sequence.prepare``,
        ``pagetable.py:240-248``): the prompt plus, with ``max_rq_tokens``, its budget
        (``_budget``), else the whole completion plus one token; plus the draft window
        either way. Prompt pages that other running jobs
        hold count too (1.6.5 shares them), so this is an upper bound."""
        draft = self._h.max_draft_tokens
        window = seg.max_new + 1 if seg.rq is None else self._budget(seg)
        return _pages(seg.prompt + window + draft)

    def _budget(self, seg: _Segment) -> int:
        """Completion tokens of a segment with ``max_rq_tokens`` before it re-queues: up to
        the next boundary (a page, or the recurrent checkpoint interval) past
        ``prompt - 1 + max_rq_tokens``, at most the cache minus the draft window
        (``job.py:1295-1306``)."""
        assert seg.rq is not None
        step, cache = self._h.rq_boundary, self._h.cache_tokens
        end = min(-(-(seg.prompt - 1 + seg.rq) // step) * step, cache - self._h.max_draft_tokens)
        return max(1, end - seg.prompt)

    def _requeued(self, seg: _Segment) -> _Segment:
        """The segment after a re-queue: 1.6.5 re-queues a job once it has sampled one
        token past its segment's budget (``job.py:815``), with everything so far as the
        new prompt and the same ``max_rq_tokens`` (``job.py:1240-1261``). A job without
        ``max_rq_tokens`` never re-queues (its budget is its whole completion plus the draft
        window, ``job.py:1318-1322``)."""
        if seg.rq is None:
            return seg
        budget = self._budget(seg)
        return _Segment(seg.prompt + budget + 1, max(1, seg.max_new - budget - 1), seg.rq)

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
        """The KV a job takes when it starts, in whole pages (``_segment_tokens``): what
        the engine itself will allocate, so that a job the loop admits finds its pages
        free. A job that re-queues (output chunking) takes its sequence so far plus a new
        window: its reservation grows then (``kv_reserved``)."""
        return self._segment_tokens(self._segment(prepared.prompt_tokens, prepared.max_new_tokens))

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
        settings = job_settings(
            params,
            max_new_tokens=max_new,
            eos_token_ids=self._eos_ids,
            stop_strings=self._stop_strings,
            dry_breakers=self._dry_breakers(params),
        )
        segment = self._segment(n, max_new)
        grammar = None
        if params.grammar is not None:
            # One filter per choice, compiled by prepare; more starts than choices (a test
            # driving start directly) compile here.
            grammar = prompt.filters.pop() if prompt.filters else self._compile(params)
        h = self._h
        filters = [grammar] if grammar is not None else []
        budget = params.reasoning_budget
        if budget is None:
            budget = self._config.reasoning_budget
        if prompt.reasoning is not None and budget and h.new_budget_filter is not None:
            # Ends the thinking once the budget is spent (grammar.budget_filter_factory).
            filters.append(h.new_budget_filter(prompt.reasoning.new_splitter))

        def new_job() -> Any:
            kwargs = dict(settings.job_kwargs)
            if grammar is not None:
                kwargs["filters"] = [grammar]
            if settings.xtc is None:
                sampler = h.new_sampler(**settings.sampler_kwargs)
            else:
                assert h.new_xtc_sampler is not None  # validate refused XTC otherwise
                sampler = h.new_xtc_sampler(*settings.xtc, **settings.sampler_kwargs)
            if filters:
                kwargs["filters"] = list(filters)
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
        req = _Request(
            rid,
            job,
            -1,
            n,
            self._segment_tokens(segment),
            new_job,
            prepared,
            segment,
            logprobs=params.logprobs,
            grammar=grammar,
        )
        if prompt.reasoning is not None:
            decode = self._h.decode
            req.split = TextSplitter(prompt.reasoning.new_splitter(), lambda ids: decode(list(ids)))
        # Same prompt and budget as the first choice, which enqueue() accepted: a held
        # choice fits the cache too, so holding it back cannot hide a rejection.
        if any(r.prepared is prepared and r.phase is not _Phase.DECODE for r in self._requests.values()):
            self._held.append(req)
        else:
            self._enqueue(req, prepared.param)
        self._requests[rid] = req

    def _enqueue(self, req: _Request, param: str | None) -> None:
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
            if req is not None:
                self._convert(req, r, t0, now, events)
        self._release_held(events)
        return events

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

    def _finish(self, req: _Request) -> None:
        self._requests.pop(req.request_id, None)
        self._by_serial.pop(req.serial, None)
        if req in self._held:
            self._held.remove(req)

    def _release_held(self, events: list[Event]) -> None:
        """Enqueue held choices whose first choice is past its prefill or gone."""
        if not self._held:
            return
        leaders = {
            id(r.prepared) for r in self._requests.values() if r.serial >= 0 and r.phase is not _Phase.DECODE
        }
        for req in [r for r in self._held if id(r.prepared) not in leaders]:
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
            if id(req.job) not in untouched or req.phase is not _Phase.QUEUED:
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

    def _begin(self, req: _Request, now: float, events: list[Event]) -> None:
        pages = _as_int(getattr(req.job, "cached_pages", 0))
        cached = pages * PAGE_SIZE + _as_int(getattr(req.job, "cached_tokens", 0))
        cached = max(0, min(cached, req.prompt_tokens - 1))
        req.phase = _Phase.PREFILL
        req.cached = req.processed = cached
        rid, total = req.request_id, req.prompt_tokens
        events.append(Started(rid, total, cached))
        events.append(PrefillProgress(rid, total, cached, cached, int((now - req.started_at) * 1000)))

    def _progress(self, req: _Request, processed: int, now: float, events: list[Event]) -> None:
        if processed <= req.processed:
            return
        req.processed = processed
        ms = int((now - req.started_at) * 1000)
        events.append(PrefillProgress(req.request_id, req.prompt_tokens, req.cached, processed, ms))

    def _convert(self, req: _Request, r: dict[str, Any], t0: float, now: float, events: list[Event]) -> None:
        stage = r.get("stage")
        if stage == "error":
            err = r.get("error")
            log.error("exllamav3: job of %s failed: %r", req.request_id, err)
            events.append(
                RequestError(req.request_id, ErrorCode.INTERNAL, f"engine error: {type(err).__name__}: {err}")
            )
            self._finish(req)
            return
        if req.phase is _Phase.QUEUED:
            if stage == "started" or not req.started_at:
                req.started_at = t0
            if stage == "started":
                return
            self._begin(req, now, events)
        if stage == "prefill":
            if req.phase is _Phase.PREFILL:
                done = min(int(r.get("curr_progress", 0)), req.prompt_tokens - 1)
                self._progress(req, done, now, events)
            return
        if stage != "streaming":
            return
        if req.phase is _Phase.PREFILL:
            self._progress(req, req.prompt_tokens, now, events)
            req.phase = _Phase.DECODE

        if r.get("requeue"):
            # The job re-queues with its sequence so far as the prompt (job.py:879, 1194-1261):
            # it will hold more pages than it was admitted with.
            req.segment = self._requeued(req.segment)
            req.reservation = self._segment_tokens(req.segment)
        text = r.get("text") or ""
        ids = id_list(r.get("token_ids"))
        tokens = len(ids)
        eos = bool(r.get("eos"))
        entries = self._logprobs(req, ids, text, r)
        if eos and r.get("eos_reason") == "stop_token":
            held_text, held_ids, held = self._held_before_stop_token(r)
            held_entries = self._logprobs(req, held_ids, held_text, held)
            text += held_text
            tokens += len(held_ids)
            if entries is not None and held_entries is not None:
                entries += held_entries
        if req.split is not None:
            held_ids = (
                self._held_before_stop_token(r)[1] if eos and r.get("eos_reason") == "stop_token" else []
            )
            for channel, part, count in req.split.feed([*ids, *held_ids], text, final=eos):
                if part:
                    events.append(TokenDelta(req.request_id, part, count, channel=channel))
        elif text:
            tokens += req.uncredited_tokens
            req.uncredited_tokens = 0
            if entries is not None:
                entries = req.uncredited_logprobs + entries
                req.uncredited_logprobs = []
            out = tuple(entries) if entries is not None else None
            last = events[-1] if events else None
            if isinstance(last, TokenDelta) and last.request_id == req.request_id:
                # One speculative pass streams a dict per accepted token: send them as one delta.
                merged = None if out is None else (*(last.logprobs or ()), *out)
                events[-1] = TokenDelta(req.request_id, last.text + text, last.num_tokens + tokens, merged)
            else:
                events.append(TokenDelta(req.request_id, text, tokens, out))
        else:
            req.uncredited_tokens += tokens
            if entries is not None:
                req.uncredited_logprobs += entries
        if eos:
            events.append(self._finished(req, r))
            self._finish(req)

    def _logprobs(
        self, req: _Request, ids: list[int], text: str, source: dict[str, Any]
    ) -> list[TokenLogprob] | None:
        """The entries of ``ids``, whose result released ``text`` (``logprobs`` module);
        ``None`` when the request did not ask for logprobs."""
        if req.logprobs is None:
            return None
        shares = lp.split_text(ids, text, self._h.pieces, self._h.decode)
        return lp.entries(
            ids, shares, source, top=req.logprobs, pieces=self._h.pieces, token_bytes=self._token_bytes
        )

    def _held_before_stop_token(self, r: dict[str, Any]) -> tuple[str, list[int], dict[str, Any]]:
        """The text ``Job`` was holding back when a stop token ended it, minus the stop
        token's own piece, the tokens it came from (the stop token left out), and the
        ``held`` dict (whose probabilities start with those tokens')."""
        held = r.get("held") or {}
        text: str = held.get("text") or ""
        ids = id_list(held.get("token_ids"))
        stop_id = r.get("eos_triggering_token_id")
        if ids and ids[-1] == stop_id:
            ids = ids[:-1]
        if not text:
            return "", [], held
        if isinstance(stop_id, int) and 0 <= stop_id < len(self._h.pieces):
            piece = self._h.pieces[stop_id]
            if piece and text.endswith(piece):
                text = text[: -len(piece)]
        if "\ufffd" in text and ids:
            # Held because a character was still incomplete: decoding the tokens together
            # repairs characters split across them, as Job does at other EOS reasons
            # (job.py:887-893).
            text = self._h.decode(ids)
        return text, ids, held

    def _finished(self, req: _Request, r: dict[str, Any]) -> Finished:
        reason = FinishReason.LENGTH if r.get("eos_reason") == "max_new_tokens" else FinishReason.STOP
        cached = max(0, min(_as_int(r.get("cached_tokens", req.cached)), req.prompt_tokens))
        accepted = r.get("accepted_draft_tokens")
        rejected = r.get("rejected_draft_tokens")
        drafted = accepted is not None or rejected is not None
        fin = Finished(
            request_id=req.request_id,
            finish_reason=reason,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=cached,
            completion_tokens=int(r.get("new_tokens", 0)),
            draft_accepted=int(accepted or 0) if drafted else None,
            draft_rejected=int(rejected or 0) if drafted else None,
            time_queued=float(r.get("time_enqueued", 0.0)),
            time_prefill=float(r.get("time_prefill", 0.0)),
            time_decode=float(r.get("time_generate", 0.0)),
            reasoning_tokens=req.split.splitter.reasoning_tokens if req.split is not None else 0,
        )
        if log.isEnabledFor(logging.DEBUG):
            acc = fin.draft_accepted or 0
            verified = acc + (fin.draft_rejected or 0)
            rate = f"{acc / verified:.0%}" if verified else "n/a"  # 0/0: nothing was drafted
            log.debug(
                "exllamav3: %s done (%s): %d prompt (%d cached), %d completion, draft acceptance %s",
                req.request_id,
                r.get("eos_reason"),
                fin.prompt_tokens,
                fin.cached_tokens,
                fin.completion_tokens,
                rate,
            )
        return fin

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
