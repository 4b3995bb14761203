"""CpuBackend logprobs (fast, tiny random Llama that records the logits it returns):
values recomputed here from those logits, top lists, entries lined up with the
delta text through UTF-8 and stop-string hold-backs, drafting, grammars."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from engine_worker.backend import RequestRejected
from engine_worker.cpu.sampling import Scored
from engine_worker.requests.logprobs import LogprobTrail
from engine_worker.requests.stops import StopMatcher
from protocol.messages import ErrorCode, FinishReason, TokenLogprob
from tests.fakes.cpu import add

EOS = 2


def ids(tokenizer: Any, text: str, special: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def chain(first: int, tokens: list[int], end: int | None = EOS) -> dict[int, int]:
    seq = [first, *tokens] + ([end] if end is not None else [])
    assert len(set(seq[:-1])) == len(seq) - 1, "precondition: scripted tokens are distinct"
    return dict(itertools.pairwise(seq))


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes: printable Latin-1 as itself, the other
    bytes as the characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: dict[str, int] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(0x100 + extra)] = b
            extra += 1
    return alphabet


ALPHABET = _byte_level_alphabet()


def piece_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's bytes from its vocabulary piece (special tokens: their text)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids:
        return str(piece).encode()
    return bytes(ALPHABET[c] for c in piece)


def entries(r: Any) -> list[TokenLogprob]:
    return [e for d in r.deltas for e in (d.logprobs or ())]


def check_alignment(r: Any, k: int) -> None:
    """Every delta's entries join to its text; top lists sorted, at most k, the
    chosen token's logprob a log-probability."""
    for d in r.deltas:
        assert d.logprobs is not None
        assert "".join(e.token for e in d.logprobs) == d.text
    for e in entries(r):
        assert e.logprob <= 1e-6
        assert len(e.top) <= k
        values = [t.logprob for t in e.top]
        assert values == sorted(values, reverse=True)


def test_logprobs_are_the_log_softmax_of_the_sampled_distribution(
    scripted, tokenizer, make_backend, run_one, raw
) -> None:
    model = scripted.model
    backend = make_backend(scripted, prefix_cache_mb=0)
    model.record = True  # after the backend's warm-up pass
    temperature, k = 0.7, 5
    submit = raw(
        "a", "Once upon", max_tokens=12, temperature=temperature, seed=3, ignore_eos=True, logprobs=k
    )
    r = run_one(backend, submit)
    assert r.finished.completion_tokens == 12
    check_alignment(r, k)
    # One logits row per generated token; each decode pass is fed the previous token.
    assert len(model.outputs) == 12 and all(len(i) == 1 for i in model.inputs[1:])
    chosen = [i[0] for i in model.inputs[1:]]
    got = entries(r)
    assert len(got) == 11 or len(got) == 12  # the last token may still be held (UTF-8)
    for position, (entry, token) in enumerate(zip(got, chosen, strict=False)):
        expected = torch.log_softmax(model.outputs[position].float() / temperature, dim=-1)
        assert entry.token_bytes == piece_bytes(tokenizer, token)
        assert math.isclose(entry.logprob, float(expected[token]), abs_tol=1e-5)
        top_values, top_ids = torch.topk(expected, k)
        assert [t.token_bytes for t in entry.top] == [piece_bytes(tokenizer, i) for i in top_ids.tolist()]
        for t, value in zip(entry.top, top_values.tolist(), strict=True):
            assert math.isclose(t.logprob, value, abs_tol=1e-5)
            assert t.token == t.token_bytes.decode(errors="replace")
    assert "".join(e.token for e in got) == r.text


def test_greedy_logprobs_leave_out_what_top_k_removes(scripted, make_backend, run_one, raw) -> None:
    model = scripted.model
    # float32 weights: int4 levels of a random 64-wide model give exact logit ties,
    # and a tie at the k-th value keeps both tokens
    backend = make_backend(scripted, quantization="none")
    model.record = True
    r = run_one(backend, raw("g", "Hello", max_tokens=4, ignore_eos=True, top_k=2, logprobs=5))
    check_alignment(r, 5)
    for entry, row in zip(entries(r), model.outputs, strict=False):
        two = torch.topk(row.float(), 2).values
        expected = two - torch.logsumexp(two, dim=0)  # temperature 1, the rest left out
        assert len(entry.top) == 2
        assert math.isclose(entry.logprob, float(expected[0]), abs_tol=1e-5)  # greedy: the best
        assert [t.logprob for t in entry.top] == pytest.approx(expected.tolist(), abs=1e-5)


def test_zero_alternatives_and_none(tiny, make_backend, run_one, raw) -> None:
    backend = make_backend(tiny)
    r = run_one(backend, raw("z", "Hello", max_tokens=5, ignore_eos=True, logprobs=0))
    assert all(e.top == () for e in entries(r)) and entries(r)
    r = run_one(backend, raw("n", "Hello", max_tokens=5, ignore_eos=True))
    assert all(d.logprobs is None for d in r.deltas)


def test_logprobs_do_not_change_the_sampled_tokens(tiny, make_backend, run_one, raw) -> None:
    backend = make_backend(tiny)
    texts = [
        run_one(
            backend, raw(f"s{k}", "Once", max_tokens=20, temperature=1.0, seed=9, ignore_eos=True, logprobs=k)
        ).text
        for k in (None, 0, 20)
    ]
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("k", [-1, 21])
def test_logprobs_out_of_range_are_rejected(tiny, make_backend, raw, k) -> None:
    with pytest.raises(RequestRejected) as exc:
        add(make_backend(tiny), raw("x", "hi", logprobs=k))
    assert exc.value.code is ErrorCode.INVALID_REQUEST and exc.value.param == "logprobs"


def _split_char(tokenizer: Any) -> str:
    for char in ("🦙", "𝄞", "東", "€", "😀", "ß"):
        char_ids = ids(tokenizer, char, special=False)
        if len(char_ids) >= 2 and "\ufffd" in tokenizer.decode(char_ids[:1]):
            return char
    raise AssertionError("no multi-token character found")


def scripted_run(
    scripted: Any, tokenizer: Any, make_backend: Any, run_one: Any, raw: Any, answer_text: str, **params: Any
) -> tuple[Any, list[int]]:
    answer = ids(tokenizer, answer_text, special=False)
    prompt = "Go:"
    scripted.model.setup_script(chain(ids(tokenizer, prompt)[-1], answer))
    params.setdefault("max_tokens", 50)
    return run_one(make_backend(scripted), raw("u", prompt, logprobs=2, **params)), answer


def test_held_utf8_tokens_come_with_the_text_they_release(
    scripted, tokenizer, make_backend, run_one, raw
) -> None:
    char = _split_char(tokenizer)
    text = f" x{char}y"
    r, answer = scripted_run(scripted, tokenizer, make_backend, run_one, raw, text)
    assert r.text == text
    check_alignment(r, 2)
    got = entries(r)
    assert len(got) == len(answer)  # one per token; EOS, which ends it, has none
    assert [e.token_bytes for e in got] == [piece_bytes(tokenizer, t) for t in answer]
    assert b"".join(e.token_bytes for e in got) == text.encode()
    assert "" in [e.token for e in got]  # the character's first bytes add nothing
    assert char in [e.token for e in got] or any(char in e.token for e in got)
    assert all(math.isclose(e.logprob, 0.0, abs_tol=1e-3) for e in got)  # the script's +1000


def test_text_cut_by_max_tokens_inside_a_character(scripted, tokenizer, make_backend, run_one, raw) -> None:
    char = _split_char(tokenizer)
    n = len(ids(tokenizer, " x", special=False)) + 1  # stops after the character's first token
    r, _ = scripted_run(scripted, tokenizer, make_backend, run_one, raw, f" x{char}y", max_tokens=n)
    assert r.finished.finish_reason is FinishReason.LENGTH
    check_alignment(r, 2)
    assert len(entries(r)) == n and r.text.endswith("\ufffd")


def test_token_cut_by_a_stop_string_carries_the_shown_part(
    scripted, tokenizer, make_backend, run_one, raw
) -> None:
    r, _ = scripted_run(scripted, tokenizer, make_backend, run_one, raw, " hello world again", stop=("wor",))
    assert r.text == " hello "
    check_alignment(r, 2)
    got = entries(r)
    hello, world = ids(tokenizer, " hello", special=False), ids(tokenizer, " world", special=False)
    assert len(world) == 1
    assert [e.token for e in got] == [*(tokenizer.decode([t]) for t in hello), " "]
    assert got[-1].token_bytes == piece_bytes(tokenizer, world[0])  # the token's own bytes, all of them
    assert r.finished.finish_reason is FinishReason.STOP


def test_tokens_at_or_after_a_stop_string_are_dropped(
    scripted, tokenizer, make_backend, run_one, raw
) -> None:
    char = _split_char(tokenizer)
    r, _ = scripted_run(scripted, tokenizer, make_backend, run_one, raw, f" ok{char}done", stop=(f"{char}d",))
    assert r.text == " ok"
    check_alignment(r, 2)
    assert [e.token for e in entries(r)] == [
        tokenizer.decode([t]) for t in ids(tokenizer, " ok", special=False)
    ]


def test_false_start_of_a_stop_string_is_released_token_by_token(
    scripted, tokenizer, make_backend, run_one, raw
) -> None:
    text = " moon sun star sky"
    r, answer = scripted_run(scripted, tokenizer, make_backend, run_one, raw, text, stop=(" sunset", " sky"))
    assert r.text == " moon sun star"
    check_alignment(r, 2)
    assert [e.token for e in entries(r)] == [tokenizer.decode([t]) for t in answer[:-1]]
    assert len(r.deltas) < len(answer) - 1  # " sun" was held while it could start " sunset"


def test_drafted_tokens_get_the_target_logprobs(scripted, tokenizer, make_backend, run_one, raw) -> None:
    cycle = ids(tokenizer, " one two three four", special=False)
    script = {c: cycle[(i + 1) % len(cycle)] for i, c in enumerate(cycle)}
    scripted.model.setup_script(script, boost=6.0, default=cycle[0])
    prompt = "Count:" + tokenizer.decode(cycle * 3)
    runs = []
    for drafting in ("none", "ngram"):
        backend = make_backend(scripted, draft_mode=drafting, num_draft_tokens=3)
        runs.append(run_one(backend, raw("d", prompt, max_tokens=24, ignore_eos=True, logprobs=3)))
    plain, drafted = runs
    assert drafted.finished.draft_accepted > 0
    assert plain.text == drafted.text
    for a, b in zip(entries(plain), entries(drafted), strict=True):
        assert (a.token, a.token_bytes) == (b.token, b.token_bytes)
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
        assert [t.token for t in a.top] == [t.token for t in b.top]
        assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4)


def test_grammar_masked_logprobs(scripted, tokenizer, make_backend, run_one, raw) -> None:
    cycle = ids(tokenizer, " sun moon star sky", special=False)
    scripted.model.setup_script({c: cycle[(i + 1) % 4] for i, c in enumerate(cycle)})
    prompt = "Repeat:" + tokenizer.decode(cycle * 2)
    grammar = f'start: "{tokenizer.decode(cycle[:3])}."'
    r = run_one(make_backend(scripted), raw("g", prompt, max_tokens=10, grammar=grammar, logprobs=4))
    assert r.text == " sun moon star."
    check_alignment(r, 4)
    last = entries(r)[-1]
    # Only "." may follow: probability 1, and the only alternative.
    assert last.token == "." and last.logprob == 0.0
    assert [(t.token, t.logprob) for t in last.top] == [(".", 0.0)]


# ---------------------------------------------------------------- LogprobTrail alone


def _scored(token: int) -> Scored:
    return Scored(token, -float(token), [])


def _info(token: int) -> tuple[str, bytes]:
    return f"<{token}>", bytes([token])


def test_trail_aligns_deltas_with_token_boundaries() -> None:
    trail = LogprobTrail(_info)
    stopper = StopMatcher(["XYZ"])
    # Token 1 releases "ab"; 2 is held (incomplete character); 3 releases "cX" with it;
    # the matcher holds "X" (it may start "XYZ"), so the delta stops after "ab".
    deltas = []
    for token, released in ((1, "ab"), (2, ""), (3, "cX")):
        trail.add(_scored(token), released)
        emit, _ = stopper.feed(released) if released else ("", False)
        trail.emitted(emit)
        deltas.append(trail.take())
    assert deltas[0] == ("ab", (TokenLogprob("ab", -1.0, b"\x01"),))
    assert deltas[1] == ("", ())
    # "c" was emitted, but token 3 also owns the held "X"; token 2 waits with it.
    assert deltas[2] == ("", ())
    # Token 4 releases "YQ": no stop after all; everything up to "XYQ" is released.
    trail.add(_scored(4), "YQ")
    emit, stopped = stopper.feed("YQ")
    trail.emitted(emit)
    text, got = trail.take()
    assert not stopped and text == "cXYQ"
    assert [(e.token, e.token_bytes) for e in got] == [("", b"\x02"), ("cX", b"\x03"), ("YQ", b"\x04")]


def test_trail_cut_by_a_stop_string_keeps_the_shown_part() -> None:
    trail = LogprobTrail(_info)
    stopper = StopMatcher(["XYZ"])
    for token, released in ((1, "ab"), (2, "cXY"), (3, "Zde"), (4, "f")):
        trail.add(_scored(token), released)
        emit, stopped = stopper.feed(released)
        trail.emitted(emit)
        if stopped:
            break
    text, got = trail.take(final=True, cut=True)
    assert text == "abc" and [e.token for e in got] == ["ab", "c"]  # token 3 starts inside the stop
