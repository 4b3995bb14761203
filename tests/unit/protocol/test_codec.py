import msgspec
import pytest

from protocol import (
    PROTOCOL_VERSION,
    Abort,
    ChatMessage,
    ErrorCode,
    EventBatch,
    Finished,
    FinishReason,
    Heartbeat,
    Hello,
    PrefillProgress,
    ProtocolError,
    Ready,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
    VersionMismatch,
    decode_proxy_message,
    decode_worker_message,
    encode,
)

PROXY_MESSAGES = [
    Hello(PROTOCOL_VERSION, "p1"),
    Submit(
        "r1",
        SamplingParams(7, temperature=0.5, stop=("\n\n",), seed=3, logit_bias={42: -100.0}),
        messages=(ChatMessage("user", "hi \u2028 é"),),
    ),
    Submit("r2", SamplingParams(1), prompt="Once upon"),
    Abort(("r1", "r2")),
]

WORKER_MESSAGES = [
    Ready(PROTOCOL_VERSION, "w1", "m", "CpuBackend", 8192, "ngram"),
    Heartbeat("w1", 3),
    EventBatch(
        [
            Started("r1", 100, 64),
            PrefillProgress("r1", 100, 64, 64, 0),
            TokenDelta("r1", "Paris", 2),
            Finished("r1", FinishReason.LENGTH, 100, 64, 7, 3, 1, 0.1, 0.2, 0.3),
            RequestError("r2", ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages"),
            RequestError(None, ErrorCode.INTERNAL, "boom"),
        ]
    ),
]


@pytest.mark.parametrize("msg", PROXY_MESSAGES)
def test_proxy_messages_round_trip(msg: object) -> None:
    assert decode_proxy_message(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", WORKER_MESSAGES)
def test_worker_messages_round_trip(msg: object) -> None:
    assert decode_worker_message(encode(msg)) == msg  # type: ignore[arg-type]


def test_direction_is_typed() -> None:
    # A worker message is not a valid proxy message and vice versa.
    with pytest.raises(ProtocolError):
        decode_proxy_message(encode(Heartbeat("w", 0)))
    with pytest.raises(ProtocolError):
        decode_worker_message(encode(Abort(("x",))))


def test_other_version_is_refused_before_decoding() -> None:
    frames = encode(Heartbeat("w", 0))
    frames[0] = str(PROTOCOL_VERSION + 1).encode()
    with pytest.raises(VersionMismatch) as e:
        decode_worker_message(frames)
    assert e.value.theirs == str(PROTOCOL_VERSION + 1)
    assert str(PROTOCOL_VERSION) in str(e.value)


def test_garbage_and_pickle_are_protocol_errors() -> None:
    import pickle

    v = str(PROTOCOL_VERSION).encode()
    for payload in (b"\xc1", pickle.dumps({"a": 1}), msgspec.msgpack.encode(["submit", "r"])):
        with pytest.raises(ProtocolError):
            decode_proxy_message([v, payload])
    with pytest.raises(ProtocolError):
        decode_proxy_message([v])


def test_wrong_field_types_are_rejected() -> None:
    v = str(PROTOCOL_VERSION).encode()
    bad = msgspec.msgpack.encode(["abort", "not-a-list"])
    with pytest.raises(ProtocolError):
        decode_proxy_message([v, bad])
