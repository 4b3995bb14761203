import msgspec
import pytest

from engine_worker.admission import check_prompt_fits, validate_sampling
from engine_worker.backend import RequestRejected
from protocol import ErrorCode, SamplingParams

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
