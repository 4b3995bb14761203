"""Exceptions of the wire protocol.

ProtocolError            a frame that cannot be decoded into a message
 +-- VersionMismatch     the peer speaks another PROTOCOL_VERSION
"""

from __future__ import annotations


class ProtocolError(Exception):
    """A received frame is not a valid message of this protocol version."""


class VersionMismatch(ProtocolError):
    """The peer speaks protocol version ``theirs``; we speak ``ours``."""

    def __init__(self, theirs: str, ours: int) -> None:
        super().__init__(f"peer speaks protocol version {theirs!r}, this side speaks {ours}")
        self.theirs = theirs
        self.ours = ours
