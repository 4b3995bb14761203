"""The chat and text completions dialects: request validation and conversion into ``protocol.Submit``."""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson
import pytest

from protocol import ChatMessage, Submit
from proxy.core.dialect import Context
from proxy.core.task import prompt_chars
from proxy.dialects.chat import ChatJob
from proxy.dialects.chat.request import ChatCompletionRequest, parse_chat_request
from proxy.dialects.completions import CompletionJob, CompletionRequest, parse_completion_request
from proxy.errors import InvalidRequest
from proxy.tools import choose_format
from proxy.tools.grammar import json_rule_schema


def to_submits(req: ChatCompletionRequest | CompletionRequest, rid: str, max_ctx: int) -> list[Submit]:
    job = ChatJob(req) if isinstance(req, ChatCompletionRequest) else CompletionJob(req)
    return job.submits(rid, Context(max_ctx, choose_format("auto", None), "m"))[0]


def to_submit(req: ChatCompletionRequest | CompletionRequest, rid: str, max_ctx: int) -> Submit:
    return to_submits(req, rid, max_ctx)[0]


MSGS = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return orjson.dumps({"messages": MSGS, **fields})


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b'{"messages": [', None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (b"{}", "messages", "messages"),
        (b'{"messages": "hi"}', "messages", "array"),
        (b'{"messages": []}', "messages", "at least one"),
        (b'{"messages": [{"content": "x"}]}', "messages[0].role", "role"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content", "content"),
        (chat(max_tokens=-1), "max_tokens", ">= 1"),
        (chat(max_tokens="10"), "max_tokens", "str"),
        (chat(max_completion_tokens=0), "max_completion_tokens", ">= 1"),
        (chat(n=0), "n", ">= 1"),
        (chat(temperature=2.5), "temperature", "<= 2.0"),
        (chat(temperature=-0.1), "temperature", ">= 0.0"),
        (chat(temperature="hot"), "temperature", "str"),
        (chat(top_p=0), "top_p", "> 0.0"),
        (chat(stop=3), "stop", "int"),
        (chat(stream="yes"), "stream", "str"),
        (chat(logit_bias={"abc": 1}), "logit_bias", "abc"),
        (chat(logit_bias={"5": 101}), "logit_bias", "100"),
        (
            orjson.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content[0]",
            "image_url",
        ),
    ],
)
def test_bad_chat_bodies_name_the_param(body: bytes, param: str | None, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        req = parse_chat_request(body)
        to_submit(req, "r", 100)
    err = info.value
    assert err.status == 400
    assert err.type == "invalid_request_error"
    assert err.param == param
    assert fragment in err.message
    if param is not None:
        assert param.split("[")[0].split(".")[0] in err.message


def test_completion_prompt_is_text_or_a_list_of_texts() -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request(b'{"prompt": []}')
    assert info.value.param == "prompt"
    req = parse_completion_request(b'{"prompt": ["a", "b"], "n": 2}')
    submits = to_submits(req, "cmpl-x", 100)
    assert [(s.request_id, s.prompt, s.n) for s in submits] == [("cmpl-x-p0", "a", 2), ("cmpl-x-p1", "b", 2)]
    with pytest.raises(InvalidRequest) as info:
        parse_completion_request(b'{"prompt": [1, 2]}')
    assert info.value.param == "prompt[0]"


def test_content_parts_are_flattened_and_developer_becomes_system() -> None:
    body = orjson.dumps(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ]
        }
    )
    submit = to_submit(parse_chat_request(body), "r1", 100)
    assert submit.messages == (
        ChatMessage("system", "be brief"),
        ChatMessage("user", "a\nb"),
        ChatMessage("assistant", ""),
    )
    assert submit.prompt is None


def test_max_completion_tokens_wins_and_absent_means_context() -> None:
    s = to_submit(parse_chat_request(chat(max_tokens=7, max_completion_tokens=9)), "r", 100)
    assert s.params.max_tokens == 9
    s = to_submit(parse_chat_request(chat(max_tokens=7)), "r", 100)
    assert s.params.max_tokens == 7
    s = to_submit(parse_chat_request(chat()), "r", 4321)
    assert s.params.max_tokens == 4321


def test_sampling_fields_are_honoured() -> None:
    body = chat(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=1234,
        stop=["</s>", "", "END"],
        logit_bias={"42": 5, "7": -100},
        min_tokens=3,
        ignore_eos=True,
        stop_token_ids=[2],
    )
    s = to_submit(parse_chat_request(body), "r", 100)
    p = s.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.5, 0.9, 40, 0.05)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.1, 0.5, -0.5)
    assert p.seed == 1234
    assert p.stop == ("</s>", "END")
    assert p.logit_bias == {42: 5.0, 7: -100.0}
    assert (p.min_tokens, p.ignore_eos, p.stop_token_ids) == (3, True, (2,))


def test_defaults_and_single_stop_string() -> None:
    s = to_submit(parse_chat_request(chat(stop="\n\n", top_k=-1)), "r", 100)
    p = s.params
    assert p.stop == ("\n\n",)
    assert p.top_k == 0
    assert (p.temperature, p.top_p, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0.0, 1.0)
    assert p.seed is None and p.logit_bias is None


def test_n_is_one_submit_carrying_n_and_the_request_seed() -> None:
    s = to_submit(parse_chat_request(chat(n=3, seed=7, temperature=0.9)), "chatcmpl-x", 100)
    assert (s.request_id, s.n, s.params.seed) == ("chatcmpl-x", 3, 7)
    one = to_submit(parse_chat_request(chat()), "chatcmpl-x", 100)
    assert (one.request_id, one.n, one.params.seed) == ("chatcmpl-x", 1, None)
    text = to_submit(parse_completion_request(b'{"prompt": "x", "n": 2}'), "cmpl-y", 100)
    assert (text.n, text.prompt) == (2, "x")


def test_prompt_chars_counts_the_text_the_client_sent() -> None:
    body = orjson.dumps(
        {
            "messages": [
                {"role": "system", "content": "abc"},
                {"role": "user", "content": [{"type": "text", "text": "de"}]},
            ]
        }
    )
    assert prompt_chars(to_submit(parse_chat_request(body), "r", 100)) == (5, "messages")
    text = to_submit(parse_completion_request('{"prompt": "héllo"}'.encode()), "r", 100)
    assert prompt_chars(text) == (5, "prompt")


def test_completion_prompt_forms() -> None:
    s = to_submit(parse_completion_request(b'{"prompt": "once", "max_tokens": 5}'), "c", 100)
    assert (s.prompt, s.messages, s.params.max_tokens) == ("once", (), 5)
    s = to_submit(parse_completion_request(b'{"prompt": ["upon"]}'), "c", 100)
    assert s.prompt == "upon"


def test_unknown_fields_are_ignored_and_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="proxy.core.fields"):
        req = parse_chat_request(chat(tools=[], frobnicate=1, user="u"))
    assert req.messages[0].content == "hi"
    assert any("frobnicate" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_stream_flags() -> None:
    r = parse_chat_request(chat(stream=True, return_progress=True, stream_options={"include_usage": True}))
    assert (r.return_progress, r.include_usage, r.continuous_usage) == (True, True, False)
    r = parse_chat_request(
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    )
    assert r.continuous_usage is True
    r = parse_chat_request(chat(stream=True, stream_options={"continuous_usage_stats": True}))
    assert r.continuous_usage is False


def test_top_level_nulls_mean_not_given() -> None:
    body = chat(n=None, stream=None, max_tokens=None, stop=None, ignore_eos=None, stream_options=None)
    req = parse_chat_request(body)
    s = to_submit(req, "r", 77)
    assert (req.n, req.stream, s.params.max_tokens, s.params.stop, s.params.ignore_eos) == (
        1,
        False,
        77,
        (),
        False,
    )
    req = parse_chat_request(chat(stream=True, stream_options={"include_usage": None}))
    assert req.include_usage is False
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(b'{"messages": null}')
    assert info.value.param == "messages"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        # Values that validate as JSON numbers but cannot travel to the worker as
        # MessagePack ints or be used as token indices.
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 2**64}, "max_tokens"),
        ({"max_completion_tokens": 2**31}, "max_completion_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids[0]"),
        ({"logit_bias": {str(2**70): 1}}, "logit_bias"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user\u0000", "content": "hi"}]}, "messages[0].role"),
    ],
)
def test_out_of_range_values_are_invalid_requests(fields: dict[str, Any], param: str) -> None:
    body = json.dumps({"messages": MSGS, **fields}).encode()  # orjson refuses ints beyond 64 bits
    with pytest.raises(InvalidRequest) as e:
        req = parse_chat_request(body)
        to_submit(req, "c", 100)
    assert e.value.param == param


def test_deeply_nested_json_is_invalid_json_not_a_crash() -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_chat_request(body)


def test_tiny_temperature_is_greedy() -> None:
    s = to_submit(parse_chat_request(chat(temperature=1e-300)), "c", 100)
    assert s.params.temperature == 0.0
    s = to_submit(parse_chat_request(chat(temperature=0.5)), "c", 100)
    assert s.params.temperature == 0.5


_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("prediction", {"type": "content", "content": "x"}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy"}),
    ],
)
def test_openai_fields_not_implemented_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_chat_request(orjson.dumps({**_CHAT, field: value}))
    assert exc.value.param == field and "not supported" in exc.value.message


@pytest.mark.parametrize(("field", "value"), [("suffix", "end"), ("best_of", 3)])
def test_completion_fields_not_implemented_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_completion_request(orjson.dumps({"prompt": "hi", field: value}))
    assert exc.value.param == field


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}},
        {"logprobs": False, "top_logprobs": 0, "modalities": ["text"], "tools": None},
    ],
)
def test_values_that_ask_for_nothing_are_accepted(extra: dict[str, Any]) -> None:
    assert parse_chat_request(orjson.dumps({**_CHAT, **extra})).messages[0].content == "hi"


@pytest.mark.parametrize("key", [" 1", "1_0", "+1", "\u0661", "-1", ""])
def test_logit_bias_keys_are_plain_digits(key: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        to_submit(parse_chat_request(orjson.dumps({**_CHAT, "logit_bias": {key: 1}})), "r", 100)
    assert exc.value.param == "logit_bias"


def test_logprobs_fields_become_the_wire_count() -> None:
    assert to_submit(parse_chat_request(chat()), "c", 100).params.logprobs is None
    req = parse_chat_request(orjson.dumps({**_CHAT, "logprobs": True}))
    assert to_submit(req, "c", 100).params.logprobs == 0
    req = parse_chat_request(orjson.dumps({**_CHAT, "logprobs": True, "top_logprobs": 20}))
    assert to_submit(req, "c", 100).params.logprobs == 20
    req2 = parse_completion_request(orjson.dumps({"prompt": "hi", "logprobs": 3}))
    assert to_submit(req2, "c", 100).params.logprobs == 3


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**_CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**_CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({**_CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_bad_logprobs_and_response_formats_are_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        to_submit(parse_chat_request(orjson.dumps(body)), "c", 100)
    assert exc.value.param == param


def test_response_format_becomes_a_grammar_llguidance_accepts() -> None:
    from llguidance import LLMatcher

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    params = to_submit(parse_chat_request(orjson.dumps({**_CHAT, "response_format": rf})), "c", 100).params
    assert params.grammar is not None and params.grammar_param == "response_format.json_schema"
    assert LLMatcher.validate_grammar(params.grammar) == ""
    assert orjson.loads(params.grammar)["grammars"][0]["json_schema"] == json_rule_schema(schema, strict=True)
    obj = parse_chat_request(orjson.dumps({**_CHAT, "response_format": {"type": "json_object"}}))
    assert to_submit(obj, "c", 100).params.grammar is not None
    text = parse_chat_request(orjson.dumps({**_CHAT, "response_format": {"type": "text"}}))
    assert to_submit(text, "c", 100).params.grammar is None


def test_completions_default_to_16_tokens_as_openai() -> None:
    req = parse_completion_request(orjson.dumps({"prompt": "hi"}))
    assert to_submit(req, "c", 4096).params.max_tokens == 16
    chat_req = parse_chat_request(orjson.dumps(_CHAT))
    assert to_submit(chat_req, "c", 4096).params.max_tokens == 4096


def test_echo_with_logprobs_is_refused() -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_completion_request(orjson.dumps({"prompt": "hi", "echo": True, "logprobs": 1}))
    assert exc.value.param == "echo"
