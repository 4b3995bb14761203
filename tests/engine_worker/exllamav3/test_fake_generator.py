"""The fake ExLlamaV3 generator reproduces the 1.6.5 quirks the backend relies on.

These tests pin the fake itself (the backend tests rest on it): each asserts a
behaviour read from the 1.6.5 source, cited in ``tests/fakes/exllamav3.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes import exllamav3 as fx


def _gen(**kw: Any) -> fx.Generator:
    g = fx.make_handle(**kw).generator
    assert isinstance(g, fx.Generator)
    return g


def _job(ids: list[int], **kw: Any) -> fx.Job:
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("stop_conditions", [fx.IM_END])
    return fx.Job(input_ids=fx.FakeTensor(ids), **kw)


def _drain(g: fx.Generator, limit: int = 2000) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(limit):
        if not g.num_remaining_jobs():
            return out
        out += g.iterate()
    raise AssertionError("generator did not drain")


def _prompt(n: int) -> list[int]:
    return [fx.BOS] + [0x61 + i % 26 for i in range(n - 1)]


def test_job_rejects_misspelt_keyword() -> None:
    with pytest.raises(TypeError):
        fx.Job(input_ids=fx.FakeTensor([1, 2]), max_new_token=3)  # type: ignore[call-arg]


def test_generator_rejects_misspelt_keyword() -> None:
    m = fx.Model()
    with pytest.raises(TypeError):
        fx.Generator(m, fx.Cache(m, 512), fx.Tokenizer(), max_chunk=256)  # type: ignore[call-arg]


def test_several_results_for_one_job_in_one_call() -> None:
    g = _gen(script=fx.reply("ok"))
    serial = g.enqueue(_job(_prompt(10)))
    first = g.iterate()
    assert [r["stage"] for r in first] == ["started", "prefill", "streaming"]
    assert all(r["serial"] == serial for r in first)
    assert first[1]["curr_progress"] == 9 and first[1]["max_progress"] == 9
    assert "identifier" not in first[0]


def test_fully_cached_page_aligned_prompt_emits_no_prefill() -> None:
    g = _gen(script=fx.reply("x"))
    prompt = _prompt(fx.PAGE_SIZE + 1)  # len - 1 is one whole page
    g.enqueue(_job(prompt))
    _drain(g)
    g.enqueue(_job(prompt, identifier="again"))
    second = _drain(g)
    stages = [r["stage"] for r in second]
    assert "prefill" not in stages and stages[0] == "started"
    eos = second[-1]
    assert eos["cached_pages"] == 1 and eos["cached_tokens"] == fx.PAGE_SIZE


def test_stop_token_leaves_held_text_out_of_text() -> None:
    g = _gen(script=fx.reply("abcEN"))
    g.enqueue(_job(_prompt(5), stop_conditions=[fx.IM_END, "END"]))
    res = _drain(g)
    eos = res[-1]
    assert eos["eos_reason"] == "stop_token" and "text" not in eos
    assert eos["held"]["text"] == "EN" + fx.SPECIAL_PIECES[fx.IM_END]
    assert eos["held"]["token_ids"].tolist() == [[ord("E"), ord("N"), fx.IM_END]]
    streamed = "".join(r.get("text", "") for r in res if r["stage"] == "streaming")
    assert streamed == "abc"


def test_error_result_has_no_identifier_and_others_continue() -> None:
    g = _gen(script=fx.reply("fine"), fail_prefill=lambda p: p[-1] == ord("!"))
    bad = g.enqueue(_job([*_prompt(5), ord("!")], identifier="bad"))
    good = g.enqueue(_job(_prompt(6), identifier="good"))
    res = _drain(g)
    errors = [r for r in res if r["stage"] == "error"]
    assert len(errors) == 1 and errors[0]["serial"] == bad
    assert set(errors[0]) == {"job", "serial", "stage", "eos", "error"}
    assert [r for r in res if r["serial"] == good][-1]["eos_reason"] == "stop_token"


def test_draft_keys_only_when_drafting() -> None:
    plain = _gen(script=fx.reply("ab"))
    plain.enqueue(_job(_prompt(4)))
    assert "accepted_draft_tokens" not in _drain(plain)[-1]
    drafting = _gen(script=fx.reply("ab"), drafting="ngram")
    drafting.enqueue(_job([fx.BOS, *b"xyz"]))  # nothing ever repeats: no draft, 0/0
    eos = _drain(drafting)[-1]
    assert eos["accepted_draft_tokens"] == 0 and eos["rejected_draft_tokens"] == 0


def test_speculative_pass_streams_one_dict_per_accepted_token() -> None:
    text = "la la la la la la la la la la "
    g = _gen(script=fx.reply(text), drafting="ngram", num_draft_tokens=3)
    g.enqueue(_job(_prompt(4), max_new_tokens=64))
    per_call = []
    res: list[dict[str, Any]] = []
    while g.num_remaining_jobs():
        batch = g.iterate()
        per_call.append(sum(1 for r in batch if r["stage"] == "streaming"))
        res += batch
    eos = res[-1]
    assert eos["accepted_draft_tokens"] > 0 and max(per_call) > 1
    assert sum(per_call) == eos["new_tokens"] == len(text) + 1
    assert "".join(r.get("text", "") for r in res) == text


def test_requeue_restarts_the_job_mid_stream() -> None:
    g = _gen(script=fx.reply("0123456789"))
    serial = g.enqueue(_job(_prompt(fx.PAGE_SIZE - 1), max_rq_tokens=1, max_new_tokens=20))
    res = _drain(g)
    stages = [(r["stage"], r.get("requeue", False)) for r in res if r["serial"] == serial]
    first_stream = stages.index(("streaming", False))
    rq = stages.index(("streaming", True))
    assert first_stream < rq < stages.index(("started", False), rq)
    eos = res[-1]
    assert eos["new_tokens"] == 11 and eos["prompt_tokens"] == fx.PAGE_SIZE - 1
    assert "".join(r.get("text", "") for r in res) == "0123456789"


def test_enqueue_asserts_when_the_job_cannot_fit() -> None:
    g = _gen(cache_tokens=512)
    with pytest.raises(AssertionError, match=r"Job requires 3 pages \(only 2 available\)"):
        g.enqueue(_job(_prompt(600)))


def test_incomplete_utf8_is_held_until_complete() -> None:
    g = _gen(script=fx.reply("日".encode()))
    g.enqueue(_job(_prompt(3)))
    texts = [r.get("text") for r in _drain(g) if r["stage"] == "streaming"]
    assert texts == [None, None, "日", None]
