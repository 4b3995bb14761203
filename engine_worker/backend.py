"""The interface every engine backend implements (CPU engine, ExLlamaV3, synthetic).

The worker loop (``engine_worker.loop``) owns the sockets, the request queue and
admission, and calls a backend from one thread: ``start``/``abort`` between
``step`` calls, never concurrently — except ``prepare``, which runs on the loop's
prepare thread, concurrently with ``step``, and so must not touch engine state. A backend converts its
engine's native results into ``protocol.messages`` events at one place and never
forwards native dicts.

A request (``Submit`` with ``n`` choices) is validated by the loop when it
arrives (``admission.validate_request``: sampling, limits, by the backend's
``ModelInfo``), prepared once by the backend — templated, tokenized — then checked
against the context and given its completion budget by the loop
(``admission.budget``), and started once per choice when the loop admits it, so
the prompt of an ``n``-choice request is tokenized once. Backends do not repeat
those checks.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.messages import ErrorCode, Event, SamplingParams, Submit


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the worker announces in ``Ready`` and admits by.

    - ``max_context_tokens``: longest prompt + completion the backend accepts, tokens.
    - ``kv_cache_tokens``: KV capacity shared by running sequences, tokens; the loop
      admits a sequence only while its reservation (``admission.reservation``) fits.
    - ``max_batch_size``: most sequences running at once.
    - ``longest_token_chars``: characters of the longest text one token decodes to
      (an upper bound; 0 if unknown).
    - ``grammar``, ``logprobs``: whether the backend honours
      ``SamplingParams.grammar`` and ``SamplingParams.logprobs``; the loop
      refuses requests that ask for what it does not (never silently ignored).
      Which distribution logprobs come from is the backend's to document: the
      CPU engine's sampled-from one; ExLlamaV3 1.6.5's raw model distribution at
      temperature 1 (``engine_worker/exllamav3/logprobs.py``).
    - ``chat_template``: the model's chat template source, sent in ``Ready`` (the
      proxy reads the model's tool-call format from it); ``None`` if unknown.
    - ``template_tools``: the backend passes ``Submit.tools_json`` and the tool
      fields of ``ChatMessage`` to its chat template (else such requests are refused).
    - ``cache_salt``: the backend keeps prefix-cache entries of different
      ``Submit.cache_salt`` apart (a salted request is refused otherwise).
    - ``kv_block_tokens``: tokens per block of KV the prefix cache reuses whole
      (``Ready.kv_block_tokens``); 0 when the backend has no such unit.
    - ``vocab_size``: token ids ``0 .. vocab_size - 1`` are valid in
      ``stop_token_ids`` and ``logit_bias`` (0: the backend has no vocabulary).
    - ``max_logit_bias``, ``logit_bias_ban``: a bias must be within
      ``±max_logit_bias``, or ``-inf`` (a ban) where ``logit_bias_ban``.
    - ``context_settings``: what sets ``max_context_tokens``, named in the error of
      a prompt that does not fit.
    - ``banned_strings``: the backend honours ``SamplingParams.banned_strings``
      (``engine_worker.admission`` refuses them otherwise).
    - ``reasoning_parser``: the family whose thinking the backend splits from the
      answer (``engine_worker.reasoning``), ``Ready.reasoning_parser``.
    - ``kernels``: the CPU engine's kernel per product (``Ready.kernels``); empty
      for engines that choose none.
    - ``xtc``: the backend honours ``SamplingParams.xtc_probability``.
    - ``reasoning_budget``: the worker's ``--reasoning-budget`` (thinking tokens a
      request may spend when it sets none; ``None``: no limit), by which
      ``admission`` tells whether a request's model may think.
    - ``thinking_budget``: the backend ends thinking at a budget above 0.
    - ``grammar_while_thinking``, ``logprobs_while_thinking``: the backend keeps a
      grammar and logprobs to the answer of a model that may think (else such a
      request is refused: they would cover the thinking too).
    - ``banned_strings_alone``: banned strings only without a grammar and logprobs
      (both would have to rewind with the text).
    - ``vision``: the backend reads ``ChatMessage.images`` (``Ready.modalities`` says
      ``image``); ``admission`` refuses a request with images otherwise, naming the part.
    """

    model_id: str
    max_context_tokens: int
    drafting: str | None
    kv_cache_tokens: int = 1 << 62
    max_batch_size: int = 1 << 30
    longest_token_chars: int = 0
    grammar: bool = False
    logprobs: bool = False
    chat_template: str | None = None
    template_tools: bool = False
    kv_block_tokens: int = 0
    cache_salt: bool = False
    vocab_size: int = 0
    max_logit_bias: float = 100.0
    logit_bias_ban: bool = False
    context_settings: str = "setting: max_seq_len"
    banned_strings: bool = False
    reasoning_parser: str | None = None
    kernels: tuple[tuple[str, str], ...] = ()
    xtc: bool = True
    reasoning_budget: int | None = None
    thinking_budget: bool = True
    grammar_while_thinking: bool = True
    logprobs_while_thinking: bool = True
    banned_strings_alone: bool = False
    vision: bool = False


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready to start: ``prompt`` is the backend's own token sequence
    (opaque to the loop), ``prompt_tokens`` its length, ``param`` the request field
    it came from (``messages`` or ``prompt``). ``max_new_tokens``: the completion
    budget, ``max_tokens`` clamped to the context; set by ``admission.budget``
    (0 until then), read by ``reservation`` and ``start``."""

    submit: Submit
    prompt: Any
    prompt_tokens: int
    param: str
    max_new_tokens: int = 0


class RequestRejected(Exception):
    """Raised by ``Backend.prepare``/``start`` when a request cannot be served
    (prompt too long for the context, invalid parameters). The loop turns it into
    ``RequestError`` events; nothing else is affected."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Raise ``RequestRejected`` (param ``tokens``) for an id outside ``0..vocab_size - 1``."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST,
            f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
            "tokens",
        )


ENGINE_FAILED_EXIT_STATUS = 3
"""Exit status of a worker whose engine failed (``EngineFailed``): not 1 (cannot load) or 2 (usage)."""


class EngineFailed(Exception):
    """Raised by ``Backend.step`` when the engine cannot serve any more (faults keep
    coming, the GPU is in a state the process cannot recover from). The loop fails
    every request it holds and the worker exits with ``ENGINE_FAILED_EXIT_STATUS``:
    its heartbeats stop, so the proxy turns not ready, and its supervisor (``serve``,
    Kubernetes) starts a fresh process."""


class Backend(Protocol):
    """An engine that advances many sequences in steps.

    Event order per sequence is documented in ``protocol.messages``. A backend
    must emit ``Started`` and the first ``PrefillProgress`` (``processed ==
    cached``) no later than the first ``step`` after ``start`` (a later choice of a
    request may wait for its first choice's prefill, whose prompt it then reuses:
    ``n > 1`` shares one prefill on both engines), a last
    ``PrefillProgress`` with ``processed == total`` before the first
    ``TokenDelta``, and exactly one terminal event (``Finished`` or
    ``RequestError``) for every sequence it started and did not abort.
    """

    @property
    def info(self) -> ModelInfo: ...

    def prepare(self, submit: Submit) -> Prepared:
        """Template and tokenize ``submit`` once (its sampling already validated);
        called on another thread than the rest, concurrently with ``step`` (touch no
        engine state). Raises ``RequestRejected``."""
        ...

    def prompt_ids(self, prepared: Prepared) -> list[int]:
        """The token ids of ``prepared``'s prompt (``POST /tokenize``, Anthropic's
        ``count_tokens``); called on the prepare thread."""
        ...

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``, special tokens included unless
        ``skip_special_tokens``; called on the prepare thread. Raises
        ``RequestRejected`` for an id outside the vocabulary."""
        ...

    def text_prefix_ids(self) -> list[int]:
        """The ids the tokenizer puts before plain text with its special tokens on
        (``[BOS]`` or none): ``Tokenize.add_special_tokens``; called on the prepare
        thread."""
        ...

    def reservation(self, prepared: Prepared) -> int:
        """KV tokens one sequence of ``prepared`` (after ``admission.budget``) may come
        to hold, which the loop reserves for it out of ``info.kv_cache_tokens`` while
        it runs."""
        ...

    def kv_reserved(self) -> int:
        """The sum of the reservations of the active sequences, KV tokens."""
        ...

    def start(self, request_id: str, prepared: Prepared, params: SamplingParams) -> None:
        """Start one sequence (a choice) of ``prepared`` (after ``admission.budget``)
        under ``request_id``, whose id is not active (the loop checks that), sampling
        with ``params`` (validated; the choice's seed) for at most
        ``prepared.max_new_tokens`` tokens. Raises ``RequestRejected``; work happens
        in ``step``."""
        ...

    def abort(self, request_id: str) -> None:
        """Drop a sequence and free its engine memory now; unknown ids are ignored.
        The id leaves ``active_ids`` even when freeing fails. No further events are
        emitted for it."""
        ...

    def active_ids(self) -> Collection[str]:
        """Ids started and not yet finished, failed or aborted: the one record of
        them in the worker (the loop reads it for duplicate ids, heartbeats,
        admission and failing a broken step's sequences)."""
        ...

    def step(self) -> list[Event]:
        """Advance every active sequence by at most one engine step (one prefill
        chunk, or one decode/verify pass) and return the events produced, in
        order. Returns ``[]`` quickly when idle. Raises ``EngineFailed`` when the
        engine is beyond repair; any other exception fails every active sequence."""
        ...

    def close(self) -> None:
        """Release the model and its memory."""
        ...
