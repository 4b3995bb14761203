"""ExLlamaV3 splits a reasoning model's thinking from its answer
(``engine_worker.reasoning.text_split`` over the job's ids and text), on the fake
1.6.5 generator. The fake's vocabulary is bytes, so the markers are the ids
``</think>`` encodes to (a parser chosen by name): matched as id sequences,
held while they may be starting, never shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_worker.admission import checked_prepare
from engine_worker.backend import RequestRejected
from engine_worker.settings import WorkerSettings
from protocol.messages import Channel, FinishReason, SamplingParams, Submit, TokenDelta
from tests.fakes import exllamav3 as fx
from tests.fakes.exllamav3_driver import add, chat, check_lifecycle, finished, make_backend, of, raw, run

QWEN3 = (Path(__file__).resolve().parents[3] / "data" / "reasoning" / "qwen3.jinja").read_text()


def settings(**kwargs: object) -> WorkerSettings:
    return WorkerSettings(backend="exllamav3", model_dir=Path("/models/fake-exl3"), **kwargs)  # type: ignore[arg-type]


def channels(events: list[object], rid: str) -> tuple[str, str]:
    deltas = [e for e in of(events, rid) if isinstance(e, TokenDelta)]  # type: ignore[arg-type]
    assert all(d.text for d in deltas)
    think = "".join(d.text for d in deltas if d.channel is Channel.REASONING)
    answer = "".join(d.text for d in deltas if d.channel is Channel.CONTENT)
    return think, answer


def test_deepseek_r1_output_starts_inside_the_span() -> None:
    backend, _ = make_backend(settings(reasoning_parser="deepseek_r1"), script=fx.reply("ab</think>cd"))
    assert backend.info.reasoning_parser == "deepseek_r1"
    add(backend, chat("a", "hi"))
    events = run(backend)
    check_lifecycle(events, "a")
    assert channels(events, "a") == ("ab", "cd")
    fin = finished(events, "a")
    assert fin.reasoning_tokens == 2 + len(b"</think>")
    assert fin.completion_tokens == len(b"ab</think>cd") + 1  # and <|im_end|>


def test_a_marker_split_across_results_is_never_shown() -> None:
    # A stop string the Job matches (the template's turn end, which applies in the thinking
    # too) holds "</thin..." back in the job until ">" shows it is no stop.
    backend, rec = make_backend(
        settings(reasoning_parser="deepseek_r1"), script=fx.reply("ab</think>cd"), stop_strings=("</thinx",)
    )
    add(backend, raw("a", "x"))
    events = run(backend)
    streamed = [r for r in rec.results if r.get("stage") == "streaming" and not r.get("eos")]
    assert any("text" not in r for r in streamed)  # held
    assert channels(events, "a") == ("ab", "cd")
    assert "think" not in "".join(e.text for e in of(events, "a") if isinstance(e, TokenDelta))


def test_cut_inside_the_span_is_all_thinking() -> None:
    backend, _ = make_backend(settings(reasoning_parser="deepseek_r1"), script=fx.reply("abcdef</think>x"))
    add(backend, chat("a", "hi", max_tokens=4))
    events = run(backend)
    assert channels(events, "a") == ("abcd", "")
    assert finished(events, "a").finish_reason is FinishReason.LENGTH


def test_qwen3_budget_zero_switches_the_template_off() -> None:
    backend, _ = make_backend(settings(reasoning_parser="qwen3"), script=fx.reply("ok"), chat_template=QWEN3)
    prepared = backend.prepare(chat("a", "hi", reasoning_budget=0))
    prompt = backend.detokenize(backend.prompt_ids(prepared))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    add(backend, chat("a", "hi", reasoning_budget=0))
    events = run(backend)
    assert channels(events, "a") == ("", "ok")
    assert finished(events, "a").reasoning_tokens == 0


def test_qwen3_thinks_when_it_opens_the_span() -> None:
    backend, _ = make_backend(
        settings(reasoning_parser="qwen3"), script=fx.reply("<think>hm</think>yes"), chat_template=QWEN3
    )
    add(backend, chat("a", "hi"))
    events = run(backend)
    assert channels(events, "a") == ("hm", "yes")


def test_a_grammar_with_thinking_off_is_the_answers() -> None:
    backend, _ = make_backend(settings(reasoning_parser="deepseek_r1"), script=fx.reply("x"))
    grammar = 'start: "x"'
    # No thinking: the span is closed in the prompt and the grammar is the answer's.
    add(backend, chat("b", "hi", grammar=grammar, grammar_param="response_format", reasoning_budget=0))
    events = run(backend)
    assert channels(events, "b") == ("", "x")


def test_no_parser_by_default_on_a_template_without_thinking() -> None:
    backend, _ = make_backend(script=fx.reply("<think>a</think>b"))
    assert backend.info.reasoning_parser is None
    add(backend, chat("a", "hi"))
    events = run(backend)
    assert channels(events, "a") == ("", "<think>a</think>b")


def test_the_budget_forces_the_end_marker() -> None:
    # Left alone the model thinks "abab..." to the end; a budget of 3 ends it after "aba".
    backend, _ = make_backend(settings(reasoning_parser="deepseek_r1"), script=fx.reply("ab" * 20))
    add(backend, chat("a", "hi", reasoning_budget=3, max_tokens=3 + len(b"</think>") + 2))
    events = run(backend)
    think, answer = channels(events, "a")
    assert think == "aba"
    assert answer == "ba"  # the script goes on where the marker interrupted it (its own output index)
    fin = finished(events, "a")
    assert fin.reasoning_tokens == 3 + len(b"</think>")
    assert fin.finish_reason is FinishReason.LENGTH


def test_no_answer_filter_means_budgets_are_refused() -> None:
    import dataclasses

    from engine_worker.exllamav3 import ExLlamaV3Backend

    handle = dataclasses.replace(fx.make_handle(script=fx.reply("x")), new_answer_filter=None)
    backend = ExLlamaV3Backend(handle, settings(reasoning_parser="deepseek_r1"))
    assert not backend.info.thinking_budget  # a flag of ModelInfo, checked by admission
    with pytest.raises(RequestRejected) as e:
        checked_prepare(backend, chat("a", "hi", reasoning_budget=5))
    assert e.value.param == "thinking_budget_tokens"


# ---------------------------------------------------------------- /tokenize and /detokenize fields


def test_the_leading_specials_are_what_plain_text_gets_and_detokenize_can_skip_specials() -> None:
    """``Tokenize.add_special_tokens`` puts ``text_prefix_ids`` before a rendered template:
    exactly what the tokenizer puts before plain text (a raw prompt with and without BOS
    differ by it); ``skip_special_tokens`` leaves the special tokens' text out."""
    backend, _ = make_backend(settings(add_bos=True))
    with_bos = backend.prompt_ids(backend.prepare(raw("a", "hi there")))
    without = backend.prompt_ids(
        backend.prepare(Submit("b", SamplingParams(max_tokens=1), prompt="hi there", add_bos=False))
    )
    assert backend.text_prefix_ids() == [fx.BOS] and with_bos == [fx.BOS, *without]
    plain, _ = make_backend(settings(add_bos=False))
    assert plain.text_prefix_ids() == []
    ids = [fx.BOS, fx.IM_START, *without, fx.IM_END]
    assert backend.detokenize(ids) == "<s><|im_start|>hi there<|im_end|>"
    assert backend.detokenize(ids, skip_special_tokens=True) == "hi there"
