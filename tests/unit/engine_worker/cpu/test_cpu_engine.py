"""CpuBackend mechanics on a tiny random Llama (fast): events, prefix cache, abort,
stops, UTF-8, limits, seeds, drafting accounting. Expected counts are computed
from the token ids in the tests, not taken from the engine."""

from __future__ import annotations

import itertools
import math
from typing import Any

import msgspec
import pytest

from engine_worker.admission import checked_prepare
from engine_worker.backend import RequestRejected
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
from tests.fakes.cpu import add

EOS = 2  # <|im_end|> in SmolLM2's vocabulary


def ids(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def words(n: int, start: int = 0) -> str:
    return " ".join(f"item{i} is here" for i in range(start, start + n))


def chain(first: int, tokens: list[int], end: int | None = EOS) -> dict[int, int]:
    """Bigram script: first -> tokens[0] -> tokens[1] ... -> end."""
    seq = [first, *tokens] + ([end] if end is not None else [])
    assert len(set(seq[:-1])) == len(seq) - 1, "precondition: scripted tokens are distinct"
    return dict(itertools.pairwise(seq))


def check_order(r: Any, cached: int, total: int, chunk: int) -> None:
    """Started, progress (first == cached, one per chunk, last == total), deltas, Finished."""
    kinds = [type(e) for e in r.events]
    assert kinds[0] is Started and kinds[-1] is Finished
    n_progress = kinds.count(PrefillProgress)
    assert kinds[1 : 1 + n_progress] == [PrefillProgress] * n_progress
    assert set(kinds[1 + n_progress : -1]) <= {TokenDelta}
    assert r.started.prompt_tokens == total and r.started.cached_tokens == cached
    progress = r.progress
    assert n_progress == 1 + math.ceil((total - cached) / chunk)
    assert progress[0].processed == cached and progress[-1].processed == total
    expected_processed = [min(cached + i * chunk, total) for i in range(n_progress)]
    assert [p.processed for p in progress] == expected_processed
    assert all(p.total == total and p.cached == cached for p in progress)
    times = [p.time_ms for p in progress]
    assert times[0] == 0 and times == sorted(times) and all(isinstance(t, int) for t in times)
    assert all(d.text and d.num_tokens >= 1 for d in r.deltas)
    fin = r.finished
    assert sum(d.num_tokens for d in r.deltas) <= fin.completion_tokens
    assert (fin.prompt_tokens, fin.cached_tokens) == (total, cached)
    assert fin.time_queued >= 0 and fin.time_prefill > 0 and fin.time_decode >= 0


# ---------------------------------------------------------------- events


@pytest.mark.parametrize("chunk", [1, 16, 1000])
def test_event_order_and_progress_cadence(tiny, tokenizer, make_backend, run_one, raw, chunk) -> None:
    prompt = words(12)
    n = len(ids(tokenizer, prompt))
    backend = make_backend(tiny, chunk_size=chunk)
    r = run_one(backend, raw("a", prompt, max_tokens=5, ignore_eos=True))
    check_order(r, cached=0, total=n, chunk=chunk)
    assert r.finished.completion_tokens == 5
    assert r.finished.finish_reason is FinishReason.LENGTH
    assert r.finished.draft_accepted is None and r.finished.draft_rejected is None


def test_info_and_chat_template(tiny, tokenizer, make_backend, run_one) -> None:
    backend = make_backend(tiny, max_seq_len=100, draft_mode="ngram")
    assert backend.info.max_context_tokens == 100 and backend.info.drafting == "ngram"
    assert make_backend(tiny).info.drafting is None
    messages = (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there"))
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    expected = ids(tokenizer, rendered, special=False)
    submit = Submit("c", SamplingParams(max_tokens=2, temperature=0.0), messages=messages)
    r = run_one(backend, submit)
    assert r.started.prompt_tokens == len(expected)


# ---------------------------------------------------------------- prefix cache


def test_prefix_cache_reuse_counts(tiny, tokenizer, make_backend, run_one, raw) -> None:
    backend = make_backend(tiny, chunk_size=16)
    p1 = words(10)
    ids1 = ids(tokenizer, p1)
    r1 = run_one(backend, raw("1", p1, max_tokens=1))
    check_order(r1, cached=0, total=len(ids1), chunk=16)

    # The same prompt again: its whole chunks come from the cache (never the last token).
    r2 = run_one(backend, raw("2", p1, max_tokens=1))
    check_order(r2, cached=(len(ids1) - 1) // 16 * 16, total=len(ids1), chunk=16)
    assert r2.started.cached_tokens > 0

    # A longer prompt sharing p1, and one diverging halfway.
    for rid, prompt in (("3", p1 + " and then " + words(3, 50)), ("4", words(5) + " other " + words(4, 70))):
        new = ids(tokenizer, prompt)
        expected = min(lcp(new, ids1), len(new) - 1) // 16 * 16
        assert expected > 0
        r = run_one(backend, raw(rid, prompt, max_tokens=1))
        check_order(r, cached=expected, total=len(new), chunk=16)


def test_prefix_cache_reuses_whole_prompt_chunks_not_generated_tokens(
    scripted, tokenizer, make_backend, run_one, raw
) -> None:
    prompt = "Question: name three colours. Answer:"
    p_ids = ids(tokenizer, prompt)
    answer = ids(tokenizer, " red green blue", special=False)
    scripted.model.setup_script(chain(p_ids[-1], answer))
    backend = make_backend(scripted, chunk_size=4)
    r1 = run_one(backend, raw("1", prompt, max_tokens=50))
    assert r1.text == " red green blue"
    assert r1.finished.completion_tokens == len(answer) + 1  # the answer and EOS
    assert r1.finished.finish_reason is FinishReason.STOP
    # The follow-up shares the prompt and the answer; only the prompt's whole
    # chunks are reused (the answer's KV was computed by decode, not prefill).
    follow_up = prompt + " red green blue. Question: and two more?"
    new = ids(tokenizer, follow_up)
    assert lcp(new, p_ids + answer) > len(p_ids)
    expected = len(p_ids) // 4 * 4
    assert expected > 0
    r2 = run_one(backend, raw("2", follow_up, max_tokens=1))
    check_order(r2, cached=expected, total=len(new), chunk=4)


@pytest.mark.parametrize("chunk", [7, 48])
def test_output_is_the_same_with_and_without_a_prefix_cache_hit(
    shaped, tokenizer, make_backend, run_one, raw, chunk
) -> None:
    """A prompt's KV is computed chunk by chunk at fixed offsets and the cache
    reuses whole blocks (16 tokens, or the chunk when shorter), so on the
    embedded model's shape a hit changes no token (greedy and seeded) and not
    one bit of the log-probabilities. With chunks of 48 the shared prefix (85
    tokens) ends inside the second chunk, which runs through the dense weights
    (32+ tokens): the hit covers 80 and the tail's last partial block meets the
    same dense GEMM as without it (``llama.BLOCK_TOKENS``); reusing the prefix
    up to its end would compute the tail with the quantized kernels."""
    base = words(19)
    for temperature in (0.0, 1.0):
        params = {"max_tokens": 12, "temperature": temperature, "seed": 3, "ignore_eos": True, "logprobs": 2}
        cold = run_one(
            make_backend(shaped, chunk_size=chunk, prefix_cache_mb=0),
            raw("c", base + " tail and more words", **params),
        )
        warm_backend = make_backend(shaped, chunk_size=chunk)
        run_one(warm_backend, raw("w0", base, **params))  # leaves the shared prefix in the cache
        warm = run_one(warm_backend, raw("w1", base + " tail and more words", **params))
        assert warm.started.cached_tokens > 0
        assert warm.text == cold.text
        assert [d.logprobs for d in warm.deltas] == [d.logprobs for d in cold.deltas]


def test_prefix_cache_eviction_under_small_budget(tiny, tokenizer, make_backend, run_one, raw) -> None:
    config = tiny.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4
    a, b = words(200), "Other " + words(170, 1000)
    n_a, n_b = len(ids(tokenizer, a)), len(ids(tokenizer, b))
    assert (n_a + n_b) * per_token > 2**20 > max(n_a, n_b) * per_token  # one fits, not both

    small = make_backend(tiny, prefix_cache_mb=1)
    assert run_one(small, raw("a1", a, max_tokens=1)).started.cached_tokens == 0
    assert small.prefix_cache.bytes_used >= n_a * per_token
    assert run_one(small, raw("b1", b, max_tokens=1)).started.cached_tokens == 0
    assert len(small.prefix_cache) == 1 and small.prefix_cache.bytes_used <= 2**20
    assert run_one(small, raw("a2", a, max_tokens=1)).started.cached_tokens == 0  # a was evicted
    assert small.prefix_cache.bytes_used <= 2**20

    large = make_backend(tiny, prefix_cache_mb=8)
    for rid, prompt in (("a1", a), ("b1", b)):
        run_one(large, raw(rid, prompt, max_tokens=1))
    # whole blocks of 16 (the default chunk of 256 holds 16 of them)
    assert run_one(large, raw("a2", a, max_tokens=1)).started.cached_tokens == (n_a - 1) // 16 * 16
    assert run_one(large, raw("b2", b, max_tokens=1)).started.cached_tokens == (n_b - 1) // 16 * 16

    off = make_backend(tiny, prefix_cache_mb=0)
    run_one(off, raw("a1", a, max_tokens=1))
    assert run_one(off, raw("a2", a, max_tokens=1)).started.cached_tokens == 0


# ---------------------------------------------------------------- abort


def test_abort_mid_prefill_frees_and_keeps_valid_prefix(tiny, tokenizer, make_backend, run_one, raw) -> None:
    backend = make_backend(tiny, chunk_size=16)
    prompt = words(12)
    n = len(ids(tokenizer, prompt))
    add(backend, raw("a", prompt))
    events = backend.step()  # admission: no forward pass yet
    assert [type(e) for e in events] == [Started, PrefillProgress]
    assert events[-1].processed == 0
    events = backend.step()
    assert [type(e) for e in events] == [PrefillProgress]
    assert events[-1].processed == 16
    backend.abort("a")
    assert len(backend.active_ids()) == 0
    assert backend.step() == []
    backend.abort("a")  # unknown by now: ignored
    r = run_one(backend, raw("b", prompt))
    check_order(r, cached=16, total=n, chunk=16)


def test_abort_mid_decode_then_next_turn_counts(scripted, tokenizer, make_backend, run_one, raw) -> None:
    prompt = "List the animals:"
    p_ids = ids(tokenizer, prompt)
    answer = ids(tokenizer, " cat dog cow pig hen fox owl", special=False)
    scripted.model.setup_script(chain(p_ids[-1], answer))
    backend = make_backend(scripted, chunk_size=2)
    add(backend, raw("a", prompt, max_tokens=50))
    produced = 0
    assert not any(isinstance(e, TokenDelta) for e in backend.step())  # admission
    for _ in range(50):  # prefill chunks, the first token, then one token per step
        produced += sum(e.num_tokens for e in backend.step() if isinstance(e, TokenDelta))
        if produced >= 3:
            break
    assert produced == 3
    backend.abort("a")
    assert len(backend.active_ids()) == 0 and backend.step() == []
    # KV exists for the prompt and the first two answer tokens (the third was
    # never fed); the cache keeps the prompt's whole chunks.
    follow_up = prompt + tokenizer.decode(answer[:3]) + " and more"
    new = ids(tokenizer, follow_up)
    assert lcp(new, p_ids + answer[:2]) == len(p_ids) + 2
    r = run_one(backend, raw("b", follow_up, max_tokens=2))
    check_order(r, cached=len(p_ids) // 2 * 2, total=len(new), chunk=2)


# ---------------------------------------------------------------- stops and text


@pytest.mark.parametrize(
    ("stop", "text", "tokens"),
    [
        (("lo wor",), " Hel", 2),  # split across " Hello" and " world"
        (("is the",), " Hello world, this ", 6),  # "this" holds a false start
        (("the", "world"), " Hello ", 2),  # earliest match wins
        (("nowhere",), " Hello world, this is the end.", 9),  # EOS ends it
    ],
)
def test_stop_strings(scripted, tokenizer, make_backend, run_one, raw, stop, text, tokens) -> None:
    prompt = "Say it:"
    answer = ids(tokenizer, " Hello world, this is the end.", special=False)
    assert len(answer) == 8
    scripted.model.setup_script(chain(ids(tokenizer, prompt)[-1], answer))
    r = run_one(make_backend(scripted), raw("s", prompt, max_tokens=50, stop=stop))
    assert r.text == text
    assert r.finished.finish_reason is FinishReason.STOP
    assert r.finished.completion_tokens == tokens
    assert all(d.text for d in r.deltas)


def test_stop_token_ids_and_min_tokens(scripted, tokenizer, make_backend, run_one, raw) -> None:
    prompt = "Count:"
    answer = ids(tokenizer, " one two three four five", special=False)
    scripted.model.setup_script(chain(ids(tokenizer, prompt)[-1], answer))
    backend = make_backend(scripted)
    r = run_one(backend, raw("a", prompt, max_tokens=50, stop_token_ids=(answer[2],)))
    assert (r.text, r.finished.completion_tokens) == (tokenizer.decode(answer[:2]), 3)
    # Before min_tokens a stop token cannot be chosen: the script's choice is masked.
    r = run_one(backend, raw("b", prompt, max_tokens=50, stop_token_ids=(answer[0],), min_tokens=1))
    assert r.finished.completion_tokens > 1 and not r.text.startswith(" one")


def test_eos_min_tokens_and_ignore_eos(tiny, make_backend, run_one, raw) -> None:
    backend = make_backend(tiny)
    bias = {EOS: 100.0}
    assert run_one(backend, raw("a", "Hello", logit_bias=bias)).finished.completion_tokens == 1
    r = run_one(backend, raw("b", "Hello", logit_bias=bias, min_tokens=3))
    assert (r.finished.completion_tokens, r.finished.finish_reason) == (4, FinishReason.STOP)
    r = run_one(backend, raw("c", "Hello", logit_bias=bias, ignore_eos=True, max_tokens=6))
    assert (r.finished.completion_tokens, r.finished.finish_reason) == (6, FinishReason.LENGTH)


def test_logit_bias_forces_token(tiny, tokenizer, make_backend, run_one, raw) -> None:
    token = ids(tokenizer, " banana", special=False)
    assert len(token) == 1
    r = run_one(make_backend(tiny), raw("a", "Fruit:", max_tokens=5, logit_bias={token[0]: 100.0}))
    assert r.text == tokenizer.decode(token * 5)
    assert sum(d.num_tokens for d in r.deltas) == r.finished.completion_tokens == 5


def _split_char(tokenizer: Any) -> tuple[str, list[int]]:
    for char in ("🦙", "𝄞", "東", "€", "😀", "ß"):
        char_ids = ids(tokenizer, char, special=False)
        if len(char_ids) >= 2 and "\ufffd" in tokenizer.decode(char_ids[:1]):
            return char, char_ids
    raise AssertionError("no multi-token character found")


def test_utf8_split_character_is_held_until_complete(scripted, tokenizer, make_backend, run_one, raw) -> None:
    char, _ = _split_char(tokenizer)
    answer_text = f" x{char}y"
    answer = ids(tokenizer, answer_text, special=False)
    prompt = "Emoji:"
    scripted.model.setup_script(chain(ids(tokenizer, prompt)[-1], answer))
    r = run_one(make_backend(scripted), raw("u", prompt, max_tokens=50))
    assert r.text == answer_text
    assert all("\ufffd" not in d.text and d.text for d in r.deltas)
    assert len(r.deltas) < len(answer)  # some tokens were held and folded into a later delta
    assert sum(d.num_tokens for d in r.deltas) == len(answer)  # EOS adds no text
    assert r.finished.completion_tokens == len(answer) + 1


def test_stop_string_split_inside_a_character(scripted, tokenizer, make_backend, run_one, raw) -> None:
    char, _ = _split_char(tokenizer)
    answer_text = f" ok{char}done"
    answer = ids(tokenizer, answer_text, special=False)
    prompt = "Go:"
    scripted.model.setup_script(chain(ids(tokenizer, prompt)[-1], answer))
    r = run_one(make_backend(scripted), raw("u", prompt, max_tokens=50, stop=(f"{char}d",)))
    assert r.text == " ok"
    assert r.finished.finish_reason is FinishReason.STOP


# ---------------------------------------------------------------- limits and validation


def test_max_tokens_and_context_end(tiny, tokenizer, make_backend, run_one, raw) -> None:
    prompt = words(6)
    n = len(ids(tokenizer, prompt))
    for drafting in (False, True):
        backend = make_backend(tiny, max_seq_len=n + 10, draft_mode="ngram" if drafting else "none")
        r = run_one(backend, raw("a", prompt, max_tokens=7, ignore_eos=True))
        assert (r.finished.completion_tokens, r.finished.finish_reason) == (7, FinishReason.LENGTH)
        r = run_one(backend, raw("b", prompt, max_tokens=100, ignore_eos=True))
        assert (r.finished.completion_tokens, r.finished.finish_reason) == (10, FinishReason.LENGTH)


def test_context_length_rejected(tiny, tokenizer, make_backend) -> None:
    prompt = words(6)
    n = len(ids(tokenizer, prompt))
    backend = make_backend(tiny, max_seq_len=n)
    with pytest.raises(RequestRejected) as exc:
        add(backend, Submit("a", SamplingParams(max_tokens=1), prompt=prompt))
    assert exc.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert str(n) in exc.value.message and "max_seq_len" in exc.value.message
    assert exc.value.param == "prompt"
    with pytest.raises(RequestRejected) as exc:
        add(backend, Submit("b", SamplingParams(max_tokens=1), messages=(ChatMessage("user", prompt),)))
    assert exc.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and exc.value.param == "messages"
    add(backend, Submit("c", SamplingParams(max_tokens=1), prompt=prompt[: len(prompt) // 2]))
    assert len(backend.active_ids()) == 1


@pytest.mark.parametrize(
    ("submit", "param"),
    [
        (Submit("x", SamplingParams(max_tokens=4), prompt=""), "prompt"),
        (Submit("x", SamplingParams(max_tokens=4)), "messages"),
        (Submit("x", SamplingParams(max_tokens=0), prompt="hi"), "max_tokens"),
        (Submit("x", SamplingParams(max_tokens=4, temperature=-1.0), prompt="hi"), "temperature"),
        (Submit("x", SamplingParams(max_tokens=4, top_p=0.0), prompt="hi"), "top_p"),
        (Submit("x", SamplingParams(max_tokens=4, top_k=-1), prompt="hi"), "top_k"),
        (Submit("x", SamplingParams(max_tokens=4, min_tokens=5), prompt="hi"), "min_tokens"),
        (Submit("x", SamplingParams(max_tokens=4, logit_bias={10**9: 1.0}), prompt="hi"), "logit_bias"),
        (Submit("x", SamplingParams(max_tokens=4, stop_token_ids=(-1,)), prompt="hi"), "stop_token_ids"),
    ],
)
def test_invalid_requests(tiny, make_backend, submit, param) -> None:
    backend = make_backend(tiny)
    with pytest.raises(RequestRejected) as exc:
        add(backend, submit)
    assert exc.value.code is ErrorCode.INVALID_REQUEST and exc.value.param == param
    assert len(backend.active_ids()) == 0


def test_both_inputs_rejected(tiny, make_backend, raw) -> None:
    # Duplicate ids are the loop's to refuse (tests/.../test_loop.py), checked once there.
    backend = make_backend(tiny)
    add(backend, raw("a", "hello"))
    both = Submit("b", SamplingParams(max_tokens=1), messages=(ChatMessage("user", "x"),), prompt="y")
    with pytest.raises(RequestRejected):
        add(backend, both)
    assert len(backend.active_ids()) == 1


# ---------------------------------------------------------------- concurrency and failures


def test_requests_progress_together(tiny, make_backend, raw) -> None:
    backend = make_backend(tiny, chunk_size=64)
    add(backend, raw("a", words(4), max_tokens=6, ignore_eos=True))
    add(backend, raw("b", words(5, 20), max_tokens=6, ignore_eos=True))
    finished: set[str] = set()
    steps = 0
    while len(backend.active_ids()):
        events = backend.step()
        steps += 1
        active = {"a", "b"} - finished
        assert {e.request_id for e in events} == active  # every active request advanced
        finished |= {e.request_id for e in events if isinstance(e, Finished)}
    assert finished == {"a", "b"} and steps == 7  # admission, prefill + first token, 5 decode steps


def test_one_pass_per_step_carries_every_decoding_sequence(scripted, make_backend, raw) -> None:
    backend = make_backend(scripted, chunk_size=64)
    for rid in ("a", "b", "c"):
        add(backend, raw(rid, words(3), max_tokens=5, ignore_eos=True))
    backend.step()  # admission: no pass
    scripted.model.passes.clear()
    while backend.active_ids():
        backend.step()
    prompt_len = backend.prepare(raw("x", words(3))).prompt_tokens
    # one pass for the three prompts (no prefix cached yet), then one per decode step
    assert scripted.model.passes[0] == [(prompt_len, 1)] * 3
    assert scripted.model.passes[1:] == [[(1, 1)] * 3] * 4


def test_long_prefill_shares_each_pass_with_decoding_sequences(
    scripted, tokenizer, make_backend, raw
) -> None:
    """A long prompt is fed chunk_size tokens per pass while the decoding sequence
    gets a token in every one of those passes."""
    backend = make_backend(scripted, chunk_size=8)
    add(backend, raw("short", words(1), max_tokens=30, ignore_eos=True))
    backend.step()
    backend.step()  # "short" prefilled; decoding from now on
    add(backend, raw("long", words(12), max_tokens=2, ignore_eos=True))
    long_len = len(ids(tokenizer, words(12)))
    assert long_len > 40
    backend.step()  # admission of "long"
    scripted.model.passes.clear()
    progress: list[int] = []
    tokens_of_short = 0
    while not progress or progress[-1] < long_len:
        events = backend.step()
        progress += [e.processed for e in events if isinstance(e, PrefillProgress)]
        tokens_of_short += sum(
            e.num_tokens for e in events if isinstance(e, TokenDelta) and e.request_id == "short"
        )
    chunks = math.ceil(long_len / 8)
    assert progress == [min(8 * i, long_len) for i in range(1, chunks + 1)]
    assert len(scripted.model.passes) == chunks
    for segments in scripted.model.passes:
        assert segments[0] == (1, 1)  # the decoding sequence's token, in every pass
        assert sum(length for length, _ in segments[1:]) <= 8
    assert tokens_of_short == chunks
    for rid in ("short", "long"):
        backend.abort(rid)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_sequences_produce_what_they_produce_alone(
    tiny, make_backend, run_one, run_all, raw, temperature
) -> None:
    """Each row of a batched pass is computed as it would be alone, so batching
    changes no token (greedy or seeded sampling)."""
    prompts = [words(2), words(7, 3), "Once upon a time", words(1, 40)]
    submits = [
        raw(f"r{i}", p, max_tokens=24, temperature=temperature, seed=i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    alone = {s.request_id: run_one(make_backend(tiny, prefix_cache_mb=0), s).text for s in submits}
    together = run_all(make_backend(tiny, prefix_cache_mb=0, chunk_size=16), submits)
    assert {rid: r.text for rid, r in together.items()} == alone
    assert all(r.finished.completion_tokens == 24 for r in together.values())


def test_failure_is_isolated_to_its_request(scripted, tokenizer, make_backend, run_all, raw) -> None:
    poison = ids(tokenizer, " poison", special=False)
    assert len(poison) == 1
    scripted.model.setup_script(poison=poison[0])
    backend = make_backend(scripted, chunk_size=2)
    ok = raw("ok", "A normal prompt", max_tokens=4, ignore_eos=True)
    results = run_all(backend, [ok, raw("bad", "A poison prompt")])
    err = results["bad"].error
    assert err.code is ErrorCode.INTERNAL and "poisoned" in err.message
    assert isinstance(results["bad"].events[0], Started)
    assert results["ok"].finished.completion_tokens == 4
    assert len(backend.prefix_cache) == 1  # the failed sequence's KV was not kept
    assert not any(isinstance(e, RequestError) for e in results["ok"].events)


# ---------------------------------------------------------------- sampling and drafting


def test_seed_reproduces_sampled_output(tiny, make_backend, run_one, raw) -> None:
    backend = make_backend(tiny)

    def sample(rid: str, seed: int) -> str:
        r = run_one(backend, raw(rid, words(3), max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True))
        return r.text

    first = sample("a", 123)
    assert sample("b", 123) == first  # second run also starts from the prefix cache
    assert sample("c", 124) != first


def test_drafting_accepts_a_scripted_cycle(scripted, tokenizer, make_backend, run_one, raw) -> None:
    cycle = ids(tokenizer, " sun moon star sky", special=False)
    prompt = "Repeat:" + tokenizer.decode(cycle * 2)
    p_ids = ids(tokenizer, prompt)
    assert p_ids[-len(cycle) :] == cycle
    assert len(set(cycle)) == len(cycle)
    scripted.model.setup_script({c: cycle[(i + 1) % len(cycle)] for i, c in enumerate(cycle)})
    results = {}
    for drafting in (False, True):
        scripted.model.calls.clear()
        r = run_one(
            make_backend(scripted, draft_mode="ngram" if drafting else "none"),
            raw(str(drafting), prompt, max_tokens=20),
        )
        results[drafting] = r
    plain, drafted = results[False].finished, results[True].finished
    assert results[True].text == results[False].text == tokenizer.decode(cycle * 5)
    assert plain.completion_tokens == drafted.completion_tokens == 20
    assert plain.draft_accepted is None
    assert drafted.draft_rejected == 0  # the script always agrees with the history
    assert drafted.draft_accepted == scripted.model.drafted_positions() > 0
    decode_passes = sum(1 for length, keep in scripted.model.calls if keep == length)
    assert 1 + decode_passes + drafted.draft_accepted == 20  # prefill token + one per pass + accepted


def test_drafts_past_eos_are_rejected(scripted, tokenizer, make_backend, run_one, raw) -> None:
    prompt = "Words: alpha beta gamma<|im_end|> delta epsilon zeta alpha beta"
    p_ids = ids(tokenizer, prompt)
    a, b = p_ids[-2:]
    first = next(i for i in range(len(p_ids) - 2) if p_ids[i : i + 2] == [a, b])
    x = p_ids[first + 2]
    assert p_ids[first + 3] == EOS and len(p_ids) - (first + 4) >= 5
    scripted.model.setup_script({b: x, x: EOS})
    r = run_one(
        make_backend(scripted, draft_mode="ngram", num_draft_tokens=4), raw("d", prompt, max_tokens=50)
    )
    fin = r.finished
    assert r.text == tokenizer.decode([x])
    assert (fin.finish_reason, fin.completion_tokens) == (FinishReason.STOP, 2)  # x, then EOS (a draft)
    assert (fin.draft_accepted, fin.draft_rejected) == (1, 3)
    assert scripted.model.drafted_positions() == 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafting_matches_plain_decoding(
    scripted, tokenizer, make_backend, run_one, raw, temperature
) -> None:
    """Same tokens with and without drafting, greedy and seeded sampling. A weak
    script (the cycle, entered from any token, gets about 3/4 of the probability
    at temperature 1) makes some drafts right and some wrong."""
    cycle = ids(tokenizer, " one two three four", special=False)
    script = {c: cycle[(i + 1) % len(cycle)] for i, c in enumerate(cycle)}
    scripted.model.setup_script(script, boost=12.0, default=cycle[0])
    prompt = "Count:" + tokenizer.decode(cycle * 3) + " then" + words(2)
    texts, counts = [], []
    for drafting in (False, True):
        scripted.model.calls.clear()
        backend = make_backend(scripted, draft_mode="ngram" if drafting else "none", num_draft_tokens=3)
        r = run_one(
            backend, raw("r", prompt, max_tokens=40, temperature=temperature, seed=5, ignore_eos=True)
        )
        texts.append(r.text)
        counts.append(r.finished.completion_tokens)
        if drafting:
            fin = r.finished
            assert fin.draft_accepted + fin.draft_rejected == scripted.model.drafted_positions() > 0
            assert fin.draft_accepted > 0
            if temperature > 0:
                assert fin.draft_rejected > 0
    assert texts[0] == texts[1]
    assert counts == [40, 40]


# ---------------------------------------------------------------- admission figures


def test_kv_capacity_reservation_and_longest_token(tiny, make_backend, raw) -> None:
    backend = make_backend(tiny, kv_cache_mb=1, max_seq_len=100)
    cfg = tiny.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # float32
    assert backend.info.kv_cache_tokens == 2**20 // bytes_per_token
    assert backend.info.longest_token_chars == max(len(t) for t in tiny.tokenizer.get_vocab())
    prepared = checked_prepare(backend, raw("a", "hello there", max_tokens=1000))
    n = prepared.prompt_tokens
    assert backend.reservation(prepared) == 100  # the prompt plus the rest of the context
    small = checked_prepare(backend, raw("b", "hello there", max_tokens=5))
    assert backend.reservation(small) == n + 5
    backend.start("b-0", small, small.submit.params)
    backend.start("b-1", small, small.submit.params)
    assert backend.kv_reserved() == 2 * (n + 5)
    backend.abort("b-0")
    assert backend.kv_reserved() == n + 5


def test_choices_of_one_prepared_request_sample_independently(tiny, make_backend, raw) -> None:
    backend = make_backend(tiny)
    prepared = checked_prepare(backend, raw("r", "Once upon a time", max_tokens=12, temperature=1.0, seed=1))
    params = prepared.submit.params
    for i, seed in enumerate((1, 2, 1)):
        backend.start(f"r-{i}", prepared, msgspec.structs.replace(params, seed=seed))
    texts: dict[str, list[str]] = {f"r-{i}": [] for i in range(3)}
    while backend.active_ids():
        for ev in backend.step():
            if isinstance(ev, TokenDelta):
                texts[ev.request_id].append(ev.text)
    out = {rid: "".join(t) for rid, t in texts.items()}
    assert out["r-0"] == out["r-2"] != out["r-1"]  # same seed, same text; another seed, another


def test_a_salted_prompt_never_hits_another_salts_cache(tiny, tokenizer, make_backend, run_one, raw) -> None:
    """Issue 20's side channel: a guessed prefix of another tenant's document
    shows no ``cached_tokens`` (and takes a full prefill) under another salt."""
    backend = make_backend(tiny, chunk_size=16)
    doc = words(12)
    total = len(ids(tokenizer, doc))
    salted = lambda rid, salt: msgspec.structs.replace(raw(rid, doc, max_tokens=1), cache_salt=salt)  # noqa: E731
    assert run_one(backend, salted("a1", "tenant-a")).started.cached_tokens == 0
    assert run_one(backend, salted("b1", "tenant-b")).started.cached_tokens == 0
    assert run_one(backend, raw("u1", doc, max_tokens=1)).started.cached_tokens == 0
    again = run_one(backend, salted("a2", "tenant-a")).started.cached_tokens
    assert again == (total - 1) // 16 * 16 > 0  # the same tenant still shares its own cache


def _choices(backend: Any, submit: Submit, n: int) -> dict[str, list[Any]]:
    """Start ``n`` choices of one prepared request and step until idle; events per choice."""
    prepared = checked_prepare(backend, submit)
    events: dict[str, list[Any]] = {f"r-{i}": [] for i in range(n)}
    for rid in events:
        backend.start(rid, prepared, submit.params)
    while backend.active_ids():
        for ev in backend.step():
            events[ev.request_id].append(ev)
    return events


def test_choices_of_one_request_share_one_prefill(scripted, tokenizer, make_backend, raw) -> None:
    """n > 1: the prompt is fed once, by the first choice; the others start from its KV
    and last logits, report the whole prompt as cached, and write what it writes."""
    prompt = words(40)  # several 64-token chunks
    answer = ids(tokenizer, " red green blue", special=False)
    scripted.model.setup_script(chain(ids(tokenizer, prompt)[-1], answer))
    alone = make_backend(scripted, chunk_size=64, prefix_cache_mb=0)
    single = _choices(alone, raw("r", prompt, max_tokens=8), 1)["r-0"]
    backend = make_backend(scripted, chunk_size=64, prefix_cache_mb=0)
    scripted.model.passes.clear()  # after the warm-up pass
    events = _choices(backend, raw("r", prompt, max_tokens=8), 3)
    total = len(ids(tokenizer, prompt))
    fed = sum(length for p in scripted.model.passes for length, keep in p if keep != length or length > 1)
    assert fed == total  # prompt chunks of one choice only (decode passes feed 1 token, keep 1)
    assert [e for e in events["r-0"] if isinstance(e, Started)] == [Started("r-0", total, 0)]
    for rid in ("r-1", "r-2"):
        mine = events[rid]
        assert mine[:2] == [Started(rid, total, total), PrefillProgress(rid, total, total, total, 0)]
        assert mine[-1].cached_tokens == total
    text = {rid: "".join(e.text for e in ev if isinstance(e, TokenDelta)) for rid, ev in events.items()}
    assert (
        set(text.values())
        == {"".join(e.text for e in single if isinstance(e, TokenDelta))}
        == {" red green blue"}
    )


def test_greedy_choices_that_share_a_prefill_match_a_lone_run_bitwise(shaped, make_backend, raw) -> None:
    """Random weights in SmolLM2's shapes, where one bit of difference shows in the
    tokens: each later choice samples from the first one's logits and KV."""
    prompt = words(30)
    lone = _choices(
        make_backend(shaped, chunk_size=64, prefix_cache_mb=0), raw("r", prompt, max_tokens=12), 1
    )
    shared = _choices(
        make_backend(shaped, chunk_size=64, prefix_cache_mb=0), raw("r", prompt, max_tokens=12), 3
    )
    tokens = {rid: [e.text for e in ev if isinstance(e, TokenDelta)] for rid, ev in shared.items()}
    assert all(t == [e.text for e in lone["r-0"] if isinstance(e, TokenDelta)] for t in tokens.values())


def test_a_later_choice_prefills_itself_when_the_first_ends_before_its_prefill(
    scripted, tokenizer, make_backend, raw
) -> None:
    backend = make_backend(scripted, chunk_size=16, prefix_cache_mb=0)
    submit = raw("r", words(20), max_tokens=3, ignore_eos=True)
    prepared = checked_prepare(backend, submit)
    for rid in ("r-0", "r-1"):
        backend.start(rid, prepared, submit.params)
    first = backend.step()  # admission of r-0 only: r-1 waits for its prefill
    assert {e.request_id for e in first} == {"r-0"}
    backend.step()  # one chunk of r-0
    backend.abort("r-0")
    events: list[Any] = []
    while backend.active_ids():
        events += backend.step()
    assert events[0] == Started("r-1", prepared.prompt_tokens, 0)
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 3
