"""Unit tests of the CPU engine's parts: n-gram drafter, detokenizer, stop strings,
sampling, KV cache and prefix cache."""

from __future__ import annotations

import math

import pytest
import torch

from engine_worker.cpu.kv_cache import SequenceKV, kv_nbytes
from engine_worker.cpu.ngram import NgramDrafter
from engine_worker.cpu.prefix_cache import PrefixCache, common_prefix_length
from engine_worker.cpu.sampling import TokenSampler, filtered_probs
from engine_worker.requests.detokenize import IncrementalDetokenizer
from protocol.messages import SamplingParams

# ---------------------------------------------------------------- n-gram drafter


def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    # "1 2" occurs at 0 (followed by 3 4) and at 5 (followed by 8 9); the latest wins.
    drafter = NgramDrafter([1, 2, 3, 4, 7, 1, 2, 8, 9, 6, 1, 2], min_n=2, max_n=3)
    assert drafter.propose(2) == [8, 9]
    assert drafter.propose(10) == [8, 9, 6, 1, 2]


def test_ngram_prefers_longer_match() -> None:
    # The 3-gram "5 1 2" only occurs at 0 (followed by 3); the 2-gram "1 2" later at 5 (followed by 9).
    drafter = NgramDrafter([5, 1, 2, 3, 0, 1, 2, 9, 5, 1, 2], min_n=2, max_n=3)
    assert drafter.propose(1) == [3]
    short = NgramDrafter([5, 1, 2, 3, 0, 1, 2, 9, 5, 1, 2], min_n=2, max_n=2)
    assert short.propose(1) == [9]


def test_ngram_no_match_and_incremental_observe() -> None:
    drafter = NgramDrafter([1, 2, 3], min_n=2, max_n=4)
    assert drafter.propose(4) == []
    for token in (1, 2):
        drafter.observe(token)
    assert drafter.propose(4) == [3, 1, 2]
    assert drafter.propose(0) == []
    assert len(drafter) == 5


# ---------------------------------------------------------------- detokenizer


def test_detokenizer_pieces_are_complete_utf8(tokenizer: object) -> None:
    text = "Grüße aus Köln 🦙🦙 — 東京タワー, naïve café ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    single = [tokenizer.decode([i]) for i in ids]  # type: ignore[attr-defined]
    assert any("\ufffd" in s for s in single), "precondition: some character is split across tokens"
    detok = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert "" in pieces  # something was held back


def test_detokenizer_context_gives_leading_space(tokenizer: object) -> None:
    prompt = tokenizer("Say hello", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    out = tokenizer(" world again", add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    detok = IncrementalDetokenizer(tokenizer, context=prompt)  # type: ignore[arg-type]
    assert "".join(detok.add(i) for i in out) + detok.flush() == " world again"


# ---------------------------------------------------------------- sampling


def _params(**kw: object) -> SamplingParams:
    kw.setdefault("max_tokens", 16)
    return SamplingParams(**kw)  # type: ignore[arg-type]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    s = TokenSampler(_params(temperature=0.0, repetition_penalty=2.0), [0, 1], 4, [])
    out = s.process(logits)
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0]
    s.observe(2)
    assert s.process(logits).tolist() == [1.0, -4.0, 0.5, -1.0]


def test_presence_and_frequency_penalties_count_output_only() -> None:
    logits = torch.zeros(4)
    s = TokenSampler(_params(presence_penalty=0.5, frequency_penalty=0.25), [3, 3], 4, [])
    assert s.process(logits).tolist() == [0.0, 0.0, 0.0, 0.0]
    for t in (1, 1, 2):
        s.observe(t)
    assert s.process(logits).tolist() == [0.0, -1.0, -0.75, 0.0]


def test_logit_bias_and_min_tokens_mask() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0])
    s = TokenSampler(_params(temperature=0.0, logit_bias={2: 10.0}, min_tokens=2), [], 3, [2])
    assert s.sample(logits) == 1  # token 2 would win with its bias, but it ends generation
    s.observe(1)
    assert s.sample(logits) == 1
    s.observe(1)
    assert s.sample(logits) == 2


def test_filters_keep_expected_support() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.count_nonzero(filtered_probs(logits, 1.0, 2, 1.0, 0.0)).item() == 2
    # top_p 0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it, so two tokens survive.
    kept = filtered_probs(logits, 1.0, 0, 0.7, 0.0)
    assert (kept > 0).tolist() == [True, True, False, False]
    assert math.isclose(float(kept[0]), 0.5 / 0.8, rel_tol=1e-5)
    # min_p 0.5: tokens below 0.25 are dropped.
    assert (filtered_probs(logits, 1.0, 0, 1.0, 0.5) > 0).tolist() == [True, True, False, False]
    # A tiny top_p still keeps the most likely token.
    assert (filtered_probs(logits, 1.0, 0, 1e-6, 0.0) > 0).tolist() == [True, False, False, False]


def test_seeded_sampling_reproduces_and_follows_distribution() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1]))

    def draws(seed: int) -> list[int]:
        s = TokenSampler(_params(temperature=1.0, seed=seed), [], 3, [])
        return [s.sample(logits) for _ in range(2000)]

    a, b = draws(7), draws(7)
    assert a == b
    assert draws(8) != a
    freq = [a.count(t) / len(a) for t in range(3)]
    assert abs(freq[0] - 0.6) < 0.05 and abs(freq[1] - 0.3) < 0.05 and abs(freq[2] - 0.1) < 0.03


def test_sample_scored_draws_like_sample_and_scores_the_filtered_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = _params(temperature=0.5, min_p=0.2, seed=1)
    scored, plain = TokenSampler(params, [], 4, []), TokenSampler(params, [], 4, [])
    probs = filtered_probs(logits, 0.5, 0, 1.0, 0.2)
    assert (probs > 0).tolist() == [True, True, False, False]
    for _ in range(50):
        s = scored.sample_scored(logits, 3)
        assert s.token == plain.sample(logits)
        assert math.isclose(s.logprob, math.log(float(probs[s.token])), abs_tol=1e-6)
        # Tokens min_p removed are not alternatives: two, not three.
        assert [t for t, _ in s.top] == [0, 1]
        assert [v for _, v in s.top] == pytest.approx([math.log(float(probs[0])), math.log(float(probs[1]))])


def test_grammar_mask_and_min_tokens() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    forbidden = torch.tensor([True, False, True, False])
    s = TokenSampler(_params(temperature=0.0, min_tokens=2), [], 4, [1])
    assert s.sample(logits, forbidden) == 3  # 0 and 2 forbidden, 1 an end token before min_tokens
    # When the grammar allows only end tokens, it wins over min_tokens.
    only_end = torch.tensor([True, False, True, True])
    assert s.sample(logits, only_end) == 1
    assert s.sample_scored(logits, 2, only_end).top == [(1, 0.0)]


# ---------------------------------------------------------------- KV cache


def test_sequence_kv_grows_truncates_seeds_and_exports() -> None:
    kv = SequenceKV(num_layers=2, kv_heads=1, head_dim=4, initial_capacity=3)
    assert (kv.length, kv.capacity) == (0, 0)
    kv.reserve(2)
    assert kv.capacity == 3
    kv.layers[1][:, :, :2] = torch.arange(16.0).view(2, 1, 2, 4)
    kv.length = 2
    kv.reserve(4)  # grows by 1.5x at least, keeping the filled positions
    assert kv.capacity == 4
    assert torch.equal(kv.layers[1][:, :, :2], torch.arange(16.0).view(2, 1, 2, 4))
    kv.truncate(1)
    assert kv.length == 1
    with pytest.raises(ValueError):
        kv.truncate(2)
    exported = kv.export()  # 1 of 4 positions used: copied to its size
    assert exported.shape == (2, 2, 1, 1, 4) and kv_nbytes(exported) == 2 * 2 * 4 * 4
    seeded = SequenceKV(num_layers=2, kv_heads=1, head_dim=4, initial_capacity=8)
    seeded.seed(exported, 1)
    assert seeded.length == 1 and torch.equal(seeded.layers[1][:, :, :1], exported[1])
    with pytest.raises(ValueError):
        SequenceKV(num_layers=3, kv_heads=1, head_dim=4, initial_capacity=1).seed(exported, 1)


def test_kv_nbytes_counts_whole_storages() -> None:
    buf = torch.zeros(2, 2, 1, 100, 4)
    view = buf[:, :, :, :10]
    assert kv_nbytes(view) == buf.numel() * 4
    assert kv_nbytes(view.clone()) == 2 * 2 * 10 * 4 * 4


# ---------------------------------------------------------------- prefix cache


def _kv(n: int, layers: int = 2) -> torch.Tensor:
    return torch.zeros(layers, 2, 1, n, 8)


BYTES_PER_TOKEN = 2 * 2 * 8 * 4  # layers * (k, v) * head_dim * float32


def test_common_prefix_length() -> None:
    t = torch.tensor
    assert common_prefix_length(t([1, 2, 3]), t([1, 2, 4])) == 2
    assert common_prefix_length(t([1, 2]), t([1, 2, 3])) == 2
    assert common_prefix_length(t([5]), t([1])) == 0
    assert common_prefix_length(t([], dtype=torch.long), t([1])) == 0


def test_prefix_cache_lookup_longest_and_capped() -> None:
    cache = PrefixCache(10**6)
    assert cache.insert([1, 2, 3, 4], _kv(4))
    assert cache.insert([1, 2, 9], _kv(3))
    hit = cache.lookup([1, 2, 3, 4, 5], max_length=10)
    assert hit is not None and hit.length == 4 and hit.entry.tokens.tolist() == [1, 2, 3, 4]
    hit = cache.lookup([1, 2, 3, 4], max_length=3)
    assert hit is not None and hit.length == 3
    assert cache.lookup([7, 1, 2], max_length=3) is None
    assert cache.bytes_used == 7 * BYTES_PER_TOKEN


def test_prefix_cache_drops_entries_the_new_sequence_extends() -> None:
    cache = PrefixCache(10**6)
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 3, 4, 5], _kv(5))
    assert len(cache) == 1 and cache.bytes_used == 5 * BYTES_PER_TOKEN
    assert not cache.insert([1, 2, 3], _kv(3))  # already covered
    assert len(cache) == 1


def test_prefix_cache_evicts_least_recently_used() -> None:
    cache = PrefixCache(10 * BYTES_PER_TOKEN)
    cache.insert([1, 1, 1, 1], _kv(4))
    cache.insert([2, 2, 2, 2], _kv(4))
    assert cache.lookup([1, 1, 9], max_length=8) is not None  # 1s are now the most recent
    cache.insert([3, 3, 3, 3], _kv(4))
    assert cache.lookup([2, 2], max_length=8) is None
    assert cache.lookup([1, 1], max_length=8) is not None
    assert cache.bytes_used == 8 * BYTES_PER_TOKEN <= cache.capacity_bytes
    assert not cache.insert(list(range(11)), _kv(11))  # larger than the whole budget
    with pytest.raises(ValueError, match="positions"):
        cache.insert([1, 2], _kv(3))


def test_prefix_cache_entries_are_found_only_under_their_salt() -> None:
    cache = PrefixCache(10**6)
    assert cache.insert([1, 2, 3, 4], _kv(4), salt="a")
    assert cache.lookup([1, 2, 3, 4, 5], max_length=10, salt="b") is None
    assert cache.lookup([1, 2, 3, 4, 5], max_length=10) is None  # unsalted is a salt of its own
    hit = cache.lookup([1, 2, 3, 4, 5], max_length=10, salt="a")
    assert hit is not None and hit.length == 4
    # The same tokens under another salt are stored beside, never covered by, salt a's entry.
    assert cache.insert([1, 2, 3, 4], _kv(4), salt="b")
    assert len(cache) == 2
