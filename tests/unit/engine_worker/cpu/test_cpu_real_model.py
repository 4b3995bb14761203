"""CpuBackend on the real embedded SmolLM2-135M-Instruct (slow: one shared model)."""

from __future__ import annotations

import pytest

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


def test_follow_up_turn_reuses_the_conversation(real_model, make_backend, run_one) -> None:
    backend = make_backend(real_model, chunk_size=64)
    first = run_one(backend, chat("1", "Name a colour.", max_tokens=16))
    turn = (
        ChatMessage("user", "Name a colour."),
        ChatMessage("assistant", first.text),
        ChatMessage("user", "Another one?"),
    )
    second = run_one(backend, Submit("2", SamplingParams(max_tokens=4, temperature=0.0), messages=turn))
    # The first prompt and the tokens generated after it open the second prompt.
    assert first.started.prompt_tokens < second.started.cached_tokens < second.started.prompt_tokens
