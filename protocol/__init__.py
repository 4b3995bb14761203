"""The contract between proxy and engine worker: messages, codec, version."""

from protocol.codec import decode_proxy_message, decode_worker_message, encode
from protocol.errors import ProtocolError, VersionMismatch
from protocol.messages import (
    Abort,
    ChatMessage,
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    FinishReason,
    Heartbeat,
    Hello,
    PrefillProgress,
    ProxyMessage,
    Ready,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
    WorkerMessage,
)
from protocol.version import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "ChatMessage",
    "ErrorCode",
    "Event",
    "EventBatch",
    "FinishReason",
    "Finished",
    "Heartbeat",
    "Hello",
    "PrefillProgress",
    "ProtocolError",
    "ProxyMessage",
    "Ready",
    "RequestError",
    "SamplingParams",
    "Started",
    "Submit",
    "TokenDelta",
    "VersionMismatch",
    "WorkerMessage",
    "decode_proxy_message",
    "decode_worker_message",
    "encode",
]
