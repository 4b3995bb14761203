"""The reasoning parsers over each family's tokenizer (real marker ids) and chat
template (``tests/data/reasoning``)."""

from __future__ import annotations

from typing import Any

import pytest

from engine_worker.reasoning import choose, template_kwargs
from engine_worker.reasoning.base import Splitter, VocabFromHF
from protocol.messages import Channel
from tests.unit.engine_worker.reasoning.vocab import family_tokenizer, ids

pytest.importorskip("transformers")

USER = [{"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module", params=["qwen3", "deepseek_r1", "gpt_oss", "mistral"])
def family(request: Any) -> tuple[str, Any]:
    return request.param, family_tokenizer(request.param)


def tok_of(name: str) -> Any:
    return family_tokenizer(name)


def run(splitter: Splitter, tokens: list[int]) -> tuple[list[int], list[int], int]:
    """(thinking ids, answer ids, swallowed count)."""
    thinking: list[int] = []
    answer: list[int] = []
    swallowed = 0
    settled = [s for t in tokens for s in splitter.feed(t)] + splitter.flush()
    for channel, t in settled:
        if channel is Channel.REASONING:
            thinking.append(t)
        elif channel is Channel.CONTENT:
            answer.append(t)
        else:
            swallowed += 1
    assert len(settled) == len(tokens)  # every token settled exactly once
    return thinking, answer, swallowed


def prompt(tok: Any, **kwargs: Any) -> list[int]:
    text = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False, **kwargs)
    return ids(tok, text)


def test_auto_picks_each_family_from_its_template(family: tuple[str, Any]) -> None:
    name, tok = family
    parser = choose("auto", tok.chat_template, VocabFromHF(tok))
    assert parser is not None and parser.name == name


def test_auto_picks_none_for_a_template_without_thinking() -> None:
    tok = tok_of("qwen3")
    assert choose("auto", "{{ messages[0].content }}", VocabFromHF(tok)) is None
    assert choose("none", tok.chat_template, VocabFromHF(tok)) is None


def test_deepseek_r1_starts_inside_and_the_end_marker_closes_it() -> None:
    tok = tok_of("deepseek_r1")
    parser = choose("auto", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    p = prompt(tok)
    assert p[-2:] == [151648, 10]  # the template opened the span: <think>\n
    plan = parser.plan(p, None)
    out = [*ids(tok, "So"), 151649, *ids(tok, "Yes")]
    thinking, answer, swallowed = run(plan.new_splitter(), out)
    assert tok.decode(thinking) == "So" and tok.decode(answer) == "Yes" and swallowed == 1


def test_deepseek_r1_cut_inside_the_span_is_all_thinking() -> None:
    tok = tok_of("deepseek_r1")
    parser = choose("deepseek_r1", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    splitter = parser.plan(prompt(tok), None).new_splitter()
    thinking, answer, _ = run(splitter, ids(tok, "still thinking"))
    assert tok.decode(thinking) == "still thinking" and answer == []
    assert splitter.reasoning_tokens == len(thinking)


def test_qwen3_opens_the_span_itself_and_tool_call_ends_it() -> None:
    tok = tok_of("qwen3")
    parser = choose("auto", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    plan = parser.plan(prompt(tok), None)
    out = [151667, *ids(tok, "hm"), 151657, *ids(tok, '{"name":"f"}'), 151658]
    splitter = plan.new_splitter()
    thinking, answer, swallowed = run(splitter, out)
    assert tok.decode(thinking) == "hm"
    assert tok.decode(answer) == '<tool_call>{"name":"f"}</tool_call>'  # the call is the answer's
    assert swallowed == 1 and splitter.reasoning_tokens == 3


def test_qwen3_answer_without_thinking_is_all_content() -> None:
    tok = tok_of("qwen3")
    parser = choose("qwen3", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    out = [*ids(tok, "Hi"), 151667, *ids(tok, "x")]  # a <think> later in the answer is text
    thinking, answer, _ = run(parser.plan(prompt(tok), None).new_splitter(), out)
    assert thinking == [] and answer == out


def test_qwen3_enable_thinking_false_closes_the_span_in_the_prompt() -> None:
    tok = tok_of("qwen3")
    parser = choose("qwen3", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    kwargs = template_kwargs(None, tok.chat_template, 0)
    assert kwargs == {"enable_thinking": False}
    p = prompt(tok, **kwargs)
    assert 151668 in p[-4:]
    splitter = parser.plan(p, 0).new_splitter()
    out = [151667, *ids(tok, "x")]  # even a <think> first is text now: the span is over
    assert run(splitter, out)[1] == out


def test_client_kwargs_win_over_the_switch() -> None:
    tpl = tok_of("qwen3").chat_template
    assert template_kwargs('{"enable_thinking": true}', tpl, 0) == {"enable_thinking": True}
    assert template_kwargs(None, tok_of("deepseek_r1").chat_template, 0) == {}
    with pytest.raises(ValueError):
        template_kwargs("[1]", tpl, None)


def test_budget_forces_the_end_marker_after_n_thinking_tokens() -> None:
    tok = tok_of("qwen3")
    parser = choose("qwen3", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    splitter = parser.plan(prompt(tok), 2).new_splitter()
    assert splitter.forced() is None
    splitter.feed(151667)
    splitter.feed(97)
    assert splitter.forced() is None
    splitter.feed(98)
    assert splitter.forced() == 151668
    splitter.feed(151668)
    assert splitter.forced() is None and not splitter.free


def test_budget_zero_on_a_prompt_inside_the_span_closes_it_in_the_prompt() -> None:
    tok = tok_of("deepseek_r1")
    parser = choose("deepseek_r1", None, VocabFromHF(tok))
    assert parser is not None
    p = prompt(tok)
    plan = parser.plan(p, 0)
    assert plan.prompt_ids == [*p, 151649]
    splitter = plan.new_splitter()
    assert splitter.forced() is None and not splitter.free
    assert run(splitter, ids(tok, "ok"))[1] == ids(tok, "ok")


def test_budget_zero_bans_the_opening_marker_of_a_family_that_opens_it() -> None:
    tok = tok_of("mistral")
    parser = choose("mistral", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    assert parser.plan([1, 3], 0).new_splitter().banned() == 34
    assert parser.plan([1, 3], None).new_splitter().banned() is None


def test_mistral_think_span() -> None:
    tok = tok_of("mistral")
    parser = choose("auto", tok.chat_template, VocabFromHF(tok))
    assert parser is not None and parser.name == "mistral"
    out = [34, *ids(tok, "hmm"), 35, *ids(tok, "Yes")]
    thinking, answer, swallowed = run(parser.plan(prompt(tok), None).new_splitter(), out)
    assert tok.decode(thinking) == "hmm" and tok.decode(answer) == "Yes" and swallowed == 2


def test_multi_token_markers_are_held_until_they_resolve() -> None:
    # deepseek_r1 by name on a vocabulary without a </think> token: matched as its ids.
    tok = tok_of("mistral")
    parser = choose("deepseek_r1", None, VocabFromHF(tok))
    assert parser is not None
    splitter = parser.plan([1, 3], None).new_splitter()
    end = ids(tok, "</think>")
    assert len(end) > 1
    assert splitter.feed(end[0]) == []  # may be the marker: held, never shown
    released = splitter.feed(ids(tok, "x")[0])  # it was not
    assert [c for c, _ in released] == [Channel.REASONING, Channel.REASONING]
    thinking, answer, _ = run(splitter, [*end, *ids(tok, "A")])
    assert thinking == [] and tok.decode(answer) == "A"


def test_gpt_oss_channels() -> None:
    tok = tok_of("gpt_oss")
    parser = choose("auto", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    assert parser.not_stops == frozenset({200007})
    p = prompt(tok, reasoning_effort="high")
    assert tok.decode(p).endswith("<|start|>assistant")
    out = [
        200005,
        *ids(tok, "analysis"),
        200008,
        *ids(tok, "think"),
        200007,
        200006,
        *ids(tok, "assistant"),
        200005,
        *ids(tok, "final"),
        200008,
        *ids(tok, "Answer"),
    ]
    splitter = parser.plan(p, None).new_splitter()
    thinking, answer, _ = run(splitter, out)
    assert tok.decode(thinking) == "think" and tok.decode(answer) == "Answer"
    assert splitter.reasoning_tokens == len(out) - len(answer)


def test_gpt_oss_budget_writes_the_final_header() -> None:
    tok = tok_of("gpt_oss")
    parser = choose("gpt_oss", None, VocabFromHF(tok))
    assert parser is not None
    splitter = parser.plan(prompt(tok), 1).new_splitter()
    for t in [200005, *ids(tok, "analysis"), 200008, *ids(tok, "t")]:
        assert splitter.forced() is None
        splitter.feed(t)
    forced = []
    while (f := splitter.forced()) is not None:
        forced.append(f)
        splitter.feed(f)
    assert tok.decode(forced) == "<|end|><|start|>assistant<|channel|>final<|message|>"
    assert not splitter.free


def _harmony(tok: Any) -> Any:
    parser = choose("gpt_oss", tok.chat_template, VocabFromHF(tok))
    assert parser is not None
    return parser.plan(prompt(tok), None)


def test_gpt_oss_a_call_message_is_the_answer_whole() -> None:
    # Thinking, then a call with the recipient in the channel header: the frame and the
    # arguments are the answer's text, for the proxy's harmony format.
    tok = tok_of("gpt_oss")
    analysis = [200005, *ids(tok, "analysis"), 200008, *ids(tok, "Need weather."), 200007]
    call = [
        200006,
        *ids(tok, "assistant"),
        200005,
        *ids(tok, "commentary to=functions.get_weather "),
        200003,
        *ids(tok, "json"),
        200008,
        *ids(tok, '{"city":"Paris"}'),
    ]
    splitter = _harmony(tok).new_splitter()
    thinking, answer, swallowed = run(splitter, [*analysis, *call])
    assert tok.decode(thinking) == "Need weather."
    assert tok.decode(answer) == (
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}'
    )
    assert swallowed == len(analysis) - len(thinking)
    assert splitter.reasoning_tokens == len(analysis)  # the call is the answer's, not thinking


def test_gpt_oss_a_recipient_in_the_role_part_and_on_analysis_is_a_call() -> None:
    tok = tok_of("gpt_oss")
    # At the start of the output (the prompt ends with <|start|>assistant), on the analysis channel.
    out = [*ids(tok, " to=functions.get_time"), 200005, *ids(tok, "analysis json"), 200008, *ids(tok, "{}")]
    thinking, answer, swallowed = run(_harmony(tok).new_splitter(), out)
    assert thinking == [] and swallowed == 0
    assert tok.decode(answer) == " to=functions.get_time<|channel|>analysis json<|message|>{}"


def test_gpt_oss_other_headers_stay_hidden_and_the_text_splitter_agrees() -> None:
    # ExLlamaV3's path: the same split over the job's (ids, text) results.
    from engine_worker.reasoning.text_split import TextSplitter

    tok = tok_of("gpt_oss")
    out = [
        200005,
        *ids(tok, "analysis"),
        200008,
        *ids(tok, "hm"),
        200007,
        200006,
        *ids(tok, "assistant"),
        200005,
        *ids(tok, "commentary"),
        200008,
        *ids(tok, "Checking."),
        200007,
        200006,
        *ids(tok, "assistant"),
        200005,
        *ids(tok, "commentary to=functions.f json"),
        200008,
        *ids(tok, "{}"),
    ]
    split = TextSplitter(_harmony(tok).new_splitter(), lambda i: tok.decode(list(i)))
    pieces = [p for t in out for p in split.feed([t], tok.decode([t]))]
    pieces += split.feed([], "", final=True)
    text = {c: "".join(p for ch, p, _ in pieces if ch is c) for c in (Channel.REASONING, Channel.CONTENT)}
    assert text[Channel.REASONING] == "hm"
    # The preamble (a commentary message without recipient) is text; its header is not.
    assert (
        text[Channel.CONTENT]
        == "Checking.<|start|>assistant<|channel|>commentary to=functions.f json<|message|>{}"
    )
