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

from collections.abc import Callable
from typing import Any

from engine_worker.backend import RequestRejected
from engine_worker.constraints import invalid_grammar, llguidance_reason
from protocol.messages import ErrorCode


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


def budget_filter_factory(
    base: type, tokenizer: Any, vocab_size: int, new_words: Callable[[int], Any]
) -> Callable[[Callable[[], Any]], Any]:
    """``new_splitter -> filter``: a 1.6.5 ``Filter`` (subclass of ``base``) that ends a
    reasoning model's thinking once its budget is spent (``engine_worker.reasoning``).

    It runs its own ``Splitter`` (``new_splitter()``, fresh on every ``reset``, which
    ``Job.activate`` calls, ``job.py:1764-1773``) over every sampled token, fed to it by
    ``Filter.feed`` (``job.py:807-811``), and its mask (bit set = allowed, as
    ``LLGuidanceFilter``'s, ``llguidance.py:146-153``) allows every token until the
    splitter names a ``forced`` one, then only that one. It never completes, so it never
    ends the job. ``new_words(n)``: a ``(1, n)`` int32 array of zeros, the type the
    engine's masks are (a CPU torch tensor in 1.6.5)."""
    words = (vocab_size + 31) // 32

    class ReasoningBudgetFilter(base):  # type: ignore[misc]
        def __init__(self, new_splitter: Callable[[], Any]) -> None:
            super().__init__(tokenizer, None, None, False)
            self._new_splitter = new_splitter
            self._splitter = new_splitter()

        def reset(self) -> None:
            self._splitter = self._new_splitter()

        def accept_token(self, token: int) -> None:
            self._splitter.feed(token)

        def is_completed(self) -> bool:
            return False

        def use_background_worker(self) -> bool:
            return False  # a mask of one word set: cheaper inline than on the pool

        def get_next_logit_mask(self) -> Any:
            mask = new_words(words)
            forced = self._splitter.forced()
            if forced is None:
                mask[0, :] = -1  # every bit: anything goes
            else:
                bit = 1 << (forced % 32)
                mask[0, forced // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
            return mask

    ReasoningBudgetFilter.__qualname__ = f"ReasoningBudget{base.__name__}"
    return ReasoningBudgetFilter
