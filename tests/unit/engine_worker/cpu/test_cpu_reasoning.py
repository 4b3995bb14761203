"""The CPU engine splits a reasoning model's thinking from its answer on token ids
(``engine_worker.reasoning``): channels on the deltas, budgets forced, the grammar
on the answer only, counts in ``Finished``. The model is a scripted tiny Llama over
a Qwen3 tokenizer (``tests/unit/engine_worker/reasoning/vocab.py``: the real
marker ids, the Qwen3 chat template)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from engine_worker.cpu.model_store import LoadedModel
from protocol.messages import Channel, ChatMessage, SamplingParams, Submit, TokenDelta
from tests.fakes.cpu import ScriptedLlama, tiny_random_llama
from tests.unit.engine_worker.reasoning.vocab import family_tokenizer, ids

THINK, END_THINK, TOOL_CALL, IM_END = 151667, 151668, 151657, 151645


@pytest.fixture(scope="module")
def qwen3() -> LoadedModel:
    tok = family_tokenizer("qwen3")
    tiny = tiny_random_llama(tok, seed=0, hidden_size=32, model_id="tiny-qwen3")
    model = ScriptedLlama(tiny.model.config)
    model.load_state_dict(tiny.model.state_dict())
    model.eval()
    return LoadedModel(model=model, tokenizer=tok, model_id="tiny-qwen3")


def script(loaded: LoadedModel, chain: list[int]) -> None:
    """The model writes ``chain`` after the generation prompt's last token (``\\n``)."""
    steps = [10, *chain]
    assert isinstance(loaded.model, ScriptedLlama)
    loaded.model.setup_script(dict(itertools.pairwise(steps)))


def chat(rid: str, **params: Any) -> Submit:
    params.setdefault("max_tokens", 16)
    params.setdefault("temperature", 0.0)
    kwargs = params.pop("template_kwargs_json", None)
    return Submit(
        request_id=rid,
        params=SamplingParams(**params),
        messages=(ChatMessage("user", "Why?"),),
        template_kwargs_json=kwargs,
    )


def split(deltas: list[TokenDelta]) -> tuple[str, str]:
    thinking = "".join(d.text for d in deltas if d.channel is Channel.REASONING)
    answer = "".join(d.text for d in deltas if d.channel is Channel.CONTENT)
    return thinking, answer


def test_thinking_and_answer_come_apart_on_the_marker_ids(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    script(qwen3, [THINK, *ids(tok, "ab"), END_THINK, *ids(tok, "c"), IM_END])
    backend = make_backend(qwen3)
    assert backend.info.reasoning_parser == "qwen3"
    r = run_one(backend, chat("r1"))
    assert split(r.deltas) == ("ab", "c")
    assert all(d.text for d in r.deltas)  # no empty deltas; no marker text anywhere
    assert "think" not in r.text
    fin = r.finished
    assert fin.finish_reason == "stop"
    assert fin.reasoning_tokens == 4  # <think>, a, b, </think>
    assert fin.completion_tokens == 6
    assert sum(d.num_tokens for d in r.deltas) <= fin.completion_tokens


def test_the_budget_forces_the_end_marker(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    # Left alone the model would think "abab..." forever.
    a, b = ids(tok, "ab")
    qwen3.model.setup_script(
        {10: THINK, THINK: a, a: b, b: a, END_THINK: ids(tok, "c")[0], ids(tok, "c")[0]: IM_END}
    )
    backend = make_backend(qwen3)
    r = run_one(backend, chat("r2", reasoning_budget=3))
    assert split(r.deltas) == ("aba", "c")
    assert r.finished.reasoning_tokens == 5
    # The worker's default budget applies when the request sets none.
    r = run_one(make_backend(qwen3, reasoning_budget=1), chat("r3"))
    assert split(r.deltas) == ("a", "c")


def test_budget_zero_switches_the_template_off(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    script(qwen3, [*ids(tok, "ok"), IM_END])
    backend = make_backend(qwen3)
    prepared = backend.prepare(chat("r4", reasoning_budget=0))
    assert END_THINK in backend.prompt_ids(prepared)[-4:]  # enable_thinking=false wrote <think></think>
    r = run_one(backend, chat("r4", reasoning_budget=0))
    assert split(r.deltas) == ("", "ok") and r.finished.reasoning_tokens == 0
    # chat_template_kwargs reach the template as they are.
    prepared = backend.prepare(chat("r5", template_kwargs_json='{"enable_thinking": false}'))
    assert END_THINK in backend.prompt_ids(prepared)[-4:]


def test_cut_inside_the_span_is_all_thinking(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    script(qwen3, [THINK, *ids(tok, "abcdef"), END_THINK, IM_END])
    r = run_one(make_backend(qwen3), chat("r6", max_tokens=3))
    assert split(r.deltas) == ("ab", "")
    assert r.finished.finish_reason == "length" and r.finished.reasoning_tokens == 3


def test_the_grammar_applies_to_the_answer_only(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    # The model thinks "ab" (which the grammar would forbid), then answers what it likes;
    # the grammar makes the answer "yes".
    script(qwen3, [THINK, *ids(tok, "ab"), END_THINK, *ids(tok, "zz"), IM_END])
    r = run_one(make_backend(qwen3), chat("r7", grammar='start: "yes"', grammar_param="response_format"))
    assert split(r.deltas) == ("ab", "yes")
    assert r.finished.finish_reason == "stop"


def test_a_tool_call_inside_the_span_ends_it(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    script(qwen3, [THINK, *ids(tok, "a"), TOOL_CALL, *ids(tok, "{}"), IM_END])
    r = run_one(make_backend(qwen3), chat("r8"))
    assert split(r.deltas) == ("a", "<tool_call>{}")


def test_stop_strings_match_the_answer_not_the_thinking(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    # Bigrams: x y z </think> w y (z ...), the answer's y the same token as the thinking's.
    script(qwen3, [THINK, *ids(tok, "xyz"), END_THINK, *ids(tok, "wy")])
    r = run_one(make_backend(qwen3), chat("r9", stop=("y",)))
    assert split(r.deltas) == ("xyz", "w")
    assert r.finished.finish_reason == "stop"


def test_logprobs_cover_the_answer(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    script(qwen3, [THINK, *ids(tok, "ab"), END_THINK, *ids(tok, "cd"), IM_END])
    r = run_one(make_backend(qwen3), chat("r10", logprobs=1))
    content = [d for d in r.deltas if d.channel is Channel.CONTENT]
    entries = [e for d in content for e in d.logprobs or ()]
    assert "".join(e.token for e in entries) == "cd"
    assert all(d.logprobs is None for d in r.deltas if d.channel is Channel.REASONING)


def test_no_parser_leaves_every_token_content(qwen3, make_backend, run_one) -> None:
    tok = qwen3.tokenizer
    script(qwen3, [THINK, *ids(tok, "ab"), END_THINK, IM_END])
    backend = make_backend(qwen3, reasoning_parser="none")
    assert backend.info.reasoning_parser is None
    r = run_one(backend, chat("r11"))
    assert split(r.deltas) == ("", "<think>ab</think>")
    assert r.finished.reasoning_tokens == 0
