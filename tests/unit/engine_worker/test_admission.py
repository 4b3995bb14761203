import dataclasses
import math

import msgspec
import pytest

from engine_worker.admission import budget, check_prompt_fits, validate_request, validate_sampling
from engine_worker.backend import ModelInfo, Prepared, RequestRejected
from protocol import ChatMessage, ErrorCode, ImageInput, SamplingParams, Submit

OK = SamplingParams(max_tokens=8, stop_token_ids=(0, 99), logit_bias={99: -5.0})


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"stop_token_ids": (100,)}, "stop_token_ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_each_bad_value_names_its_field(change: dict[str, object], param: str) -> None:
    validate_sampling(OK, vocab_size=100)
    with pytest.raises(RequestRejected) as e:
        validate_sampling(msgspec.structs.replace(OK, **change), vocab_size=100)
    assert (e.value.code, e.value.param) == (ErrorCode.INVALID_REQUEST, param)


def test_prompt_must_leave_room_for_one_token() -> None:
    check_prompt_fits(99, 100, "messages", "setting: x")
    with pytest.raises(RequestRejected) as e:
        check_prompt_fits(100, 100, "messages", "setting: x")
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and e.value.param == "messages"
    assert "100" in e.value.message and "setting: x" in e.value.message
    with pytest.raises(RequestRejected) as e:
        check_prompt_fits(0, 100, "prompt", "setting: x")
    assert e.value.code is ErrorCode.INVALID_REQUEST and e.value.param == "prompt"


def _submit(**params: object) -> Submit:
    return Submit("r", msgspec.structs.replace(OK, **params), prompt="p")


def test_the_backends_limits_come_from_its_model_info() -> None:
    info = ModelInfo("m", 100, None, vocab_size=100, logprobs=True)
    validate_request(_submit(logit_bias={1: 100.0}, logprobs=20), info)
    for change, param in (({"logit_bias": {1: 100.5}}, "logit_bias"), ({"logprobs": 21}, "logprobs")):
        with pytest.raises(RequestRejected) as e:
            validate_request(_submit(**change), info)
        assert e.value.param == param
    with pytest.raises(RequestRejected):
        validate_request(_submit(logit_bias={1: -math.inf}), info)
    wide = ModelInfo("m", 100, None, vocab_size=100, max_logit_bias=1e30, logit_bias_ban=True, logprobs=True)
    validate_request(_submit(logit_bias={1: -math.inf, 2: 1e30}), wide)
    # no vocabulary (synthetic): ids are not checked
    validate_request(_submit(stop_token_ids=(10**6,)), ModelInfo("m", 100, None))


@pytest.mark.parametrize(
    ("submit", "capability", "param"),
    [
        (Submit("r", OK, prompt="p", tools_json="[]"), "template_tools", "tools"),
        (
            Submit("r", msgspec.structs.replace(OK, grammar="start: /a/"), prompt="p"),
            "grammar",
            "response_format",
        ),
        (
            Submit("r", msgspec.structs.replace(OK, grammar="start: /a/", grammar_param="tools"), prompt="p"),
            "grammar",
            "tools",
        ),
        (Submit("r", msgspec.structs.replace(OK, logprobs=2), prompt="p"), "logprobs", "logprobs"),
        (Submit("r", OK, prompt="p", cache_salt="s"), "cache_salt", "cache_salt"),
        (
            Submit("r", msgspec.structs.replace(OK, banned_strings=("x",)), prompt="p"),
            "banned_strings",
            "banned_strings",
        ),
    ],
)
def test_a_capability_the_backend_lacks_is_refused_by_name(
    submit: Submit, capability: str, param: str
) -> None:
    """One place refuses what a backend's ``ModelInfo`` says it cannot do; the same
    request passes where the flag is on."""
    with pytest.raises(RequestRejected) as e:
        validate_request(submit, ModelInfo("m", 100, None))
    assert e.value.code is ErrorCode.INVALID_REQUEST and e.value.param == param
    validate_request(submit, ModelInfo("m", 100, None, **{capability: True}))  # type: ignore[arg-type]


def test_n_must_fit_the_batch() -> None:
    info = ModelInfo("m", 100, None, max_batch_size=4)
    validate_request(Submit("r", OK, prompt="p", n=4), info)
    for n in (0, 5):
        with pytest.raises(RequestRejected) as e:
            validate_request(Submit("r", OK, prompt="p", n=n), info)
        assert e.value.param == "n"


def test_budget_clamps_max_tokens_to_the_context_once() -> None:
    info = ModelInfo("m", 100, None, context_settings="setting: y")
    prepared = Prepared(_submit(max_tokens=1000), None, 30, "prompt")
    assert budget(prepared, info).max_new_tokens == 70
    assert budget(dataclasses.replace(prepared, submit=_submit(max_tokens=8)), info).max_new_tokens == 8
    with pytest.raises(RequestRejected) as e:
        budget(dataclasses.replace(prepared, prompt_tokens=100), info)
    assert e.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED and "setting: y" in e.value.message


def test_stop_strings_are_bounded_for_any_client_of_the_socket() -> None:
    """The worker's own bound (``MAX_STOP_STRINGS``, ``MAX_STOP_CHARS``), for a
    client that is not the proxy: a stop automaton per sequence stays small."""
    from protocol.messages import MAX_STOP_CHARS, MAX_STOP_STRINGS

    validate_sampling(msgspec.structs.replace(OK, stop=("x",) * MAX_STOP_STRINGS), vocab_size=100)
    validate_sampling(msgspec.structs.replace(OK, stop=("x" * MAX_STOP_CHARS,)), vocab_size=100)
    for change in (
        {"stop": ("x",) * (MAX_STOP_STRINGS + 1)},
        {"stop": ("a", "x" * (MAX_STOP_CHARS + 1))},
        {"stop_token_ids": (1,) * (MAX_STOP_STRINGS + 1)},
    ):
        with pytest.raises(RequestRejected) as e:
            validate_sampling(msgspec.structs.replace(OK, **change), vocab_size=100)
        assert e.value.code is ErrorCode.INVALID_REQUEST
        assert e.value.param == next(iter(change))


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    from engine_worker.admission import check_prompt_size
    from protocol import ChatMessage

    info = ModelInfo("m", 100, None, longest_token_chars=2, template_tools=True)
    ok = Submit("r", OK, messages=tuple(ChatMessage("user", "x") for _ in range(100)))
    check_prompt_size(ok, info)
    cases = [
        (Submit("r", OK, messages=tuple(ChatMessage("user", "x") for _ in range(101))), "messages"),
        (Submit("r", OK, prompt="x" * 201), "prompt"),
        (Submit("r", OK, messages=(ChatMessage("user", "x"),), tools_json="t" * 200), "messages"),
    ]
    for submit, param in cases:
        with pytest.raises(RequestRejected) as e:
            validate_request(submit, info)
        assert (e.value.code, e.value.param) == (ErrorCode.CONTEXT_LENGTH_EXCEEDED, param)
    check_prompt_size(Submit("r", OK, prompt="x" * 10_000), ModelInfo("m", 100, None))  # length unknown


def test_an_image_for_a_model_without_vision_is_refused_naming_its_part() -> None:
    image = ImageInput(b"\x89PNG", 3, "input[1].content[2]")
    submit = Submit(
        "r", OK, messages=(ChatMessage("user", "hi"), ChatMessage("user", "see", images=(image,)))
    )
    info = ModelInfo("text-model", 100, None, vocab_size=100)
    with pytest.raises(RequestRejected) as e:
        validate_request(submit, info)
    assert (e.value.code, e.value.param) == (ErrorCode.INVALID_REQUEST, "input[1].content[2]")
    assert "'text-model'" in e.value.message and "reads text only" in e.value.message
    validate_request(submit, dataclasses.replace(info, vision=True))
