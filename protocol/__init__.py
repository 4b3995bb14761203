"""The contract between proxy and engine worker: messages, codec, version.

The bottom layer: it imports neither ``proxy`` nor ``engine_worker``.

| module | what |
|---|---|
| ``messages`` | the typed messages (msgspec structs) both processes exchange over ZeroMQ |
| ``codec`` | framing and (de)serialization of ``messages`` |
| ``version`` | the wire protocol version both sides check at the handshake |
| ``errors`` | the wire protocol's exceptions |
| ``endpoints`` | ZeroMQ addresses and the private runtime directory where the processes meet |
| ``liveness`` | the worker's heartbeat file, read by probes without a ZeroMQ peer |
| ``grammar`` | the limits every llguidance grammar is checked and compiled under, in both processes |
| ``logs`` | logging set-up both processes share: text or JSON lines on stderr |
| ``settings`` | how both processes declare options: one typed settings class each, the CLI derived |"""

from protocol.codec import decode_proxy_message, decode_worker_message, encode
from protocol.errors import ProtocolError, VersionMismatch
from protocol.messages import (
    Abort,
    Channel,
    ChatMessage,
    Detokenize,
    Detokenized,
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    FinishReason,
    Heartbeat,
    Hello,
    ImageInput,
    Loading,
    PrefillProgress,
    ProxyMessage,
    QueueProgress,
    Ready,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
    Tokenize,
    TokenLogprob,
    Tokens,
    TopLogprob,
    WorkerMessage,
    choice_ids,
    choice_seed,
)
from protocol.version import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "Channel",
    "ChatMessage",
    "Detokenize",
    "Detokenized",
    "ErrorCode",
    "Event",
    "EventBatch",
    "FinishReason",
    "Finished",
    "Heartbeat",
    "Hello",
    "ImageInput",
    "Loading",
    "PrefillProgress",
    "ProtocolError",
    "ProxyMessage",
    "QueueProgress",
    "Ready",
    "RequestError",
    "SamplingParams",
    "Started",
    "Submit",
    "TokenDelta",
    "TokenLogprob",
    "Tokenize",
    "Tokens",
    "TopLogprob",
    "VersionMismatch",
    "WorkerMessage",
    "choice_ids",
    "choice_seed",
    "decode_proxy_message",
    "decode_worker_message",
    "encode",
]
