"""ExLlamaV3Backend driven through the fake 1.6.5 generator: protocol events per request."""

from __future__ import annotations

import dataclasses
import struct
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine_worker.admission import checked_prepare
from engine_worker.backend import EngineFailed, RequestRejected
from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.options.exllamav3 import PAGE_SIZE
from engine_worker.settings import WorkerSettings
from protocol.messages import (
    ChatMessage,
    ErrorCode,
    Finished,
    FinishReason,
    PrefillProgress,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
)
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import (
    RecordingGenerator,
    add,
    chat,
    check_lifecycle,
    finished,
    make_backend,
    of,
    progress,
    raw,
    run,
    text_of,
)

CFG = WorkerSettings(backend="exllamav3", model_dir=Path("/models/fake-exl3"))


def _letters(n: int) -> str:
    """Raw prompt text of ``n - 1`` bytes: with BOS, ``n`` tokens in the fake tokenizer."""
    return "".join(chr(0x61 + i % 26) for i in range(n - 1))


# ------------------------------------------------------------------ prompt progress


def test_progress_of_a_fresh_prompt_follows_prefill_chunks() -> None:
    n, chunk = 1001, 256
    backend, _ = make_backend(script=fx.reply("Hi"), max_chunk_size=chunk)
    add(backend, raw("a", _letters(n)))
    events = run(backend)
    check_lifecycle(events, "a")
    started = of(events, "a")[0]
    assert started == Started("a", n, 0)
    # one event at the start, one per chunk (the engine stops at n - 1), a closing one at n
    assert progress(events, "a") == [0, *range(chunk, n - 1, chunk), n - 1, n]
    assert text_of(events, "a") == "Hi"
    fin = finished(events, "a")
    assert (fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens) == (n, 0, 3)
    assert fin.finish_reason is FinishReason.STOP
    assert fin.draft_accepted is None and fin.draft_rejected is None


def test_repeated_prompt_reports_the_reused_prefix() -> None:
    n = 700
    backend, _ = make_backend(script=fx.reply("Hi"), max_chunk_size=256)
    add(backend, raw("first", _letters(n)))
    run(backend)
    add(backend, raw("second", _letters(n)))
    events = run(backend)
    check_lifecycle(events, "second")
    # whole pages by hash plus the token-level match inside the last, partial page
    assert of(events, "second")[0] == Started("second", n, n - 1)
    assert progress(events, "second") == [n - 1, n]
    fin = finished(events, "second")
    assert type(fin.cached_tokens) is int and fin.cached_tokens == n - 1


@pytest.mark.parametrize("output_chunking", [True, False])
def test_prefix_survives_a_job_that_reserved_the_whole_cache(output_chunking: bool) -> None:
    # b1 (large max_tokens) reserves all 8 pages of a 2048-token cache but writes only its
    # prompt's page and a few tokens; 1.6.5 gives the unwritten reservations back with their
    # old content (pagetable.py:166-177). a2 reserves only the pages it can write (three, also
    # with output chunking: max_rq_tokens is passed only where it reserves less), and takes an
    # empty one for its third, so a1's partial page is matchable.
    n_a, n_b = 600, 11
    cfg = dataclasses.replace(CFG, output_chunking=output_chunking)
    backend, rec = make_backend(cfg, script=fx.reply("Hi"), cache_tokens=2048, max_chunk_size=256)
    add(backend, raw("a1", _letters(n_a), max_tokens=4))
    run(backend)
    add(backend, raw("b1", "z" * (n_b - 1), max_tokens=2000))
    backend.step()
    (job,) = rec.inner.active_jobs
    assert len(job.allocated_pages) == 2048 // PAGE_SIZE
    run(backend)
    add(backend, raw("a2", _letters(n_a), max_tokens=4))
    events = backend.step()
    (job,) = rec.inner.active_jobs
    assert len(job.allocated_pages) == 3
    events += run(backend)
    # whole pages by hash plus the token-level match inside the partial page: all but the
    # last prompt token, which decode feeds
    assert of(events, "a2")[0] == Started("a2", n_a, n_a - 1)
    assert finished(events, "a2").cached_tokens == n_a - 1


def test_a_long_request_with_output_chunking_reserves_one_window_at_a_time() -> None:
    # max_rq_tokens 2048: the job reserves its prompt and the pages up to the boundary past
    # the next 2048 tokens (job.py:1300-1316), not its whole max_tokens, and its reservation
    # in the worker is the same.
    n_a = 600
    backend, rec = make_backend(script=fx.reply("Hi"), cache_tokens=8192, max_chunk_size=256)
    add(backend, raw("a1", _letters(n_a), max_tokens=4))
    run(backend)
    add(backend, raw("a2", _letters(n_a), max_tokens=6000))
    events = backend.step()
    (job,) = rec.inner.active_jobs
    assert len(job.allocated_pages) * PAGE_SIZE == -(-(n_a - 1 + 2048) // PAGE_SIZE) * PAGE_SIZE
    assert backend.kv_reserved() == len(job.allocated_pages) * PAGE_SIZE
    events += run(backend)
    assert of(events, "a2")[0] == Started("a2", n_a, n_a - 1)


def test_fully_cached_prompt_without_engine_prefill_still_gets_progress() -> None:
    n = PAGE_SIZE + 1
    backend, rec = make_backend(script=fx.reply("Hi"))
    add(backend, raw("first", _letters(n)))
    run(backend)
    rec.batches.clear()
    add(backend, raw("second", _letters(n)))
    events = run(backend)
    assert not any(r["stage"] == "prefill" for r in rec.results), "the engine emitted no prefill event"
    check_lifecycle(events, "second")
    assert progress(events, "second") == [PAGE_SIZE, n]
    assert finished(events, "second").cached_tokens == PAGE_SIZE


def test_sibling_jobs_of_one_prompt_share_its_prefill() -> None:
    n = 1001
    # max_rq_tokens small enough that both jobs fit the cache at once
    cfg = dataclasses.replace(CFG, max_rq_tokens=256)
    backend, _ = make_backend(cfg, script=fx.reply("same"), max_chunk_size=512)
    for i in range(2):
        add(backend, raw(f"req-{i}", _letters(n)))
    events = run(backend)
    for i in range(2):
        check_lifecycle(events, f"req-{i}")
        assert text_of(events, f"req-{i}") == "same"
    first, second = finished(events, "req-0"), finished(events, "req-1")
    assert first.cached_tokens == 0
    # The second job's first prefill pass found the first one's pages filled in the same
    # steps (job.py:1430-1436); Started waits for that pass, so it reports them.
    assert of(events, "req-1")[0].cached_tokens == n - 1  # type: ignore[union-attr]
    assert second.cached_tokens == n - 1


def test_choices_of_one_request_report_the_prefix_they_reuse_from_the_start() -> None:
    n = 1001
    cfg = dataclasses.replace(CFG, max_rq_tokens=256)
    backend, rec = make_backend(cfg, script=fx.reply("same"), max_chunk_size=512)
    prepared = checked_prepare(backend, raw("r", _letters(n)))
    for i in range(3):
        backend.start(f"r-{i}", prepared, prepared.submit.params)
    assert [j.identifier for j in rec.inner.pending_jobs] == ["r-0"]  # the others wait for its prefill
    assert backend.kv_reserved() == 3 * backend.reservation(prepared)
    events = run(backend)
    for i in range(3):
        check_lifecycle(events, f"r-{i}")
        assert text_of(events, f"r-{i}") == "same"
    assert of(events, "r-0")[0] == Started("r-0", n, 0)
    for i in (1, 2):
        # whole pages by hash, the rest by the token-level match: what usage says at the end
        assert of(events, f"r-{i}")[0] == Started(f"r-{i}", n, n - 1)
        assert progress(events, f"r-{i}") == [n - 1, n]
        assert finished(events, f"r-{i}").cached_tokens == n - 1


def test_held_choices_start_when_the_first_one_ends_early() -> None:
    backend, _ = make_backend(script=fx.reply("same"), max_chunk_size=256)
    prepared = checked_prepare(backend, raw("r", _letters(700)))
    backend.start("r-0", prepared, prepared.submit.params)
    backend.start("r-1", prepared, prepared.submit.params)
    backend.step()
    backend.abort("r-0")
    backend.abort("nobody")
    events = run(backend)
    check_lifecycle(events, "r-1")
    assert not of(events, "r-0")


def test_when_the_first_choice_ends_early_the_next_one_prefills_in_its_place() -> None:
    # The rule of engine_worker.requests.choices, as on the CPU engine: one choice takes
    # the first one's place, the third still waits and then finds the prompt cached.
    n = 1001
    cfg = dataclasses.replace(CFG, max_rq_tokens=256)
    backend, rec = make_backend(cfg, script=fx.reply("same"), max_chunk_size=256)
    prepared = checked_prepare(backend, raw("r", _letters(n)))
    for i in range(3):
        backend.start(f"r-{i}", prepared, prepared.submit.params)
    backend.step()
    backend.abort("r-0")
    backend.step()
    assert [j.identifier for j in rec.inner.pending_jobs + rec.inner.active_jobs] == ["r-1"]
    events = run(backend)
    for i in (1, 2):
        check_lifecycle(events, f"r-{i}")
        assert text_of(events, f"r-{i}") == "same"
    assert of(events, "r-2")[0] == Started("r-2", n, n - 1)


def test_aborting_a_held_choice_leaves_no_job_behind() -> None:
    backend, rec = make_backend(script=fx.reply("same"))
    prepared = checked_prepare(backend, raw("r", _letters(700)))
    backend.start("r-0", prepared, prepared.submit.params)
    backend.start("r-1", prepared, prepared.submit.params)
    backend.abort("r-1")
    events = run(backend)
    assert not of(events, "r-1") and rec.num_remaining_jobs() == 0
    check_lifecycle(events, "r-0")


def test_held_choices_survive_a_fault_of_the_first() -> None:
    backend, rec = make_backend(script=fx.reply("same"), max_chunk_size=256)
    prepared = checked_prepare(backend, raw("r", _letters(700)))
    backend.start("r-0", prepared, prepared.submit.params)
    backend.start("r-1", prepared, prepared.submit.params)
    backend.step()
    rec.inner.fail_next_iterate = RuntimeError("boom")
    assert [(type(e), e.request_id) for e in backend.step()] == [(RequestError, "r-0")]
    events = run(backend)
    check_lifecycle(events, "r-1")
    assert text_of(events, "r-1") == "same"


# ------------------------------------------------------------------ text and finish


@pytest.mark.parametrize("special_pieces", [True, False])
def test_held_text_is_flushed_when_a_stop_token_ends_the_job(special_pieces: bool) -> None:
    backend, rec = make_backend(script=fx.reply("abcEN"), special_pieces=special_pieces)
    add(backend, raw("a", "x", stop=("END",)))
    events = run(backend)
    eos = rec.results[-1]
    assert eos["eos_reason"] == "stop_token" and "text" not in eos  # the engine dropped it
    # decode_special_tokens=True: the stop token's piece is its text whatever the tokenizer
    # kind (tokenizer/tokenizer.py:727-736), and is stripped before flushing
    assert eos["held"]["text"] == "EN" + fx.SPECIAL_PIECES[fx.IM_END]
    assert text_of(events, "a") == "abcEN"
    check_lifecycle(events, "a")
    fin = finished(events, "a")
    assert fin.finish_reason is FinishReason.STOP and fin.completion_tokens == 6
    deltas = [e for e in of(events, "a") if isinstance(e, TokenDelta)]
    assert sum(d.num_tokens for d in deltas) == 5  # the stop token itself is not text


@pytest.mark.parametrize("special_pieces", [True, False])
def test_special_tokens_that_are_not_stop_conditions_are_streamed_as_text(special_pieces: bool) -> None:
    # decode_special_tokens=True, as TabbyAPI: the same text whichever way the tokenizer
    # decodes special tokens on their own (tokenizer/tokenizer.py:704-725)
    ids = [*b"ab", fx.IM_START, *b"cd", fx.IM_END]
    backend, rec = make_backend(script=fx.reply(ids), special_pieces=special_pieces)
    add(backend, raw("a", "x"))
    events = run(backend)
    (job,) = {id(r["job"]): r["job"] for r in rec.results}.values()
    assert job.decode_special_tokens is True
    assert text_of(events, "a") == "ab<|im_start|>cd"
    assert finished(events, "a").finish_reason is FinishReason.STOP


def test_the_templates_turn_end_stops_also_when_spelled_out() -> None:
    # The model writes "<|im_end|>" from ordinary byte tokens: only the stop string ends it.
    backend, _ = make_backend(
        script=fx.reply("done<|im_end|>and more", then=fx.EOS), stop_strings=("<|im_end|>",)
    )
    add(backend, chat("a", "hi"))
    add(backend, raw("b", "hi", ignore_eos=True, max_tokens=30))
    events = run(backend)
    assert text_of(events, "a") == "done"
    assert finished(events, "a").finish_reason is FinishReason.STOP
    assert text_of(events, "b").startswith("done<|im_end|>and more")  # ignore_eos drops it too


def test_flushed_held_text_keeps_multibyte_characters_whole() -> None:
    backend, _ = make_backend(script=fx.reply("a日".encode()))
    add(backend, raw("a", "x", stop=("日本",)))
    events = run(backend)
    assert text_of(events, "a") == "a日"
    assert "\ufffd" not in text_of(events, "a")


def test_character_cut_by_a_stop_token_is_decoded_once() -> None:
    cut = "日".encode()[:2]
    backend, _ = make_backend(script=fx.reply(b"a" + cut))
    add(backend, raw("a", "x"))
    events = run(backend)
    assert text_of(events, "a") == (b"a" + cut).decode("utf-8", errors="replace")


def test_stop_string_is_removed_and_finish_is_stop() -> None:
    backend, _ = make_backend(script=fx.reply("one two three"))
    add(backend, raw("a", "x", stop=(" two",)))
    events = run(backend)
    assert text_of(events, "a") == "one"
    assert finished(events, "a").finish_reason is FinishReason.STOP


def test_max_tokens_gives_length() -> None:
    backend, _ = make_backend(script=fx.reply("abcdefgh"))
    add(backend, raw("a", "x", max_tokens=3))
    events = run(backend)
    assert text_of(events, "a") == "abc"
    fin = finished(events, "a")
    assert fin.finish_reason is FinishReason.LENGTH and fin.completion_tokens == 3


def test_context_end_clamps_the_completion_and_gives_length() -> None:
    n, ctx = 20, 25
    cfg = dataclasses.replace(CFG, max_seq_len=ctx)
    backend, _ = make_backend(cfg, script=fx.reply("x" * 100))
    assert backend.info.max_context_tokens == ctx
    add(backend, raw("a", _letters(n), max_tokens=1000))
    events = run(backend)
    fin = finished(events, "a")
    assert fin.finish_reason is FinishReason.LENGTH and fin.completion_tokens == ctx - n


def test_ignore_eos_runs_to_max_tokens() -> None:
    backend, _ = make_backend(script=fx.reply("ab"))
    add(backend, raw("a", "x", max_tokens=5, ignore_eos=True))
    fin = finished(run(backend), "a")
    assert fin.finish_reason is FinishReason.LENGTH and fin.completion_tokens == 5


def test_min_tokens_defers_the_stop_token() -> None:
    backend, _ = make_backend(script=fx.reply(""))
    add(backend, raw("a", "x", min_tokens=3))
    events = run(backend)
    fin = finished(events, "a")
    assert fin.completion_tokens == 4 and text_of(events, "a") == "   "


def test_output_is_not_lost_across_requeues() -> None:
    answer = "".join(chr(0x41 + i % 26) for i in range(300))
    cfg = dataclasses.replace(CFG, max_rq_tokens=1)
    backend, rec = make_backend(cfg, script=fx.reply(answer))
    add(backend, raw("a", _letters(PAGE_SIZE - 1), max_tokens=400))
    events = run(backend)
    assert sum(1 for r in rec.results if r.get("requeue")) == 2
    check_lifecycle(events, "a")
    assert text_of(events, "a") == answer
    fin = finished(events, "a")
    assert fin.completion_tokens == len(answer) + 1 and fin.prompt_tokens == PAGE_SIZE - 1


# ------------------------------------------------------------------ speculative decoding


def test_ngram_draft_counters_reach_finished() -> None:
    answer = "na " * 30
    backend, rec = make_backend(script=fx.reply(answer), drafting="ngram", num_draft_tokens=4)
    assert backend.info.drafting == "ngram"
    add(backend, raw("a", "x", max_tokens=200))
    events = run(backend)
    eos = rec.results[-1]
    fin = finished(events, "a")
    assert (fin.draft_accepted, fin.draft_rejected) == (
        eos["accepted_draft_tokens"],
        eos["rejected_draft_tokens"],
    )
    assert fin.draft_accepted and fin.draft_accepted > 0
    assert text_of(events, "a") == answer
    # a pass over several drafted tokens arrives as one delta, not one per token
    assert len([e for e in of(events, "a") if isinstance(e, TokenDelta)]) < len(answer)


def test_drafting_with_nothing_drafted_reports_zero_not_none() -> None:
    backend, _ = make_backend(script=fx.reply("z"), drafting="ngram")
    add(backend, raw("a", "xy"))
    fin = finished(run(backend), "a")
    assert (fin.draft_accepted, fin.draft_rejected) == (0, 0)


def test_draft_model_counters() -> None:
    target = "abcdefghij"
    draft = fx.reply("abcXefghij")  # wrong at one position
    backend, _ = make_backend(script=fx.reply(target), drafting="draft_model", draft_script=draft)
    add(backend, raw("a", "x", max_tokens=50))
    events = run(backend)
    fin = finished(events, "a")
    assert text_of(events, "a") == target
    assert fin.draft_rejected is not None and fin.draft_rejected > 0
    assert fin.draft_accepted is not None and fin.draft_accepted > 0


# ------------------------------------------------------------------ errors and admission


def test_engine_error_fails_only_its_request() -> None:
    backend, rec = make_backend(script=fx.reply("fine"), fail_prefill=lambda p: b"boom" in bytes(p[1:]))
    add(backend, raw("bad", "boom"))
    add(backend, raw("good", "calm"))
    events = run(backend)
    errors = [r for r in rec.results if r["stage"] == "error"]
    assert len(errors) == 1 and "identifier" not in errors[0]
    bad = of(events, "bad")
    assert isinstance(bad[-1], RequestError) and bad[-1].code is ErrorCode.INTERNAL
    assert "prefill failed" in bad[-1].message
    check_lifecycle(events, "good")
    assert text_of(events, "good") == "fine"
    assert len(backend.active_ids()) == 0


def test_prompt_longer_than_the_context_is_rejected() -> None:
    backend, rec = make_backend(dataclasses.replace(CFG, max_seq_len=100))
    with pytest.raises(RequestRejected) as e:
        add(backend, raw("a", _letters(100)))
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and e.value.param == "prompt"
    assert "100" in e.value.message and "max_seq_len" in e.value.message
    assert len(backend.active_ids()) == 0 and rec.num_remaining_jobs() == 0


def test_engine_assertion_on_enqueue_becomes_context_length_exceeded() -> None:
    backend, _ = make_backend(cache_tokens=512)
    # Misreport the cache as larger so the prompt passes the backend's own check and the
    # engine's page check (job.py:1342) is what refuses it.
    h = dataclasses.replace(backend._h, cache_tokens=4096)
    backend = ExLlamaV3Backend(h, CFG)
    with pytest.raises(RequestRejected) as e:
        add(backend, chat("a", _letters(1000)))
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and e.value.param == "messages"
    assert "Job requires" in e.value.message and "cache_size" in e.value.message
    assert len(backend.active_ids()) == 0


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 9, "max_tokens": 5}, "min_tokens"),
        ({"logit_bias": {fx.VOCAB_SIZE: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        # finite, but past float32: LogitBias would drop it without a word
        ({"logit_bias": {5: 1e300}}, "logit_bias"),
        ({"logit_bias": {5: -1e300}}, "logit_bias"),
        ({"logit_bias": {5: 3.5e38}}, "logit_bias"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_parameters_the_engine_cannot_honour_are_rejected(params: dict[str, Any], param: str) -> None:
    backend, rec = make_backend()
    with pytest.raises(RequestRejected) as e:
        add(backend, raw("a", "x", **params))
    assert e.value.code is ErrorCode.INVALID_REQUEST and e.value.param == param
    assert rec.num_remaining_jobs() == 0


def test_logit_bias_at_the_float32_limits_and_minus_inf_reach_the_sampler() -> None:
    # largest finite float32: sign 0, exponent 254, mantissa all ones
    (f32_max,) = struct.unpack("<f", (0x7F7FFFFF).to_bytes(4, "little"))
    bias = {5: f32_max, 6: -f32_max, 7: float("-inf"), 8: 2.5}
    backend, rec = make_backend()
    add(backend, raw("a", "x", logit_bias=bias))
    (job,) = rec.inner.pending_jobs
    assert job.sampler.settings["logit_bias"] == bias


def test_chat_template_failure_is_invalid_request() -> None:
    backend, _ = make_backend()
    bad = Submit("a", SamplingParams(max_tokens=4), messages=(ChatMessage("wizard", "hi"),))
    with pytest.raises(RequestRejected) as e:
        add(backend, bad)
    assert e.value.code is ErrorCode.INVALID_REQUEST and "wizard" in e.value.message


def test_sampling_parameters_reach_the_sampler_and_job() -> None:
    backend, rec = make_backend()
    params = SamplingParams(
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=1234,
        stop=("STOP", ""),
        stop_token_ids=(ord("q"), fx.IM_END),
        min_tokens=2,
        logit_bias={65: -100.0, 66: 2.5},
    )
    add(backend, Submit("a", params, prompt="hi"))
    job = rec.inner.pending_jobs[0]
    assert job.sampler.settings == {
        "rep_p": 1.1,
        "freq_p": 0.25,
        "pres_p": 0.5,
        "temperature": 0.7,
        "min_p": 0.05,
        "top_k": 40,
        "top_p": 0.9,
        "logit_bias": {65: -100.0, 66: 2.5},
        "rep_sustain_range": int(10e7),  # ComboSampler's default: the whole context
        "rep_decay_range": 0,
        "temp_last": False,
        "dry_multiplier": 0.0,  # off
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_range": 0,
        "dry_sequence_breakers": None,
    }
    assert (job.seed, job.max_new_tokens, job.min_new_tokens, job.identifier) == (1234, 7, 2, "a")
    assert job.stop_strings == {"STOP"}
    assert job.stop_tokens == {fx.EOS, fx.IM_END, ord("q")}


def test_local_llm_fields_reach_combo_sampler() -> None:
    """penalty_range/repetition_decay/temperature_last are ComboSampler's
    rep_sustain_range/rep_decay_range/temp_last; banned tokens (and EOS with
    ban_eos_token) are -inf biases; skip_special_tokens is decode_special_tokens=False."""
    backend, rec = make_backend()
    params = SamplingParams(
        max_tokens=5,
        temperature=0.7,
        penalty_range=64,
        repetition_decay=16,
        temperature_last=True,
        banned_tokens=(ord("b"), ord("c")),
        ban_eos_token=True,
        logit_bias={ord("b"): 3.0, ord("d"): 1.0},
        skip_special_tokens=True,
    )
    add(backend, Submit("a", params, prompt="hi"))
    job = rec.inner.pending_jobs[0]
    s = job.sampler.settings
    assert (s["rep_sustain_range"], s["rep_decay_range"], s["temp_last"]) == (64, 16, True)
    ninf = float("-inf")
    assert s["logit_bias"] == {ord("b"): ninf, ord("c"): ninf, ord("d"): 1.0, fx.EOS: ninf, fx.IM_END: ninf}
    assert job.decode_special_tokens is False


def test_banned_tokens_are_never_sampled_by_the_fake() -> None:
    """The fake generator honours a -inf bias as LogitBias does: the script's choice
    when banned falls to the lowest allowed id that is not banned."""
    backend, _ = make_backend(script=fx.reply("abab"))
    add(backend, raw("a", "x", max_tokens=4))
    add(backend, raw("b", "x", max_tokens=4, banned_tokens=(ord("a"),)))
    events = run(backend)
    assert text_of(events, "a") == "abab"
    assert "a" not in text_of(events, "b") and text_of(events, "b").count("b") == 2


def test_ban_eos_token_runs_to_max_tokens() -> None:
    backend, _ = make_backend(script=fx.reply("ab"))
    add(backend, raw("a", "x", max_tokens=5, ban_eos_token=True))
    events = run(backend)
    fin = finished(events, "a")
    assert fin.finish_reason is FinishReason.LENGTH and fin.completion_tokens == 5


def test_xtc_builds_combo_stack_with_xtc_before_sample() -> None:
    backend, rec = make_backend()
    params = SamplingParams(
        max_tokens=5, temperature=0.8, top_k=20, xtc_probability=0.5, xtc_threshold=0.1, temperature_last=True
    )
    add(backend, Submit("a", params, prompt="hi"))
    job = rec.inner.pending_jobs[0]
    assert isinstance(job.sampler, fx.CustomSampler)
    names = [type(step).__name__ for step in job.sampler.steps]
    assert names == [
        "SS_LogitBias",
        "SS_RepP",
        "SS_PresFreqP",
        "SS_DRY",
        "SS_Temperature",
        "SS_MinP",
        "SS_TopK",
        "SS_TopP",
        "SS_Temperature",
        "SS_XTC",
        "SS_Sample",
    ]
    temps = [step.args[0] for step in job.sampler.steps if isinstance(step, fx.SS_Temperature)]
    assert temps == [1.0, 0.8]  # temperature last
    xtc = job.sampler.steps[9]
    assert xtc.args == (0.5, 0.1) and xtc.kwargs["tokenizer"] is not None
    # Greedy: the stack is an argmax, on which XTC does nothing; ComboSampler stays.
    add(backend, Submit("b", SamplingParams(max_tokens=5, temperature=0.0, xtc_probability=1.0), prompt="hi"))
    assert isinstance(rec.inner.pending_jobs[1].sampler, fx.ComboSampler)


def test_banned_strings_reach_the_job_and_never_appear() -> None:
    """Job's banned strings (job.py:1136-1159) as the fake models them: "Paris" is held
    while it may be forming, rewound when complete, and its first token banned there."""
    backend, rec = make_backend(script=fx.reply("Paris is big"))
    add(backend, raw("a", "x", max_tokens=12))
    add(backend, raw("b", "x", max_tokens=12, banned_strings=("PARIS",)))
    jobs = rec.inner.pending_jobs
    assert jobs[1].banned_strings == ["paris"]
    events = run(backend)
    assert text_of(events, "a") == "Paris is big"
    text = text_of(events, "b")
    assert "paris" not in text.lower() and text, text
    fin = finished(events, "b")
    assert sum(e.num_tokens for e in of(events, "b") if isinstance(e, TokenDelta)) == fin.completion_tokens


def test_add_bos_per_request_overrides_the_setting() -> None:
    backend, rec = make_backend()
    add(backend, Submit("a", SamplingParams(max_tokens=4), prompt="hello", add_bos=False))
    add(backend, Submit("b", SamplingParams(max_tokens=4), prompt="hello", add_bos=True))
    a, b = rec.inner.pending_jobs
    assert a.input_ids == [*b"hello"] and b.input_ids == [fx.BOS, *b"hello"]


def test_chat_messages_use_the_model_template() -> None:
    backend, rec = make_backend()
    msgs = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"))
    add(backend, Submit("a", SamplingParams(max_tokens=4), messages=msgs))
    add(backend, Submit("b", SamplingParams(max_tokens=4), messages=msgs, add_generation_prompt=False))
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    expect_b = fx.Tokenizer().encode(rendered, encode_special_tokens=True).tolist()[0]
    expect_a = fx.Tokenizer().encode(rendered + "<|im_start|>assistant\n", encode_special_tokens=True)
    a, b = rec.inner.pending_jobs
    assert a.input_ids == expect_a.tolist()[0] and b.input_ids == expect_b


def test_raw_prompt_gets_bos_unless_disabled() -> None:
    backend, rec = make_backend()
    add(backend, raw("a", "hello"))
    assert rec.inner.pending_jobs[0].input_ids == [fx.BOS, *b"hello"]
    backend2, rec2 = make_backend(dataclasses.replace(CFG, add_bos=False))
    add(backend2, raw("a", "hello"))
    assert rec2.inner.pending_jobs[0].input_ids == list(b"hello")


def test_empty_raw_prompt_is_rejected() -> None:
    backend, _ = make_backend(dataclasses.replace(CFG, add_bos=False))
    with pytest.raises(RequestRejected) as e:
        add(backend, raw("a", ""))
    assert e.value.code is ErrorCode.INVALID_REQUEST


# ------------------------------------------------------------------ lifecycle


def test_abort_frees_the_pages_and_silences_the_request() -> None:
    backend, rec = make_backend(script=fx.reply("x" * 50), max_chunk_size=256)
    add(backend, raw("a", _letters(1000)))
    add(backend, raw("b", "other"))
    events = backend.step()
    backend.abort("a")
    backend.abort("never-seen")
    assert len(backend.active_ids()) == 1
    events = [e for e in events if e.request_id != "a"] + run(backend)
    assert not of(events, "a")
    check_lifecycle(events, "b")
    pt = rec.inner.pagetable
    assert pt.num_unreferenced_pages() == pt.max_pages


def test_queued_job_gets_started_when_the_engine_starts_it() -> None:
    backend, _ = make_backend(script=fx.reply("ab"), max_batch_size=1)
    add(backend, raw("a", "one"))
    add(backend, raw("b", "two"))
    first = backend.step()
    assert [type(e) for e in of(first, "b")] == []  # waiting for a batch slot
    events = first + run(backend)
    check_lifecycle(events, "a")
    check_lifecycle(events, "b")


def test_calls_from_another_thread_are_refused() -> None:
    backend, _ = make_backend()
    add(backend, raw("a", "x"))
    caught: list[BaseException] = []

    def other() -> None:
        try:
            backend.step()
        except RuntimeError as e:
            caught.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert caught and "thread" in str(caught[0])


# ------------------------------------------------------------------ faults in a step


def _faulty(**cfg: Any) -> tuple[ExLlamaV3Backend, RecordingGenerator]:
    return make_backend(
        dataclasses.replace(CFG, **cfg), script=fx.reply("fine"), max_chunk_size=256, cache_tokens=6144
    )


def _step_until(backend: ExLlamaV3Backend, done: Any, limit: int = 200) -> list[Any]:
    events: list[Any] = []
    for _ in range(limit):
        events += backend.step()
        if done(events):
            return events
    raise AssertionError("condition never met")


def test_a_fault_fails_the_started_jobs_and_carries_the_queued_ones_to_a_new_generator() -> None:
    backend, rec = _faulty()
    first = rec.inner
    add(backend, raw("decoding", "x", max_tokens=50))
    add(backend, raw("prefilling", _letters(1000)))
    events = _step_until(backend, lambda ev: any(isinstance(e, TokenDelta) for e in ev))
    # enqueued right before the step that faults: still in the engine's queue then
    add(backend, raw("waiting", "y", max_tokens=5))
    assert [j.identifier for j in first.pending_jobs] == ["waiting"]
    first.fail_next_iterate = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    events = backend.step()
    assert rec.inner is not first and first.closed  # a new generator over the same cache
    assert rec.inner.cache is first.cache and rec.inner.model is first.model
    errors = {e.request_id: e for e in events if isinstance(e, RequestError)}
    assert sorted(errors) == ["decoding", "prefilling"]
    assert all(e.code is ErrorCode.OVERLOADED and "out of memory" in e.message for e in errors.values())
    assert sorted(backend.active_ids()) == ["waiting"]
    events = run(backend)
    check_lifecycle(events, "waiting")
    assert text_of(events, "waiting") == "fine"


def test_non_finite_logits_fail_the_batch_as_internal_errors() -> None:
    backend, rec = _faulty()
    rec.inner.model.nonfinite = lambda prompt: b"poison" in bytes(t for t in prompt if t < 256)
    add(backend, raw("good", "hello", max_tokens=3))
    add(backend, raw("bad", "poison", max_tokens=3))
    events = run(backend)
    errors = {e.request_id: e for e in events if isinstance(e, RequestError)}
    # the exception escapes iterate(): the batch's results of that call are lost
    assert sorted(errors) == ["bad", "good"]
    assert all(e.code is ErrorCode.INTERNAL and "NonFiniteLogits" in e.message for e in errors.values())
    add(backend, raw("after", "hello", max_tokens=3))
    assert text_of(run(backend), "after") == "fin"


def test_a_gpu_that_no_longer_runs_work_gives_up() -> None:
    backend, rec = _faulty()
    add(backend, raw("a", "x"))
    rec.inner.model.device_error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(EngineFailed, match=r"no longer runs work.*illegal memory access"):
        backend.step()


def test_repeated_faults_within_the_window_give_up() -> None:
    backend, rec = _faulty(max_engine_faults=2, engine_fault_window=60.0)
    add(backend, raw("a", "x"))
    backend.step()
    rec.inner.fail_next_iterate = RuntimeError("boom 1")
    assert [type(e) for e in backend.step()] == [RequestError]
    add(backend, raw("b", "x"))
    backend.step()
    rec.inner.fail_next_iterate = RuntimeError("boom 2")
    with pytest.raises(EngineFailed, match=r"2 engine faults within 60 s.*boom 2"):
        backend.step()


def test_faults_older_than_the_window_are_forgotten() -> None:
    backend, rec = _faulty(max_engine_faults=2, engine_fault_window=0.05)
    for i in range(3):
        add(backend, raw(f"r{i}", "x"))
        backend.step()
        rec.inner.fail_next_iterate = RuntimeError(f"boom {i}")
        assert [type(e) for e in backend.step()] == [RequestError]
        time.sleep(0.1)


def test_a_requeued_job_waiting_in_the_engine_fails_rather_than_restarting() -> None:
    # max_rq_tokens 256: the job re-queues (job.py:879) and waits in pending_jobs having
    # streamed text; starting it over would repeat that text.
    backend, rec = _faulty(max_rq_tokens=256)
    rec.inner.model.script = fx.reply("z" * 600)
    add(backend, raw("long", "x", max_tokens=600))
    _step_until(backend, lambda ev: any(r.get("requeue") for r in rec.results), limit=1000)
    assert [j.identifier for j in rec.inner.pending_jobs] == ["long"]
    rec.inner.fail_next_iterate = RuntimeError("boom")
    (err,) = backend.step()
    assert isinstance(err, RequestError) and err.request_id == "long"
    assert not backend.active_ids() and rec.num_remaining_jobs() == 0


def test_close_cancels_and_releases() -> None:
    backend, rec = make_backend()
    add(backend, raw("a", "x"))
    backend.close()
    assert rec.inner.closed and rec.num_remaining_jobs() == 0 and len(backend.active_ids()) == 0


# ------------------------------------------------------------------ engine orders the fake does not produce


class _Canned:
    """A generator replaying hand-written 1.6.5-shaped result lists, for orders that need
    cache eviction or features the fake does not model."""

    def __init__(self, script: list[list[dict[str, Any]]]) -> None:
        self.script = script
        self.jobs: list[Any] = []

    def enqueue(self, job: Any) -> int:
        self.jobs.append(job)
        return len(self.jobs) - 1

    def cancel(self, job: Any) -> None:
        pass

    def iterate(self) -> list[dict[str, Any]]:
        out = self.script.pop(0)
        for r in out:
            r["job"] = self.jobs[r["serial"]]
        return out

    def num_remaining_jobs(self) -> int:
        return len(self.script)


def _canned_backend(script: list[list[dict[str, Any]]]) -> ExLlamaV3Backend:
    h = dataclasses.replace(fx.make_handle(), generator=_Canned(script))
    return ExLlamaV3Backend(h, CFG)


def _stream(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "stage": "streaming",
        "serial": 0,
        "eos": False,
        "text": text,
        "token_ids": fx.FakeTensor([1]),
        **extra,
    }


def test_prefill_after_requeue_or_first_token_is_not_progress() -> None:
    eos = {
        "eos": True,
        "eos_reason": "max_new_tokens",
        "new_tokens": 3,
        "prompt_tokens": 600,
        "cached_tokens": 512.0,  # some engine paths produce a float
        "cached_pages": 2,
        "time_enqueued": 0.5,
        "time_prefill": 0.25,
        "time_generate": 2.0,
    }
    backend = _canned_backend(
        [
            [{"stage": "started", "serial": 0, "eos": False}],
            [{"stage": "prefill", "serial": 0, "eos": False, "curr_progress": 599, "max_progress": 599}],
            [_stream("A"), {"stage": "prefill", "serial": 0, "eos": False, "curr_progress": 300}],
            [_stream("B", requeue=True)],
            [{"stage": "started", "serial": 0, "eos": False}],
            [{"stage": "prefill", "serial": 0, "eos": False, "curr_progress": 601, "max_progress": 601}],
            [_stream("C", **eos)],
        ]
    )
    add(backend, raw("a", _letters(600)))
    events = run(backend)
    check_lifecycle(events, "a")
    assert progress(events, "a") == [0, 599, 600]
    assert [e.text for e in of(events, "a") if isinstance(e, TokenDelta)] == ["A", "B", "C"]
    fin = finished(events, "a")
    assert type(fin.cached_tokens) is int and fin.cached_tokens == 512
    assert (fin.time_queued, fin.time_prefill, fin.time_decode) == (0.5, 0.25, 2.0)
    assert fin.finish_reason is FinishReason.LENGTH


def test_empty_text_tokens_are_credited_to_the_next_delta() -> None:
    backend = _canned_backend(
        [
            [{"stage": "started", "serial": 0, "eos": False}, _stream("")],
            [_stream("", token_ids=fx.FakeTensor([1, 2]))],
            [_stream("xy", eos=True, eos_reason="stop_string", new_tokens=4, cached_tokens=0)],
        ]
    )
    add(backend, raw("a", "q"))
    events = run(backend)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert deltas == [TokenDelta("a", "xy", 4)]
    assert isinstance(events[-1], Finished) and events[-1].finish_reason is FinishReason.STOP


def test_results_of_unknown_serials_are_ignored() -> None:
    backend = _canned_backend(
        [[{"stage": "started", "serial": 0, "eos": False}, _stream("x"), {**_stream("y"), "serial": 1}]]
    )
    add(backend, raw("a", "q"))
    backend._h.generator.jobs.append(object())  # type: ignore[attr-defined]
    assert isinstance(backend.step()[0], Started)


def test_progress_events_carry_milliseconds_since_start() -> None:
    backend, _ = make_backend(script=fx.reply("Hi"), max_chunk_size=256)
    add(backend, raw("a", _letters(600)))
    events = run(backend)
    prog = [e for e in of(events, "a") if isinstance(e, PrefillProgress)]
    assert prog[0].time_ms == 0
    assert all(isinstance(p.time_ms, int) and p.time_ms >= 0 for p in prog)


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def test_reservation_is_what_a_job_takes_in_whole_pages() -> None:
    backend, rec = make_backend(dataclasses.replace(CFG, max_rq_tokens=300), cache_tokens=8192)
    prepared = checked_prepare(backend, chat("r", "hello", max_tokens=5000))
    n = prepared.prompt_tokens
    # Output chunking: the prompt plus completion up to the page boundary past
    # n - 1 + max_rq_tokens (job.py:1295-1306).
    assert backend.reservation(prepared) == _pages(n - 1 + 300)
    # A completion shorter than max_rq_tokens is reserved whole, plus one token (job.py:1318-1322):
    # passing max_rq_tokens would make 1.6.5 reserve the whole window anyway.
    short = checked_prepare(backend, chat("s", "hello", max_tokens=10))
    assert backend.reservation(short) == _pages(n + 10 + 1)
    unchunked, _ = make_backend(dataclasses.replace(CFG, output_chunking=False), cache_tokens=8192)
    p2 = checked_prepare(unchunked, chat("r", "hello", max_tokens=10))
    assert unchunked.reservation(p2) == _pages(n + 10 + 1)
    assert backend.info.kv_cache_tokens == 8192 and backend.info.max_batch_size == 8
    # what the engine allocates is what the worker reserved
    backend.start("r", prepared, prepared.submit.params)
    backend.start("s", short, short.submit.params)
    backend.step()
    pages = {j.identifier: len(j.allocated_pages) * PAGE_SIZE for j in rec.inner.active_jobs}
    assert pages == {"r": backend.reservation(prepared), "s": backend.reservation(short)}


@pytest.mark.parametrize(
    ("drafting", "output_chunking", "max_tokens"),
    [
        ("ngram", True, 1000),
        ("ngram", False, 600),
        ("ngram", True, 600),  # max_rq_tokens would reserve as much as the whole completion: not passed
        ("draft_model", True, 40),
        ("mtp", True, 1000),
        (None, True, 255),
    ],
)
def test_the_engine_allocates_what_the_worker_reserves(
    drafting: str | None, output_chunking: bool, max_tokens: int
) -> None:
    # The draft window is reserved past the budget (job.py:1313-1322); a re-queued segment
    # takes the sequence so far plus a new window, and the reservation follows it.
    cfg = dataclasses.replace(CFG, max_rq_tokens=256, output_chunking=output_chunking)
    backend, rec = make_backend(cfg, script=fx.reply("ab" * 600), drafting=drafting, cache_tokens=8192)
    add(backend, raw("a", _letters(300), max_tokens=max_tokens))
    seen = 0
    for _ in range(2000):
        if not backend.active_ids():
            break
        backend.step()
        for job in rec.inner.active_jobs:
            seen += 1
            assert len(job.allocated_pages) * PAGE_SIZE == backend.kv_reserved(), job
    assert seen and not backend.active_ids()
    requeues = sum(1 for r in rec.results if r.get("requeue"))
    # 300 + 1000 tokens: segments end at the page boundaries past 299 + 256, 768 + 256, 1024 + 256
    assert requeues == (3 if output_chunking and max_tokens == 1000 else 0)


def test_choices_start_from_one_tokenization() -> None:
    backend, _ = make_backend()
    prepared = checked_prepare(backend, chat("r", "hello", max_tokens=3))
    for i in range(3):
        backend.start(f"r-{i}", prepared, prepared.submit.params)
    assert sorted(backend.active_ids()) == ["r-0", "r-1", "r-2"]
    assert backend.kv_reserved() == 3 * backend.reservation(prepared)
    events = run(backend)
    finished = [e for e in events if isinstance(e, Finished)]
    assert sorted(f.request_id for f in finished) == ["r-0", "r-1", "r-2"]
    assert backend.kv_reserved() == 0


def test_a_requeued_segment_that_finds_no_pages_waits_in_the_engine_and_is_counted() -> None:
    # Output chunking over-commits the cache: each re-queued segment holds the sequence so far
    # plus a new window (job.py:1194-1261, 1295-1306). In 8 pages two long completions outgrow
    # it; the re-queued one waits in pending_jobs (generator.py:2182-2205) until the other ends,
    # silent meanwhile, and its reservation already counts the pages it waits for.
    cfg = dataclasses.replace(CFG, max_rq_tokens=256)
    reply = "q" * 1500
    backend, rec = make_backend(cfg, script=fx.reply(reply), cache_tokens=2048, max_chunk_size=256)
    add(backend, raw("a", _letters(200), max_tokens=1500))
    add(backend, raw("b", _letters(199) + "!", max_tokens=1500))
    events: list[Any] = []
    waited: list[str] = []
    requeued: set[str] = set()  # re-queued in the last step; started by the next iterate() if it fits
    for _ in range(5000):
        if not backend.active_ids():
            break
        over = backend.kv_reserved() > backend.info.kv_cache_tokens
        step = backend.step()
        events += step
        pending = {str(j.identifier) for j in rec.inner.pending_jobs}
        for rid in pending & requeued:  # an iterate() passed without starting it
            waited.append(rid)
            assert over  # the loop saw the cache over-committed: it admitted nothing meanwhile
            assert not of(step, rid)
        requeued = pending
    assert waited, "no re-queued segment had to wait"
    for rid, n in (("a", 1500), ("b", 1500)):
        check_lifecycle(events, rid)
        assert text_of(events, rid) == reply[:n]


def test_dry_reaches_combo_sampler_and_the_xtc_stack() -> None:
    backend, rec = make_backend()
    params = SamplingParams(
        max_tokens=4, temperature=0.8, dry_multiplier=0.8, dry_range=-1, dry_sequence_breakers=("\n", "b")
    )
    add(backend, Submit("a", params, prompt="hi"))
    s = rec.inner.pending_jobs[0].sampler.settings
    pieces = fx.Tokenizer().get_id_to_piece_list(True)
    expected = frozenset(t for t, piece in enumerate(pieces) if "\n" in piece or "b" in piece)
    assert (s["dry_multiplier"], s["dry_base"], s["dry_allowed_length"], s["dry_range"]) == (0.8, 1.75, 2, 0)
    assert s["dry_sequence_breakers"] == expected and ord("b") in expected
    # Absent breakers: None, ExLlamaV3's default set from the tokenizer.
    add(
        backend,
        Submit(
            "b", msgspec.structs.replace(params, dry_sequence_breakers=None, xtc_probability=0.5), prompt="hi"
        ),
    )
    stack = rec.inner.pending_jobs[1].sampler.steps
    dry = next(step for step in stack if isinstance(step, fx.SS_DRY))
    assert dry.args == (0.8, 1.75, 2, 0, None)
