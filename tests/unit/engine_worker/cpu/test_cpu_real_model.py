"""CpuBackend on the real embedded SmolLM2-135M-Instruct (slow: one shared model)."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest
from llguidance import LLMatcher

from protocol.messages import ChatMessage, FinishReason, SamplingParams, Submit

pytestmark = pytest.mark.slow

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)


def chat(request_id: str, text: str, **params: object) -> Submit:
    params.setdefault("temperature", 0.0)
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    return Submit(request_id, sampling, messages=(ChatMessage("user", text),))


def test_greedy_answer_mentions_paris(real_model, make_backend, run_one) -> None:
    backend = make_backend(real_model)
    r = run_one(backend, chat("p", "What is the capital of France?", max_tokens=32))
    assert "Paris" in r.text
    assert r.finished.finish_reason is FinishReason.STOP  # the model ends its turn
    assert r.finished.completion_tokens < 32


def test_drafting_keeps_greedy_output_and_accepts_drafts(real_model, make_backend, run_one) -> None:
    texts = []
    for drafting in (False, True):
        backend = make_backend(real_model, draft_mode="ngram" if drafting else "none")
        r = run_one(backend, chat("d", "Repeat this passage exactly: " + PASSAGE, max_tokens=60))
        texts.append((r.text, r.finished.completion_tokens))
        if drafting:
            assert r.finished.draft_accepted > 0
    assert texts[0] == texts[1]
    assert "quick brown fox" in texts[0][0]


IDENTITY_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle gear works to a ten-year-old.",
    "Repeat this passage exactly: " + PASSAGE,
    "List five facts about honeybees.",
    "What is the capital of France?",
    "Translate into French: the library opens at nine in the morning.",
    "Write a haiku about autumn rain.",
    "Give three tips for learning chess, each one sentence.",
)


def test_greedy_output_is_the_same_alone_batched_and_drafted(
    real_model, make_backend, run_one, run_all
) -> None:
    """The default configuration (int4): eight prompts decoded alone, all eight
    batched, batched with n-gram drafting, and batched again from the prefix
    cache give the same tokens."""
    submits = [chat(f"p{i}", p, max_tokens=48, ignore_eos=True) for i, p in enumerate(IDENTITY_PROMPTS)]
    alone = {s.request_id: run_one(make_backend(real_model, prefix_cache_mb=0), s).text for s in submits}
    batched = run_all(make_backend(real_model, prefix_cache_mb=0), submits)
    drafted = run_all(make_backend(real_model, prefix_cache_mb=0, draft_mode="ngram"), submits)
    assert {rid: r.text for rid, r in batched.items()} == alone
    assert {rid: r.text for rid, r in drafted.items()} == alone
    assert sum(r.finished.draft_accepted for r in drafted.values()) > 0  # drafts were verified
    # With the prefix cache on, a second send (whole chunks from the cache) gives
    # what the first gave. The chunk size cuts the prompt, so it is the same
    # on both sides: small here, so that these short prompts have whole chunks.
    chunked = [run_one(make_backend(real_model, chunk_size=16, prefix_cache_mb=0), s).text for s in submits]
    cached = make_backend(real_model, chunk_size=16)
    for attempt in range(2):
        again = run_all(
            cached, [msgspec.structs.replace(s, request_id=f"{s.request_id}-{attempt}") for s in submits]
        )
        assert [again[f"{s.request_id}-{attempt}"].text for s in submits] == chunked
    assert sum(r.started.cached_tokens for r in again.values()) > 0
    assert "Paris" in alone["p4"]


def test_follow_up_turn_reuses_the_conversation(real_model, make_backend, run_one) -> None:
    backend = make_backend(real_model, chunk_size=16)
    first = run_one(backend, chat("1", "Name a colour.", max_tokens=16))
    turn = (
        ChatMessage("user", "Name a colour."),
        ChatMessage("assistant", first.text),
        ChatMessage("user", "Another one?"),
    )
    second = run_one(backend, Submit("2", SamplingParams(max_tokens=4, temperature=0.0), messages=turn))
    # The first prompt's whole chunks open the second prompt (the generated
    # tokens' KV, computed by decode, is not reused).
    assert second.started.cached_tokens == first.started.prompt_tokens // 16 * 16 > 0


# ---------------------------------------------------------------- grammars and logprobs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "hobbies", "employed"],
    "additionalProperties": False,
}


# Seeds whose answers are short (under 70 tokens): any seed must give valid JSON, these keep the test quick.
@pytest.mark.parametrize("seed", [0, 1, 3])
def test_json_schema_output_is_valid_json_at_temperature_1(real_model, make_backend, run_one, seed) -> None:
    grammar = LLMatcher.grammar_from_json_schema(PERSON)
    backend = make_backend(real_model)
    submit = chat(
        "j",
        "Describe a fictional person as JSON.",
        max_tokens=300,
        temperature=1.0,
        seed=seed,
        grammar=grammar,
        grammar_param="response_format",
    )
    r = run_one(backend, submit)
    assert r.finished.finish_reason is FinishReason.STOP, r.text
    jsonschema.validate(json.loads(r.text), PERSON)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_with_drafting_keeps_the_output(real_model, make_backend, run_one, temperature) -> None:
    grammar = LLMatcher.grammar_from_json_schema(PERSON)
    example = '{"name": "Ada Lovelace", "age": 36, "hobbies": ["mathematics", "poetry"], "employed": false}'
    results = []
    for drafting in (False, True):
        backend = make_backend(real_model, draft_mode="ngram" if drafting else "none")
        submit = chat(
            "d",
            f"Repeat this JSON exactly: {example}",
            max_tokens=120,
            temperature=temperature,
            seed=7,
            grammar=grammar,
        )
        results.append(run_one(backend, submit))
    plain, drafted = results
    assert (plain.text, plain.finished.completion_tokens) == (
        drafted.text,
        drafted.finished.completion_tokens,
    )
    assert drafted.finished.draft_accepted > 0
    jsonschema.validate(json.loads(plain.text), PERSON)
    if temperature == 0.0:
        assert json.loads(plain.text)["name"] == "Ada Lovelace"


def test_logprobs_line_up_with_the_text(real_model, make_backend, run_one) -> None:
    backend = make_backend(real_model)
    r = run_one(
        backend, chat("l", "Write one sentence about the sea.", max_tokens=40, logprobs=5, stop=("wave",))
    )
    assert r.text
    for delta in r.deltas:
        assert delta.logprobs is not None
        assert "".join(e.token for e in delta.logprobs) == delta.text
        for e in delta.logprobs:
            assert len(e.top) == 5 and e.logprob <= 0.0
            assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
            assert e.top[0].token_bytes == e.token_bytes  # greedy: the most likely token
            assert e.top[0].logprob == e.logprob


def test_issue_28_fields_on_the_real_model(real_model, make_backend, run_one) -> None:
    """The fields issue 28 found ignored, on the embedded model as the README serves
    it: ``banned_strings: ["Paris"]`` at temperature 0 never writes Paris (any case);
    XTC at probability 1 changes a seeded sample; ``banned_tokens`` of the greedy
    answer's tokens keep them out."""
    backend = make_backend(real_model)
    question = "What is the capital of France? Answer in one sentence."
    greedy = run_one(backend, chat("a", question, temperature=0.0, max_tokens=24))
    assert "paris" in greedy.text.lower()
    banned = run_one(backend, chat("b", question, temperature=0.0, max_tokens=24, banned_strings=("Paris",)))
    assert "paris" not in banned.text.lower() and banned.text
    seeded = {"temperature": 0.7, "seed": 1, "max_tokens": 16}
    plain = run_one(backend, chat("c", question, **seeded))
    xtc = run_one(backend, chat("d", question, **seeded, xtc_probability=1.0, xtc_threshold=0.01))
    assert xtc.text != plain.text
    # Greedy, the model repeats "LALA" after a blank line; DRY charges the token that extends it.
    la = "Write the word 'la' ten times, separated by spaces."
    dry = run_one(backend, chat("e", la, max_tokens=10))
    dried = run_one(backend, chat("f", la, max_tokens=10, dry_multiplier=2.0, dry_allowed_length=1))
    assert dried.text != dry.text
