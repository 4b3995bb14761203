"""Grammars (1.6.5's ``LLGuidanceFilter``), logprobs (``return_probs``/``return_top_tokens``)
and chat-template tools through ``ExLlamaV3Backend`` on the fake generator."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import llguidance
import pytest

from engine_worker.admission import checked_prepare
from engine_worker.backend import RequestRejected
from engine_worker.exllamav3.logprobs import LOGPROB_FLOOR, split_text
from engine_worker.settings import WorkerSettings
from protocol.messages import (
    ChatMessage,
    ErrorCode,
    Event,
    FinishReason,
    RequestError,
    SamplingParams,
    Submit,
    TokenDelta,
    TokenLogprob,
)
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import (
    add,
    check_lifecycle,
    finished,
    make_backend,
    of,
    raw,
    run,
    text_of,
)

CFG = WorkerSettings(backend="exllamav3", model_dir=Path("/models/fake-exl3"))
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
JSON_GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)


def _grammar(text: str, **params: Any) -> Submit:
    return raw("g", "Answer:", grammar=text, grammar_param="response_format", **params)


def _deltas(events: list[Event], rid: str) -> list[TokenDelta]:
    return [e for e in of(events, rid) if isinstance(e, TokenDelta)]


def _check_logprobs(events: list[Event], rid: str) -> list[TokenLogprob]:
    """Every delta carries entries whose ``token`` strings join to its text."""
    entries: list[TokenLogprob] = []
    for d in _deltas(events, rid):
        assert d.logprobs is not None, d
        assert "".join(e.token for e in d.logprobs) == d.text, d
        entries += d.logprobs
    return entries


# ------------------------------------------------------------------ grammar


def test_a_grammar_request_attaches_a_filter_with_that_grammar() -> None:
    backend, rec = make_backend(script=fx.reply('{"a": 12}'))
    add(backend, _grammar(JSON_GRAMMAR))
    events = backend.step()
    (job,) = rec.inner.active_jobs
    (flt,) = job.filters
    assert isinstance(flt, fx.LLGuidanceFilter)
    assert flt._grammar == JSON_GRAMMAR and flt.eos_after_completed
    assert flt.job is job and flt.is_active  # attached when the engine started the job
    events += run(backend)
    check_lifecycle(events, "g")
    assert text_of(events, "g") == '{"a": 12}'
    # the grammar completes at "}" and ends the job (end_filter), before the model's <|im_end|>
    assert [r.get("eos_reason") for r in rec.results if r.get("eos")] == ["end_filter"]
    fin = finished(events, "g")
    assert fin.finish_reason is FinishReason.STOP and fin.completion_tokens == len('{"a": 12}')


def test_the_fake_model_obeys_the_mask() -> None:
    backend, _ = make_backend(script=fx.reply("maybe"))
    add(backend, _grammar('start: "yes" | "no"'))
    events = run(backend)
    # "m" is forbidden: the next choice is the lowest allowed id, "n"; then "o" is forced
    assert text_of(events, "g") == "no"
    assert finished(events, "g").finish_reason is FinishReason.STOP


def test_without_a_grammar_the_same_script_runs_free() -> None:
    backend, _ = make_backend(script=fx.reply("maybe"))
    add(backend, raw("free", "Answer:"))
    assert text_of(run(backend), "free") == "maybe"


@pytest.mark.parametrize("drafting", ["ngram", "draft_model", "mtp"])
def test_drafts_are_verified_under_the_mask(drafting: str) -> None:
    # The model repeats "ab"; n-gram drafts keep proposing "ab" where the grammar wants "c".
    # 1.6.5 samples each drafted position under the mask advanced by the tokens accepted before
    # it (generator.py:1958-1983) and accepts a draft token only when it equals that sample.
    grammar = "start: /(ab){5}c/"
    script = fx.reply("ab" * 20)
    plain, _ = make_backend(script=script)
    add(plain, _grammar(grammar))
    expected = text_of(run(plain), "g")
    assert expected == "abababababc"
    backend, rec = make_backend(script=script, drafting=drafting, draft_script=fx.reply("ab" * 20))
    add(backend, _grammar(grammar))
    events = run(backend)
    assert text_of(events, "g") == expected
    fin = finished(events, "g")
    assert fin.draft_accepted is not None and fin.draft_rejected is not None
    assert fin.draft_accepted > 0 and fin.draft_rejected > 0  # the "a" drafted where "c" goes
    assert [r.get("eos_reason") for r in rec.results if r.get("eos")] == ["end_filter"]


def test_a_grammar_that_does_not_compile_is_refused_at_prepare_with_its_param() -> None:
    backend, _ = make_backend()
    for grammar in ("start: (", '{"grammars": [{"json_schema": {"type": "nonsense"}}]}'):
        with pytest.raises(RequestRejected) as e:
            checked_prepare(backend, raw("bad", "x", grammar=grammar, grammar_param="tool_choice"))
        assert e.value.code is ErrorCode.INVALID_REQUEST
        assert e.value.param == "tool_choice"
        assert e.value.message.startswith("invalid grammar: ") and "\n" not in e.value.message
    assert not backend.active_ids()


def test_each_choice_gets_its_own_filter_compiled_at_prepare() -> None:
    backend, rec = make_backend(script=fx.reply("maybe"))
    prepared = checked_prepare(
        backend,
        Submit("g", SamplingParams(max_tokens=8, grammar='start: "yes" | "no"'), prompt="Answer:", n=3),
    )
    filters = list(prepared.prompt.filters)
    assert len(filters) == 3 and len({id(f) for f in filters}) == 3
    for i in range(3):
        backend.start(f"g-{i}", prepared, prepared.submit.params)
    events = run(backend)
    assert [text_of(events, f"g-{i}") for i in range(3)] == ["no", "no", "no"]
    used = {id(f) for j in rec.results if j["stage"] == "started" for f in j["job"].filters}
    assert used == {id(f) for f in filters}


def test_a_grammar_that_fails_mid_generation_fails_only_its_request() -> None:
    # An llguidance matcher error makes 1.6.5's filter raise inside iterate() (llguidance.py:110-112),
    # which would fail every request of the step. The worker's filter keeps the error; the request
    # fails alone, before any output of that step reaches the client.
    backend, rec = make_backend(script=fx.reply("ab" * 20))
    add(backend, _grammar("start: /(ab)+c/"))
    add(backend, raw("other", "hello", max_tokens=10))
    events = backend.step() + backend.step()
    (flt,) = next(j for j in rec.inner.active_jobs if j.identifier == "g").filters
    flt._matcher.consume_token(ord("z"))  # what a parser limit reached mid-way looks like: an error state
    events += backend.step()
    (err,) = [e for e in of(events, "g") if isinstance(e, RequestError)]
    assert err.code is ErrorCode.INVALID_REQUEST and err.param == "response_format"
    assert "grammar failed" in err.message and "\n" not in err.message
    assert "g" not in backend.active_ids() and all(j.identifier != "g" for j in rec.inner.active_jobs)
    events += run(backend)
    check_lifecycle(events, "other")
    assert of(events, "g")[-1] is err


def test_a_queued_grammar_job_keeps_its_filter_through_a_fault() -> None:
    backend, rec = make_backend(script=fx.reply("maybe"))
    add(backend, raw("a", "x", max_tokens=20))
    backend.step()
    add(backend, _grammar('start: "yes" | "no"'))
    rec.inner.fail_next_iterate = RuntimeError("CUDA out of memory")
    backend.step()
    assert sorted(backend.active_ids()) == ["g"]
    events = run(backend)
    assert text_of(events, "g") == "no"


# ------------------------------------------------------------------ logprobs


def _expected(choice: int, token: int) -> float:
    return math.log(fx.raw_probs(choice)[token])


def test_logprobs_are_the_models_raw_probabilities_and_join_to_the_text() -> None:
    reply = "Hi there"
    backend, _ = make_backend(script=fx.reply(reply))
    add(backend, raw("a", "x", logprobs=3, temperature=0.5, top_k=5))
    events = run(backend)
    entries = _check_logprobs(events, "a")
    assert "".join(e.token for e in entries) == reply
    for e, ch in zip(entries, reply.encode(), strict=True):
        assert e.token_bytes == bytes([ch])
        # softmax of the raw logits: not tempered, not truncated (job.py:767-776)
        assert e.logprob == pytest.approx(_expected(ch, ch))
        assert [t.token for t in e.top] == [chr(ch), chr(ch + 1), "\x00" if ch else "\x01"]
        assert e.top[1].logprob == pytest.approx(_expected(ch, ch + 1))
        assert e.top[0].token_bytes == bytes([ch])


def test_no_logprobs_unless_asked() -> None:
    backend, rec = make_backend(script=fx.reply("Hi"))
    add(backend, raw("a", "x"))
    events = run(backend)
    assert all(d.logprobs is None for d in _deltas(events, "a"))
    assert all("token_probs" not in r for r in rec.results)


def test_zero_alternatives_still_give_the_tokens_logprob() -> None:
    backend, rec = make_backend(script=fx.reply("Hi"))
    add(backend, raw("a", "x", logprobs=0))
    entries = _check_logprobs(run(backend), "a")
    assert [e.token for e in entries] == ["H", "i"] and all(e.top == () for e in entries)
    assert all("top_k_tokens" not in r for r in rec.results)


def test_a_grammar_forced_token_reports_what_the_model_gave_it() -> None:
    backend, _ = make_backend(script=fx.reply("maybe"))
    add(backend, _grammar('start: "yes" | "no"', logprobs=2))
    entries = _check_logprobs(run(backend), "g")
    assert [e.token for e in entries] == ["n", "o"]
    # "n" replaced the model's "m"; 1.6.5 reports its raw probability (before the mask)
    assert entries[0].logprob == pytest.approx(_expected(ord("m"), ord("n")))
    assert [t.token for t in entries[0].top] == ["m", "n"]  # "m" is listed though the grammar forbade it


def test_text_held_for_a_stop_string_comes_with_its_entries() -> None:
    backend, _ = make_backend(script=fx.reply("abcEND tail"))
    add(backend, raw("a", "x", stop=["END"], logprobs=1))
    events = run(backend)
    entries = _check_logprobs(events, "a")
    assert text_of(events, "a") == "abc"
    assert [e.token for e in entries] == ["a", "b", "c"]  # the stop string's tokens get none


def test_a_token_cut_by_a_stop_string_shows_its_shown_part() -> None:
    # One token, "cd", of which "d" starts the stop string "dE": only "c" is shown.
    split = split_text([0, 1, 2], "abc", ["ab", "cd", "E"], lambda ids: "")
    assert split == ["ab", "c", None]


def test_text_held_at_a_stop_token_is_flushed_with_its_entries() -> None:
    backend, _ = make_backend(script=fx.reply("It ends with EN"))
    add(backend, raw("a", "x", stop=["END"], logprobs=2))
    events = run(backend)
    entries = _check_logprobs(events, "a")
    assert text_of(events, "a") == "It ends with EN"
    assert "".join(e.token for e in entries) == "It ends with EN"
    assert entries[-1].logprob == pytest.approx(_expected(ord("N"), ord("N")))


def test_split_utf8_characters_go_to_the_token_that_completes_them() -> None:
    reply = "né ☃!"
    backend, _ = make_backend(script=fx.reply(reply))
    add(backend, raw("a", "x", logprobs=1))
    events = run(backend)
    entries = _check_logprobs(events, "a")
    data = reply.encode()
    assert len(entries) == len(data)
    assert [e.token_bytes for e in entries] == [bytes([b]) for b in data]
    assert [e.token for e in entries] == ["n", "", "é", " ", "", "", "☃", "!"]


def test_logprobs_with_drafting_cover_every_accepted_token() -> None:
    reply = "abcabcabcabcabcabc"
    backend, _ = make_backend(script=fx.reply(reply), drafting="ngram")
    add(backend, raw("a", "x", logprobs=1, max_tokens=len(reply)))
    events = run(backend)
    entries = _check_logprobs(events, "a")
    assert "".join(e.token for e in entries) == reply
    assert finished(events, "a").draft_accepted
    assert any(len(d.logprobs or ()) > 1 for d in _deltas(events, "a"))  # several tokens per pass


def test_logprobs_survive_a_requeue() -> None:
    reply = "xy" * 400
    cfg = dataclasses.replace(CFG, max_rq_tokens=256)
    backend, rec = make_backend(cfg, script=fx.reply(reply))
    add(backend, raw("a", "x", logprobs=1, max_tokens=len(reply)))
    events = run(backend)
    assert any(r.get("requeue") for r in rec.results)
    entries = _check_logprobs(events, "a")
    assert "".join(e.token for e in entries) == reply


def test_logprobs_out_of_range_are_refused() -> None:
    backend, _ = make_backend()
    with pytest.raises(RequestRejected) as e:
        checked_prepare(backend, raw("a", "x", logprobs=21))
    assert e.value.param == "logprobs"


def test_probability_zero_is_the_floor() -> None:
    from engine_worker.exllamav3.logprobs import logprob

    assert logprob(0.0) == LOGPROB_FLOOR and logprob(None) == LOGPROB_FLOOR
    assert logprob(1.0) == 0.0


# ------------------------------------------------------------------ tools in the chat template


def test_tools_reach_the_template() -> None:
    backend, _ = make_backend(chat_template=fx.QWEN_TOOLS_TEMPLATE)
    assert backend.info.chat_template == fx.QWEN_TOOLS_TEMPLATE and backend.info.template_tools
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    call = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]
    submit = Submit(
        "t",
        SamplingParams(max_tokens=4),
        messages=(
            ChatMessage("user", "find x"),
            ChatMessage("assistant", "", tool_calls_json=json.dumps(call)),
            ChatMessage("tool", "found", tool_call_id="c1", name="lookup"),
        ),
        tools_json=json.dumps(tools),
    )
    prompt = fx.Tokenizer._decode(checked_prepare(backend, submit).prompt.ids.tolist()[0], True)
    assert json.dumps(tools[0]) in prompt
    assert '{"name": "lookup", "arguments": {"q": "x"}}' in prompt
    assert "<tool_response>\nfound\n</tool_response>" in prompt


def test_bad_tool_json_is_refused() -> None:
    backend, _ = make_backend(chat_template=fx.QWEN_TOOLS_TEMPLATE)
    with pytest.raises(RequestRejected) as e:
        checked_prepare(
            backend,
            Submit("t", SamplingParams(max_tokens=4), messages=(ChatMessage("user", "x"),), tools_json="{"),
        )
    assert e.value.param == "tools"
    bad_call = (ChatMessage("user", "x"), ChatMessage("assistant", "", tool_calls_json="["))
    with pytest.raises(RequestRejected) as e:
        checked_prepare(backend, Submit("t", SamplingParams(max_tokens=4), messages=bad_call))
    assert e.value.param == "messages"


def test_a_template_without_tools_refuses_a_tool_turn() -> None:
    backend, _ = make_backend()  # the ChatML stand-in refuses unknown roles, as strict templates do
    with pytest.raises(RequestRejected) as e:
        checked_prepare(
            backend,
            Submit("t", SamplingParams(max_tokens=4), messages=(ChatMessage("tool", "r", tool_call_id="c"),)),
        )
    assert e.value.param == "messages"
