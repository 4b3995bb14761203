"""A reasoning model's constraints on ExLlamaV3 hold for the answer only, as on the
CPU engine: the grammar applies once the thinking ends, only the answer's tokens
carry logprobs, and the client's stop strings match in the answer alone
(``grammar.answer_filter_factory`` in the job, ``results.AnswerText`` on the way
out), on the fake 1.6.5 generator. The fake's vocabulary is bytes: ``</think>`` is
eight tokens, matched as an id sequence."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from engine_worker.admission import checked_prepare
from engine_worker.backend import RequestRejected
from engine_worker.exllamav3 import ExLlamaV3Backend
from engine_worker.settings import WorkerSettings
from protocol.messages import Channel, Event, FinishReason, TokenDelta
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import add, chat, check_lifecycle, finished, make_backend, of, run

R1 = WorkerSettings(backend="exllamav3", model_dir=Path("/models/fake-exl3"), reasoning_parser="deepseek_r1")
OK = 'start: "ok"'


def deltas(events: list[Event], rid: str, channel: Channel) -> list[TokenDelta]:
    return [e for e in of(events, rid) if isinstance(e, TokenDelta) and e.channel is channel]


def text(events: list[Event], rid: str, channel: Channel) -> str:
    return "".join(d.text for d in deltas(events, rid, channel))


def test_the_flags_are_on_with_the_answer_filter() -> None:
    backend, _ = make_backend(R1)
    assert backend.info.grammar_while_thinking and backend.info.logprobs_while_thinking


def test_the_grammar_constrains_the_answer_not_the_thinking() -> None:
    # The model thinks "hm, xyz" and then wants to answer "xyz": the grammar allows only "ok".
    backend, rec = make_backend(R1, script=fx.reply("hm, xyz</think>xyz"))
    add(backend, chat("a", "hi", grammar=OK, grammar_param="response_format"))
    events = backend.step()
    (job,) = rec.inner.active_jobs
    (flt,) = job.filters  # one filter, holding the grammar's LLGuidanceFilter
    assert type(flt).__name__ == "AnswerFilter" and isinstance(flt._grammar, fx.LLGuidanceFilter)
    assert job.stop_strings == set()  # no client stops: nothing held back
    events += run(backend)
    check_lifecycle(events, "a")
    assert text(events, "a", Channel.REASONING) == "hm, xyz"
    assert text(events, "a", Channel.CONTENT) == "ok"
    fin = finished(events, "a")
    assert fin.finish_reason is FinishReason.STOP  # the grammar completed: end_filter
    assert [r["eos_reason"] for r in rec.results if r.get("eos")] == ["end_filter"]
    assert fin.completion_tokens == len(b"hm, xyz</think>ok")


def test_the_grammar_applies_after_the_budget_ends_the_thinking() -> None:
    backend, _ = make_backend(R1, script=fx.reply("ab" * 20))
    add(backend, chat("a", "hi", grammar=OK, grammar_param="response_format", reasoning_budget=3))
    events = run(backend)
    assert text(events, "a", Channel.REASONING) == "aba"
    assert text(events, "a", Channel.CONTENT) == "ok"
    assert finished(events, "a").reasoning_tokens == 3 + len(b"</think>")


def test_without_the_answer_filter_grammar_and_logprobs_are_refused_while_thinking() -> None:
    handle = dataclasses.replace(fx.make_handle(script=fx.reply("x")), new_answer_filter=None)
    backend = ExLlamaV3Backend(handle, R1)
    assert not backend.info.grammar_while_thinking and not backend.info.logprobs_while_thinking
    with pytest.raises(RequestRejected) as e:
        checked_prepare(backend, chat("a", "hi", grammar=OK, grammar_param="response_format"))
    assert e.value.param == "response_format"
    with pytest.raises(RequestRejected) as e:
        checked_prepare(backend, chat("a", "hi", logprobs=1))
    assert e.value.param == "logprobs"


def test_logprobs_cover_the_answer_only() -> None:
    backend, _ = make_backend(R1, script=fx.reply("ab</think>cd"))
    add(backend, chat("a", "hi", logprobs=2))
    events = run(backend)
    thinking = deltas(events, "a", Channel.REASONING)
    assert "".join(d.text for d in thinking) == "ab"
    assert all(d.logprobs is None for d in thinking)
    answer = deltas(events, "a", Channel.CONTENT)
    entries = [e for d in answer for e in d.logprobs or ()]
    for d in answer:
        assert d.logprobs is not None and "".join(e.token for e in d.logprobs) == d.text
    assert [e.token for e in entries] == ["c", "d"]
    assert [e.token_bytes for e in entries] == [b"c", b"d"]
    # The model's own distribution at the position (fx.raw_probs: the choice, then the next id).
    for e, choice in zip(entries, b"cd", strict=True):
        assert e.logprob == pytest.approx(math.log(fx.raw_probs(choice)[choice]))
        assert [t.token for t in e.top] == [chr(choice), chr(choice + 1)]


def test_stop_strings_match_in_the_answer_only() -> None:
    backend, rec = make_backend(R1, script=fx.reply("stop or go</think>go, stop now"))
    add(backend, chat("a", "hi", stop=("stop",)))
    (job,) = [*rec.inner.pending_jobs, *rec.inner.active_jobs]
    assert "stop" not in job.stop_strings  # held back from the Job, matched by us
    events = run(backend)
    check_lifecycle(events, "a")
    assert text(events, "a", Channel.REASONING) == "stop or go"
    assert text(events, "a", Channel.CONTENT) == "go, "
    fin = finished(events, "a")
    assert fin.finish_reason is FinishReason.STOP
    # The job ended on the stop string's last token, in the engine (its counters intact).
    assert [r["eos_reason"] for r in rec.results if r.get("eos")] == ["end_filter"]
    assert fin.completion_tokens == len(b"stop or go</think>go, stop")


def test_a_partial_stop_string_at_the_end_is_released() -> None:
    backend, _ = make_backend(R1, script=fx.reply("a</think>bz"))
    add(backend, chat("a", "hi", stop=("zz",)))
    events = run(backend)
    assert text(events, "a", Channel.CONTENT) == "bz"
    assert finished(events, "a").finish_reason is FinishReason.STOP  # <|im_end|>


def test_a_stop_string_cuts_the_answer_logprobs_with_its_text() -> None:
    backend, _ = make_backend(R1, script=fx.reply("x</think>abSTOPc"))
    add(backend, chat("a", "hi", stop=("ST",), logprobs=0))
    events = run(backend)
    answer = deltas(events, "a", Channel.CONTENT)
    assert "".join(d.text for d in answer) == "ab"
    assert [e.token for d in answer for e in d.logprobs or ()] == ["a", "b"]


def test_stop_strings_wait_for_min_tokens() -> None:
    # "go" at output tokens 6-7 is before min_tokens 9; the one at 11-12 stops it.
    backend, _ = make_backend(R1, script=fx.reply("t</think>gogo go"))
    add(backend, chat("a", "hi", stop=("go",), min_tokens=len(b"t</think>gogo")))
    events = run(backend)
    assert text(events, "a", Channel.CONTENT) == "gogo "


def test_without_a_parser_the_job_matches_stop_strings_itself() -> None:
    backend, rec = make_backend(script=fx.reply("ab stop"))
    add(backend, chat("a", "hi", stop=("stop",)))
    (job,) = [*rec.inner.pending_jobs, *rec.inner.active_jobs]
    assert "stop" in job.stop_strings and not job.filters
    events = run(backend)
    assert [r["eos_reason"] for r in rec.results if r.get("eos")] == ["stop_string"]
    assert text(events, "a", Channel.CONTENT) == "ab "
