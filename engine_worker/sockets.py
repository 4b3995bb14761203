"""The worker's two ZeroMQ sockets.

The worker binds both ends so that proxies come and go (restart, upgrade)
without the worker noticing: PULL at ``input_addr`` receives proxy messages,
PUSH at ``output_addr`` sends worker messages.
"""

from __future__ import annotations

import logging

import zmq

from protocol import ProtocolError, ProxyMessage, WorkerMessage, decode_proxy_message, encode

log = logging.getLogger(__name__)

# Events must not be dropped while a proxy is attached but slow; the bound is
# there only to turn a proxy that stopped reading into a visible error.
_SEND_HWM = 100_000


class WorkerSockets:
    """Bound PULL/PUSH pair. Not thread-safe: use from the loop thread only."""

    def __init__(self, input_addr: str, output_addr: str, ctx: zmq.Context[zmq.Socket[bytes]] | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(input_addr)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._push.bind(output_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)

    def receive(self, timeout_ms: int) -> list[ProxyMessage]:
        """Every message that arrives within ``timeout_ms`` (0: only those already
        queued). Undecodable frames are logged and skipped, never fatal."""
        out: list[ProxyMessage] = []
        if not self._poller.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode_proxy_message(frames))
            except ProtocolError as e:
                log.error("dropping message from proxy: %s", e)

    def send(self, msg: WorkerMessage) -> bool:
        """Queue ``msg`` for the proxy. Returns False when no proxy is attached
        (or it stopped reading): the message is dropped and the proxy will fail
        its requests on its own."""
        try:
            self._push.send_multipart(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._pull.close(0)
        self._push.close(0)
