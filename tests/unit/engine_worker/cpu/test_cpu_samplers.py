"""The local-LLM sampler steps of the CPU engine (``engine_worker.cpu.sampling``),
each against a value computed by hand from ExLlamaV3 1.6.5's definition
(``SS_XTC``, ``SS_Temperature`` on probabilities, ``apply_rep_pens``'s sustain and
decay ranges), and through the engine on the tiny model: banned tokens never
appear, ``ban_eos_token`` runs to the limit, ``add_bos_token`` places BOS."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engine_worker.cpu.sampling import TokenSampler, filtered_probs, xtc  # noqa: E402
from protocol.messages import FinishReason, SamplingParams, Submit  # noqa: E402

EOS = 2  # <|im_end|> in SmolLM2's vocabulary


def _probs(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_xtc_at_probability_one_removes_every_top_choice_but_the_least_likely() -> None:
    # 0.5, 0.3 and 0.15 reach 0.1: the first two go, 0.15 stays with 0.05.
    out = xtc(_probs([0.5, 0.3, 0.15, 0.05]), 1.0, 0.1, None)
    assert out.tolist() == pytest.approx([0.0, 0.0, 0.75, 0.25])


def test_xtc_averages_the_roll() -> None:
    # p = 0.5: half the time [0, 0, .75, .25], half [.5, .3, .15, .05]; the mean.
    out = xtc(_probs([0.5, 0.3, 0.15, 0.05]), 0.5, 0.1, None)
    assert out.tolist() == pytest.approx([0.25, 0.15, 0.45, 0.15])


def test_xtc_leaves_protected_tokens_and_a_single_candidate_alone() -> None:
    protected = torch.tensor([True, False, False, False])
    out = xtc(_probs([0.5, 0.3, 0.15, 0.05]), 1.0, 0.1, protected)
    # Token 0 is held out: of 1 and 2, only 1 goes; its mass goes to the rest.
    assert out.tolist() == pytest.approx([0.5 / 0.7, 0.0, 0.15 / 0.7, 0.05 / 0.7])
    assert xtc(_probs([0.9, 0.05, 0.05]), 1.0, 0.1, None).tolist() == pytest.approx([0.9, 0.05, 0.05])


def test_xtc_sampling_never_draws_an_excluded_token() -> None:
    logits = torch.log(_probs([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3, xtc_probability=1.0, xtc_threshold=0.1)
    sampler = TokenSampler(params, [], 4, [])
    drawn = {sampler.sample(logits) for _ in range(200)}
    assert drawn <= {2, 3} and drawn == {2, 3}


def test_xtc_does_nothing_greedy() -> None:
    logits = torch.log(_probs([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(max_tokens=1, temperature=0.0, xtc_probability=1.0, xtc_threshold=0.1)
    assert TokenSampler(params, [], 4, []).sample(logits) == 0


def test_temperature_last_filters_at_temperature_one() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    # min_p 0.3 at temperature 1 keeps tokens 0 and 1 (ratios e^-1 = 0.37, e^-2 = 0.14).
    first = filtered_probs(logits, 2.0, 0, 1.0, 0.3)
    last = filtered_probs(logits, 2.0, 0, 1.0, 0.3, temperature_last=True)
    # Temperature first: at T=2 the ratios are e^-0.5, e^-1, e^-1.5: tokens 0..2 survive.
    assert (first > 0).tolist() == [True, True, True, False]
    # Temperature last: tokens 0 and 1 survive at T=1, then p ** (1 / 2), renormalised.
    kept = torch.softmax(logits[:2], dim=-1).pow(0.5)
    assert last.tolist() == pytest.approx([*(kept / kept.sum()).tolist(), 0.0, 0.0])


def _penalised(params: SamplingParams, prompt: list[int], logits: list[float]) -> list[float]:
    return TokenSampler(params, prompt, len(logits), []).process(torch.tensor(logits)).tolist()


def test_penalty_range_and_decay_weigh_by_distance() -> None:
    # History 0, 1, 2 (2 is the last); range 1, decay 2: token 2 weight 1, token 1
    # weight 1 - (2 - 1) / 2 = 0.5, token 0 weight 1 - (3 - 1) / 2 = 0.
    params = SamplingParams(max_tokens=1, repetition_penalty=2.0, penalty_range=1, repetition_decay=2)
    out = _penalised(params, [0, 1, 2], [4.0, 4.0, 4.0, 4.0])
    assert out == pytest.approx([4.0, 4.0 * 0.5 + 2.0 * 0.5, 2.0, 4.0])


def test_penalty_range_without_decay_is_a_window() -> None:
    params = SamplingParams(max_tokens=1, repetition_penalty=2.0, penalty_range=2)
    assert _penalised(params, [0, 1, 2], [4.0, -4.0, 4.0, 4.0]) == pytest.approx([4.0, -8.0, 2.0, 4.0])
    # Range 0 without decay penalises nothing (ExLlamaV3's SS_RepP is then a no-op).
    params = SamplingParams(max_tokens=1, repetition_penalty=2.0, penalty_range=0)
    assert _penalised(params, [0, 1, 2], [4.0, -4.0, 4.0, 4.0]) == pytest.approx([4.0, -4.0, 4.0, 4.0])


def test_windowed_frequency_counts_output_tokens_in_range() -> None:
    params = SamplingParams(max_tokens=4, frequency_penalty=1.0, presence_penalty=0.5, penalty_range=2)
    sampler = TokenSampler(params, [3, 3], 4, [])
    for token in (1, 1, 2):
        sampler.observe(token)
    # Window: the last 2 of [3, 3, 1, 1, 2] -> 1, 2; the prompt's 3s are not output.
    out = sampler.process(torch.zeros(4)).tolist()
    assert out == pytest.approx([0.0, -1.5, -1.5, 0.0])


def test_banned_tokens_and_ban_eos_are_masked_greedy_too() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, banned_tokens=(0,), ban_eos_token=True)
    sampler = TokenSampler(params, [], 4, [3], eos_ids=[1])
    assert sampler.sample(torch.tensor([9.0, 8.0, 7.0, 1.0])) == 2
    x = sampler.process(torch.tensor([9.0, 8.0, 7.0, 1.0]))
    assert math.isinf(x[0]) and math.isinf(x[1]) and x[2] == 7.0


# ---------------------------------------------------------------- through the engine


def test_banned_tokens_never_appear(
    tiny: Any, tokenizer: Any, make_backend: Any, run_one: Any, raw: Any
) -> None:
    backend = make_backend(tiny)
    plain = run_one(backend, raw("a", "Hello", max_tokens=6))
    out = tokenizer(plain.text, add_special_tokens=False)["input_ids"]
    banned = tuple(sorted(set(out)))
    r = run_one(backend, raw("b", "Hello", max_tokens=6, banned_tokens=banned))
    again = tokenizer(r.text, add_special_tokens=False)["input_ids"]
    assert r.text != plain.text and not set(again) & set(banned)


def test_ban_eos_token_runs_to_the_limit(tiny: Any, make_backend: Any, run_one: Any, raw: Any) -> None:
    backend = make_backend(tiny)
    bias = {EOS: 100.0}
    assert run_one(backend, raw("a", "Hello", logit_bias=bias)).finished.completion_tokens == 1
    r = run_one(backend, raw("b", "Hello", logit_bias=bias, ban_eos_token=True, max_tokens=5))
    assert (r.finished.completion_tokens, r.finished.finish_reason) == (5, FinishReason.LENGTH)


def test_add_bos_token_places_or_removes_bos(tokenizer: Any, tiny: Any, make_backend: Any) -> None:
    backend = make_backend(tiny)
    bos = tokenizer.bos_token_id
    with_bos = backend.prepare(Submit("a", SamplingParams(max_tokens=2), prompt="Hi", add_bos=True))
    without = backend.prepare(Submit("b", SamplingParams(max_tokens=2), prompt="Hi", add_bos=False))
    assert backend.prompt_ids(with_bos)[0] == bos
    assert backend.prompt_ids(without)[:1] != [bos]
    assert backend.prompt_ids(with_bos)[1:] == backend.prompt_ids(without)
    # False adds nothing and removes nothing: a BOS the text writes itself stays (as
    # ExLlamaV3's encode(add_bos=False) keeps it; SmolLM2's BOS is <|im_start|>, which
    # every rendered ChatML prompt starts with).
    written = Submit("c", SamplingParams(max_tokens=2), prompt=f"{tokenizer.bos_token}Hi", add_bos=False)
    assert backend.prompt_ids(backend.prepare(written))[0] == bos


# ---------------------------------------------------------------- banned strings


def test_match_is_partial_strings_match() -> None:
    from engine_worker.requests.banned import match

    assert match("the capital is par", ("paris",)) == -2  # runs off the end: hold
    assert match("the capital is paris.", ("paris",)) == 15
    assert match("the capital is rome", ("paris",)) == -1
    # An earlier partial start wins over a later complete one: hold.
    assert match("abcab", ("abcabx", "cab")) == -2


def test_banned_strings_guard_rewinds_to_where_the_match_began() -> None:
    from engine_worker.requests.banned import BannedStrings

    guard = BannedStrings(("Paris",))
    assert guard.feed(" The", 1, 0, "s0").emit == " The"
    held = guard.feed(" Pa", 2, 1, "s1")
    assert held.emit == "" and held.rewind is None
    verdict = guard.feed("ris", 3, 2, "s2")
    assert verdict.rewind is not None and (verdict.rewind.position, verdict.rewind.state) == (1, "s1")
    assert verdict.emit == "" and guard.blocked() == [2]
    # The token sampled at the checkpoint instead leads into the banned string again: both are banned.
    assert guard.feed(" PARIS", 4, 1, "s1").rewind is not None
    assert guard.blocked() == [2, 4]
    assert guard.feed(" Rome", 5, 1, "s1").emit == " Rome" and guard.blocked() == []


def test_banned_strings_never_appear(
    scripted: Any, tokenizer: Any, make_backend: Any, run_one: Any, raw: Any
) -> None:
    """The script writes " Paris" after the prompt; banned (in any case), the
    engine rewinds and the answer goes on without it."""
    from tests.unit.engine_worker.cpu.test_cpu_engine import chain, ids

    prompt = "The capital of France is"
    answer = ids(tokenizer, " Paris! Nice town", special=False)
    scripted.model.setup_script(chain(ids(tokenizer, prompt)[-1], answer))
    backend = make_backend(scripted)
    plain = run_one(backend, raw("a", prompt, max_tokens=6))
    assert plain.text.startswith(" Paris")
    r = run_one(backend, raw("b", prompt, max_tokens=6, banned_strings=("paris",)))
    assert "paris" not in r.text.lower() and r.text, r.text
    # A two-token string later in the answer: the text before it goes out, the rest is resampled.
    r = run_one(backend, raw("c", prompt, max_tokens=6, banned_strings=("NICE TOWN",)))
    assert r.text.startswith(" Paris!") and "nice town" not in r.text.lower()
    assert sum(d.num_tokens for d in r.deltas) == r.finished.completion_tokens
    assert sum(d.num_tokens for d in r.deltas) == r.finished.completion_tokens


def test_banned_strings_refused_with_logprobs(tiny: Any, make_backend: Any) -> None:
    from engine_worker.admission import checked_prepare
    from engine_worker.backend import RequestRejected

    backend = make_backend(tiny)
    with pytest.raises(RequestRejected) as e:
        checked_prepare(
            backend, Submit("a", SamplingParams(max_tokens=2, banned_strings=("x",), logprobs=1), prompt="Hi")
        )
    assert e.value.param == "banned_strings"


# ---------------------------------------------------------------- DRY


def test_dry_charges_the_token_that_would_extend_a_repeat() -> None:
    """Context 1 2 3 9 1 2 3, read backwards 3 2 1 9 3 2 1: only at k = 4 does the
    suffix repeat (run 3: "1 2 3"), and the token that followed the earlier "1 2 3"
    was 9, which loses 0.8 * 1.75 ** (3 - 2) (float32 values, as the kernel takes them)."""
    params = SamplingParams(max_tokens=1, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    sampler = TokenSampler(params, [1, 2, 3, 9, 1, 2, 3], 10, [])
    out = sampler.process(torch.zeros(10))
    expected = torch.zeros(10)
    expected[9] = -float(torch.tensor(0.8, dtype=torch.float32)) * float(
        torch.tensor(1.75, dtype=torch.float32)
    )
    assert out.tolist() == pytest.approx(expected.tolist())


def test_dry_repeats_do_not_span_a_breaker_and_breakers_are_never_charged() -> None:
    params = SamplingParams(max_tokens=1, dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=1)
    # Context 5 6 5 6, backwards 6 5 6 5: at k = 2 the run is 2 ("5 6"), charging 5 (which followed
    # the earlier "5 6") with 2 ** (2 - 1).
    plain = TokenSampler(params, [5, 6, 5, 6], 8, []).process(torch.zeros(8))
    assert plain[5] == pytest.approx(-2.0)
    # With 6 a breaker, no repeat reaches past it (the last token): nothing is charged.
    breakers = torch.zeros(8, dtype=torch.bool)
    breakers[6] = True
    broken = TokenSampler(params, [5, 6, 5, 6], 8, [], breakers=breakers).process(torch.zeros(8))
    assert broken.tolist() == [0.0] * 8
    # With 5 a breaker the runs stop one back (at the breaker), and 5 itself, though charged with a
    # run of 1, is never penalised.
    breakers = torch.zeros(8, dtype=torch.bool)
    breakers[5] = True
    assert TokenSampler(params, [5, 6, 5, 6], 8, [], breakers=breakers).process(torch.zeros(8))[5] == 0.0


def test_dry_off_changes_nothing() -> None:
    logits = torch.randn(10)
    for params in (
        SamplingParams(max_tokens=1, dry_multiplier=0.0),
        SamplingParams(max_tokens=1, dry_multiplier=0.8, dry_base=0.9),  # a base below 1: off
    ):
        assert torch.equal(TokenSampler(params, [1, 2, 1, 2, 1], 10, []).process(logits), logits)


def test_dry_exponent_clamp_is_exllamav3s() -> None:
    from engine_worker.cpu.sampling import dry_max_exponent

    assert dry_max_exponent(2.0) == 128  # float32 gives exactly 128 (ExLlamaV3's docstring)
    assert dry_max_exponent(1.75) == int(88.7228391 / math.log(1.75))
    assert dry_max_exponent(1.0000001) == 0


def test_dry_breakers_of_the_engine(tiny: Any, tokenizer: Any, make_backend: Any) -> None:
    backend = make_backend(tiny)
    default = backend._tables.dry_breakers(None)
    dot = tokenizer.convert_tokens_to_ids(".")
    assert default is not None and bool(default[dot])
    colon = backend._tables.dry_breakers((":",))
    assert colon is not None and not bool(colon[dot]) and bool(colon[tokenizer.convert_tokens_to_ids(":")])
    assert backend._tables.dry_breakers(()) is None
