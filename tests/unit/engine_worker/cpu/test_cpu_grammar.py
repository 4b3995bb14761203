"""CpuBackend with grammars (fast, tiny random Llama): output always matches,
drafting under a grammar is exact and never verifies a forbidden token, a bad
grammar is a rejection naming its field, and compiling happens in ``prepare``."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
from llguidance import LLMatcher

import engine_worker.cpu.vocab_tables as cpu_engine
from engine_worker.admission import budget, checked_prepare
from engine_worker.backend import RequestRejected
from engine_worker.constraints import TokenConstraint
from protocol.messages import ErrorCode, FinishReason, RequestError, SamplingParams, TokenDelta
from tests.fakes.cpu import add

YES_NO = 'start: "The answer is " ("yes" | "no") "."'
# Bounded and without free whitespace, so even a random model completes it in a few tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "colour"],
    "additionalProperties": False,
}


def ids(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def json_grammar(schema: dict[str, Any]) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def matches_prefix(backend: Any, tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether ``text`` can begin a string of ``grammar`` (the grammar works on bytes,
    so any tokenization of the text will do)."""
    matcher = LLMatcher(backend._tables.vocabulary.load(tokenizer), grammar, log_level=0)
    text_ids = ids(tokenizer, text, special=False)
    return matcher.validate_tokens(text_ids) == len(text_ids)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sampled_output_matches_the_grammar(tiny, make_backend, run_one, raw, seed) -> None:
    backend = make_backend(tiny)
    for rid, grammar in (("lark", YES_NO), ("json", json_grammar(SCHEMA))):
        r = run_one(backend, raw(rid, "Answer:", max_tokens=60, temperature=1.0, seed=seed, grammar=grammar))
        assert r.finished.finish_reason is FinishReason.STOP, r.text
        if rid == "lark":
            assert re.fullmatch(r"The answer is (yes|no)\.", r.text)
        else:
            value = json.loads(r.text)
            assert set(value) == {"ok", "n", "colour"} and isinstance(value["ok"], bool)
            assert value["n"] in range(10) and value["colour"] in {"red", "green", "blue"}


def test_grammar_wins_over_logit_bias(tiny, tokenizer, make_backend, run_one, raw) -> None:
    banana = ids(tokenizer, " banana", special=False)
    params = {"max_tokens": 40, "logit_bias": {banana[0]: 100.0}, "grammar": YES_NO}
    r = run_one(make_backend(tiny), raw("b", "Fruit:", **params))
    assert re.fullmatch(r"The answer is (yes|no)\.", r.text)
    assert r.finished.finish_reason is FinishReason.STOP


def test_grammar_ends_the_sequence_despite_min_tokens_and_ignore_eos(
    tiny, make_backend, run_one, raw
) -> None:
    backend = make_backend(tiny)
    for rid, extra in (("min", {"min_tokens": 30}), ("ignore", {"ignore_eos": True})):
        r = run_one(backend, raw(rid, "Answer:", max_tokens=40, grammar=YES_NO, **extra))
        assert re.fullmatch(r"The answer is (yes|no)\.", r.text)
        assert r.finished.finish_reason is FinishReason.STOP and r.finished.completion_tokens < 30


def test_open_grammar_allows_eos_once_complete(tiny, make_backend, run_one, raw) -> None:
    # Letters forever or an end token, once at least three letters came: EOS is strongly favoured.
    grammar = "start: /[a-z]{3,}/"
    r = run_one(make_backend(tiny), raw("e", "Word:", max_tokens=30, grammar=grammar, logit_bias={2: 100.0}))
    assert re.fullmatch(r"[a-z]{3,}", r.text)
    assert r.finished.finish_reason is FinishReason.STOP and r.finished.completion_tokens <= 4


def test_max_tokens_cuts_a_grammar_short(tiny, tokenizer, make_backend, run_one, raw) -> None:
    backend = make_backend(tiny)
    grammar = json_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 50})
    r = run_one(backend, raw("l", "Numbers:", max_tokens=12, temperature=1.0, seed=3, grammar=grammar))
    assert r.finished.finish_reason is FinishReason.LENGTH
    assert r.finished.completion_tokens == 12
    assert r.text.startswith("[") and matches_prefix(backend, tokenizer, grammar, r.text)


def test_drafts_the_grammar_forbids_are_never_verified(
    scripted, tokenizer, make_backend, run_one, raw
) -> None:
    """The model (and the history the drafter copies) wants the cycle forever; the
    grammar wants seven words of it, then a full stop. A draft runs past the
    seventh word and is cut before the verify pass, so none is rejected (without
    the cut the target would reject " sky")."""
    cycle = ids(tokenizer, " sun moon star sky", special=False)
    assert len(cycle) == 4 and len(set(cycle)) == 4
    prompt = "Repeat:" + tokenizer.decode(cycle * 2)
    assert ids(tokenizer, prompt)[-4:] == cycle
    scripted.model.setup_script({c: cycle[(i + 1) % 4] for i, c in enumerate(cycle)})
    target = tokenizer.decode(cycle + cycle[:3]) + "."
    grammar = f'start: "{target}"'
    results = {}
    for drafting in (False, True):
        scripted.model.calls.clear()
        backend = make_backend(scripted, draft_mode="ngram" if drafting else "none", num_draft_tokens=3)
        results[drafting] = r = run_one(backend, raw(str(drafting), prompt, max_tokens=30, grammar=grammar))
        assert r.text == target
        assert r.finished.finish_reason is FinishReason.STOP
        assert r.finished.completion_tokens == 8  # seven words and the full stop, no EOS
    fin = results[True].finished
    assert fin.draft_accepted > 0 and fin.draft_rejected == 0
    assert fin.draft_accepted == scripted.model.drafted_positions()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_under_a_grammar_matches_plain_decoding(
    scripted, tokenizer, make_backend, run_one, raw, temperature
) -> None:
    """A weak script (see test_drafting_matches_plain_decoding) and a grammar that
    forbids one word of the cycle: drafts are sometimes right, sometimes cut, and
    sometimes wrong; the tokens are those of plain decoding all the same."""
    cycle = ids(tokenizer, " one two three four", special=False)
    script = {c: cycle[(i + 1) % len(cycle)] for i, c in enumerate(cycle)}
    scripted.model.setup_script(script, boost=12.0, default=cycle[0])
    grammar = 'start: (" one" | " two" | " four" | " five")+'
    prompt = "Count:" + tokenizer.decode(cycle * 3) + " then"
    texts = []
    for drafting in (False, True):
        scripted.model.calls.clear()
        backend = make_backend(scripted, draft_mode="ngram" if drafting else "none", num_draft_tokens=3)
        submit = raw("r", prompt, max_tokens=40, temperature=temperature, seed=5, grammar=grammar)
        r = run_one(backend, submit)
        texts.append(r.text)
        assert r.finished.completion_tokens == 40 and r.finished.finish_reason is FinishReason.LENGTH
        assert matches_prefix(backend, tokenizer, grammar, r.text)
        if drafting:
            assert r.finished.draft_accepted > 0
            assert r.finished.draft_accepted + r.finished.draft_rejected == scripted.model.drafted_positions()
    assert texts[0] == texts[1]
    assert " three" not in texts[0]


@pytest.mark.parametrize("grammar", ["start: foo(", json_grammar({"type": "strin"})])
def test_bad_grammar_is_rejected_naming_its_field(tiny, make_backend, raw, grammar) -> None:
    backend = make_backend(tiny)
    for param in ("response_format", "tools"):
        with pytest.raises(RequestRejected) as exc:
            add(backend, raw("x", "hi", grammar=grammar, grammar_param=param))
        assert exc.value.code is ErrorCode.INVALID_REQUEST and exc.value.param == param
        assert "invalid grammar" in exc.value.message
    assert len(backend.active_ids()) == 0
    # The backend is unharmed: the next request runs.
    add(backend, raw("ok", "hi", max_tokens=2))
    while backend.active_ids():
        backend.step()


def test_grammar_compiles_on_the_prepare_thread_once_per_request(
    tiny, make_backend, raw, monkeypatch
) -> None:
    backend = make_backend(tiny)
    compiled_on: list[str] = []
    real = cpu_engine.compile_grammar

    def spy(*args: Any, **kwargs: Any) -> Any:
        compiled_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_engine, "compile_grammar", spy)
    submit = raw("r", "Answer:", max_tokens=20, temperature=1.0, seed=1, grammar=YES_NO)
    with ThreadPoolExecutor(1, thread_name_prefix="prepare") as pool:
        prepared = budget(pool.submit(backend.prepare, submit).result(), backend.info)
    assert len(compiled_on) == 1 and compiled_on[0].startswith("prepare")
    for i in range(3):  # three choices, each with its own copy of the compiled grammar
        backend.start(f"r-{i}", prepared, msgspec.structs.replace(submit.params, seed=i))
    assert len(compiled_on) == 1
    texts: dict[str, str] = {f"r-{i}": "" for i in range(3)}
    while backend.active_ids():
        for ev in backend.step():
            if isinstance(ev, TokenDelta):
                texts[ev.request_id] += ev.text
    assert all(re.fullmatch(r"The answer is (yes|no)\.", t) for t in texts.values())


def test_start_compiles_a_grammar_prepare_did_not_see(tiny, make_backend, raw) -> None:
    backend = make_backend(tiny)
    prepared = checked_prepare(backend, raw("r", "Answer:", max_tokens=20))
    params = SamplingParams(max_tokens=20, temperature=0.0, grammar=YES_NO)
    backend.start("r", prepared, params)
    with pytest.raises(RequestRejected) as exc:
        backend.start(
            "bad", prepared, msgspec.structs.replace(params, grammar="start: (", grammar_param="tools")
        )
    assert exc.value.param == "tools" and list(backend.active_ids()) == ["r"]
    backend.abort("r")


def test_grammar_failing_while_decoding_is_a_request_error(
    tiny, make_backend, run_all, raw, monkeypatch
) -> None:
    def fail(self: TokenConstraint, token: int) -> None:
        raise RequestRejected(
            ErrorCode.INVALID_REQUEST, "grammar failed: too complex", param="response_format"
        )

    monkeypatch.setattr(TokenConstraint, "consume", fail)
    ok = raw("ok", "Hello", max_tokens=4, ignore_eos=True)
    bad = raw("bad", "Hello", max_tokens=4, grammar=YES_NO, grammar_param="response_format")
    results = run_all(make_backend(tiny), [ok, bad])
    err = results["bad"].error
    assert isinstance(err, RequestError)
    assert (err.code, err.param, err.message) == (
        ErrorCode.INVALID_REQUEST,
        "response_format",
        "grammar failed: too complex",
    )
    assert results["ok"].finished.completion_tokens == 4


def test_submit_without_grammar_has_no_constraint(tiny, make_backend, raw) -> None:
    backend = make_backend(tiny)
    add(backend, raw("a", "Hello"))
    seq = backend._scheduler.sequences["a"]
    assert seq.out.constraint is None and seq.out.trail is None
    assert not backend._tables.vocabulary.loaded  # nothing built for plain requests
    backend.abort("a")


def test_grammar_that_allows_only_the_end_overrides_min_tokens(tiny, make_backend, run_one, raw) -> None:
    # An empty grammar is complete at once and allows nothing but an end token, which
    # min_tokens would mask: the grammar wins instead of leaving no token to sample.
    backend = make_backend(tiny)
    for rid, extra in (("min", {"min_tokens": 3}), ("ignore", {"ignore_eos": True, "min_tokens": 3})):
        r = run_one(
            backend, raw(rid, "Hi", max_tokens=10, temperature=1.0, seed=1, grammar='start: ""', **extra)
        )
        assert (r.text, r.finished.finish_reason, r.finished.completion_tokens) == ("", FinishReason.STOP, 1)
