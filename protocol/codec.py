"""Framing and (de)serialization of ``protocol.messages``.

A message travels as two ZeroMQ frames: ``[version, payload]``. ``version`` is
``PROTOCOL_VERSION`` as ASCII digits, checked before the payload is decoded, so
a peer of another version is recognised even when its payload layout changed.
``payload`` is MessagePack via msgspec; there is no pickle anywhere.
"""

from __future__ import annotations

import msgspec

from protocol.errors import ProtocolError, VersionMismatch
from protocol.messages import ProxyMessage, WorkerMessage
from protocol.version import PROTOCOL_VERSION

_VERSION_FRAME = str(PROTOCOL_VERSION).encode()
_encoder = msgspec.msgpack.Encoder()
_proxy_decoder: msgspec.msgpack.Decoder[ProxyMessage] = msgspec.msgpack.Decoder(ProxyMessage)
_worker_decoder: msgspec.msgpack.Decoder[WorkerMessage] = msgspec.msgpack.Decoder(WorkerMessage)


def encode(msg: ProxyMessage | WorkerMessage) -> list[bytes]:
    """Frames for ``socket.send_multipart``."""
    return [_VERSION_FRAME, _encoder.encode(msg)]


def _payload(frames: list[bytes]) -> bytes:
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    if frames[0] != _VERSION_FRAME:
        raise VersionMismatch(frames[0].decode(errors="replace"), PROTOCOL_VERSION)
    return frames[1]


def decode_proxy_message(frames: list[bytes]) -> ProxyMessage:
    """Decode what the proxy sent. Raises ``VersionMismatch`` or ``ProtocolError``."""
    try:
        return _proxy_decoder.decode(_payload(frames))
    except msgspec.DecodeError as e:
        raise ProtocolError(str(e)) from e


def decode_worker_message(frames: list[bytes]) -> WorkerMessage:
    """Decode what the worker sent. Raises ``VersionMismatch`` or ``ProtocolError``."""
    try:
        return _worker_decoder.decode(_payload(frames))
    except msgspec.DecodeError as e:
        raise ProtocolError(str(e)) from e
