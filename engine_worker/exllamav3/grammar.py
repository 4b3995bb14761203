"""Constrained decoding with ExLlamaV3 1.6.5's own ``LLGuidanceFilter``.

``SamplingParams.grammar`` is an llguidance grammar (Lark text, or the JSON of
``LLMatcher.grammar_from_json_schema``). 1.6.5's filter takes it as
``llg_grammar``, which ``grammar_from("llguidance", text)`` passes through
unchanged to an ``LLMatcher`` that reads either form
(``generator/filter/llguidance.py:77-97``). Its constructor compiles and
validates the grammar against the model's llguidance tokenizer
(``create_ll_tokenizer``, built from ``tokenizer.json`` with the EOS ids of
``config.eos_token_id_list``, ``llguidance.py:17-29``) and raises
``ValueError("Invalid grammar: ...")`` (``92-95``): ``compile_filter`` turns
that into a ``RequestRejected`` naming the request field, on the prepare thread.

What 1.6.5 does with a filter attached to a ``Job`` (``filters=[...]``; there is
no ``filter_prefer_eos`` in 1.6.5):

- the filter is attached and reset when the job starts (``Job.activate``,
  ``job.py:1764-1773``) and keeps its state over re-queues (``job.py:1250``);
- its packed bitmask (bit set = allowed, ``llguidance.py:146-153``) is applied
  to the logits before the sampler stack (``sampler/custom.py:1247-1258``);
- every sampled token is fed to it (``job.py:807-811``); with
  ``eos_after_completed`` a completed grammar (``LLMatcher.is_stopped``) ends the
  job with ``eos_reason == "end_filter"`` (``job.py:1001-1002``), else the model
  ends it with an EOS token, which the mask allows once the grammar accepts;
- drafting stays on and stays correct: a job with an active filter verifies its
  drafted positions one by one (``generator.py:1866-1874`` keeps it off the
  batched path), each position sampled under the mask of the filter advanced by
  the tokens accepted before it (``generator.py:1958-1983``), and a draft token
  is accepted only when it equals that masked sample: a token the grammar
  forbids is never accepted. The drafters themselves ignore the grammar, so
  acceptance drops where the grammar overrides the model.

A matcher error (an llguidance parser limit reached mid-generation) makes 1.6.5
raise ``RuntimeError`` from ``_check_error`` (``llguidance.py:110-112``) inside
``iterate()``, which would fail every request of the step. The filter class
used here records it instead (``failure``): the errored matcher masks all but
EOS and reports itself stopped, so the job ends at once, and the backend fails
that request alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine_worker.backend import RequestRejected
from engine_worker.constraints import invalid_grammar, llguidance_reason
from engine_worker.reasoning import Splitter
from engine_worker.requests.stops import StopAutomaton, StopMatcher
from protocol.messages import Channel, ErrorCode


def contained_filter_class(base: type) -> type:
    """A subclass of ``base`` (``exllamav3.LLGuidanceFilter``) whose matcher errors
    are kept in ``failure`` (the first error's text) instead of raised."""

    class ContainedLLGuidanceFilter(base):  # type: ignore[misc]
        failure: str | None = None

        def _check_error(self) -> None:
            matcher = self._matcher
            if matcher.is_error() and self.failure is None:
                self.failure = llguidance_reason(str(matcher.get_error()))

    ContainedLLGuidanceFilter.__qualname__ = f"Contained{base.__name__}"
    return ContainedLLGuidanceFilter


def filter_factory(filter_class: type, tokenizer: Any) -> Any:
    """``grammar -> filter`` for one job: ``filter_class(tokenizer, llg_grammar=grammar,
    eos_after_completed=True)`` (a complete grammar ends the job with ``stop``)."""

    def new_filter(grammar: str) -> Any:
        return filter_class(tokenizer, llg_grammar=grammar, eos_after_completed=True)

    return new_filter


def compile_filter(new_filter: Any, grammar: str, param: str | None) -> Any:
    """A filter for ``grammar`` in its start state. Raises ``RequestRejected``
    (``INVALID_REQUEST``, ``param``) when the grammar does not compile."""
    try:
        flt = new_filter(grammar)
    except Exception as e:  # ValueError from the validation, anything llguidance raises on misuse
        raise RequestRejected(ErrorCode.INVALID_REQUEST, invalid_grammar(str(e)), param=param) from e
    failure = getattr(flt, "failure", None)
    if failure:
        raise RequestRejected(ErrorCode.INVALID_REQUEST, invalid_grammar(failure), param=param)
    return flt


def failure_of(flt: Any) -> str | None:
    """The matcher error a filter from ``contained_filter_class`` ran into, if any."""
    return getattr(flt, "failure", None) if flt is not None else None


def answer_filter_factory(
    base: type,
    tokenizer: Any,
    vocab_size: int,
    new_words: Callable[[int], Any],
    pieces: Sequence[str],
    decode: Callable[[list[int]], str],
) -> Callable[..., Any]:
    """``(new_splitter, grammar=None, stops=(), min_tokens=0) -> filter``: the one 1.6.5
    ``Filter`` (subclass of ``base``) a reasoning model's job gets, which keeps the
    request's constraints to the answer, as the CPU engine does (``engine_worker.requests.output``):

    - it runs its own ``Splitter`` (``new_splitter()``, fresh on every ``reset``, which
      ``Job.activate`` calls, ``job.py:1764-1773``) over every sampled token, fed to it by
      ``Filter.feed`` (``filter.py:50-70``, called from ``job.py:807-811``);
    - its mask (bit set = allowed, as ``LLGuidanceFilter``'s, ``llguidance.py:146-153``)
      allows only the ``forced`` token once the thinking budget is spent, never the
      splitter's ``banned`` one, and otherwise everything while the splitter is ``free``;
      after that, ``grammar``'s mask (a filter from ``filter_factory``, never attached to
      the job itself), plus the splitter's ``allow_with_grammar`` token;
    - the answer's tokens, and only those, go to ``grammar`` and, as text (each token's
      piece; a run whose piece text has an incomplete character decoded together, as
      ``Job`` does, ``job.py:1005-1016``), to a ``StopMatcher`` of the client's ``stops``,
      searched once ``min_tokens`` tokens were fed;
    - it completes when the grammar does or a stop string matched; constructed with
      ``eos_after_completed``, so the job then ends with ``eos_reason == "end_filter"``
      (``job.py:1001-1002``) on that very token, its counters intact.

    A banned-string rewind through it replays the journal (``Filter.rewind``,
    ``filter.py:72-107``): it has no ``rollback_tokens``. ``new_words(n)``: a ``(1, n)``
    int32 array of zeros, the type the engine's masks are (a CPU torch tensor in 1.6.5);
    ``pieces`` and ``decode`` as ``EngineHandle``'s."""
    words = (vocab_size + 31) // 32

    def put(mask: Any, token: int, on: bool) -> None:
        i, bit = token // 32, 1 << (token % 32)
        word = int(mask[0, i]) & 0xFFFFFFFF
        word = word | bit if on else word & ~bit
        mask[0, i] = word - (1 << 32) if word >= 1 << 31 else word

    class AnswerFilter(base):  # type: ignore[misc]
        def __init__(
            self,
            new_splitter: Callable[[], Splitter],
            grammar: Any = None,
            stops: Sequence[str] = (),
            min_tokens: int = 0,
        ) -> None:
            super().__init__(tokenizer, None, None, True)
            self._new_splitter = new_splitter
            self._grammar = grammar
            self._stops = StopAutomaton(stops)
            self._min_tokens = min_tokens
            self.reset()

        @property
        def failure(self) -> str | None:
            """The grammar's matcher error (``contained_filter_class``), if any."""
            return failure_of(self._grammar)

        def reset(self) -> None:
            self._splitter = self._new_splitter()
            if self._grammar is not None:
                self._grammar.reset()
            self._matcher = StopMatcher(self._stops)
            self._unshown: list[int] = []  # answer tokens whose text is an incomplete character
            self._fed = 0
            self._done = False
            self._plan()

        def attach(self, job: Any) -> None:
            super().attach(job)
            if self._grammar is not None:
                self._grammar.attach(job)

        def accept_token(self, token: int) -> None:
            self._fed += 1
            for channel, t in self._splitter.feed(token):
                if channel is Channel.CONTENT and not self._done:
                    self._answer(t)
            self._plan()

        def _answer(self, token: int) -> None:
            grammar = self._grammar
            if grammar is not None and not grammar.is_completed():
                grammar.accept_token(token)
                self._done = bool(grammar.is_completed())
            if self._stops:
                self._unshown.append(token)
                text = "".join(pieces[t] if 0 <= t < len(pieces) else "" for t in self._unshown)
                if "\ufffd" in text:
                    text = decode(self._unshown)
                    if text.endswith("\ufffd"):
                        return  # the character completes with a later token
                self._unshown.clear()
                _, stopped = self._matcher.feed(text, check=self._fed >= self._min_tokens)
                self._done = self._done or stopped

        def _plan(self) -> None:
            # The next position's mask, decided here on the engine thread: the mask itself
            # may be computed on the generator's filter pool (generator.py:1703-1712).
            splitter = self._splitter
            self._forced = splitter.forced()
            self._constrained = (
                self._grammar is not None and self._forced is None and not self._done and not splitter.free
            )
            self._also = splitter.allow_with_grammar if self._constrained else None
            self._banned = splitter.banned()

        def is_completed(self) -> bool:
            return self._done

        def use_background_worker(self) -> bool:
            # Only the grammar's mask is worth a pool thread; the others are a fill.
            return self._constrained

        def get_next_logit_mask(self) -> Any:
            if self._forced is not None:
                mask = new_words(words)
                put(mask, self._forced, True)
                return mask
            if self._constrained:
                inner = self._grammar.get_next_logit_mask()
                # A copy in the grammar's own array type: it reuses its buffer.
                mask = inner.clone() if hasattr(inner, "clone") else inner.copy()
                if self._also is not None:
                    put(mask, self._also, True)
            else:
                mask = new_words(words)
                mask[0, :] = -1  # every bit: anything goes
            if self._banned is not None:
                put(mask, self._banned, False)
            return mask

    AnswerFilter.__qualname__ = f"Answer{base.__name__}"
    return AnswerFilter
