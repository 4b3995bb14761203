"""The worker's ZeroMQ sockets.

The worker binds both ends so that proxies come and go (restart, upgrade)
without the worker noticing: PULL at ``input_addr`` receives proxy messages,
PUSH at ``output_addr`` sends worker messages.

Two threads send: the engine loop (event batches) and the heartbeat thread
(liveness, which must keep flowing while an engine step is long). ZeroMQ sockets
are not thread-safe and one address binds one socket, so the bound PUSH belongs
to a forwarder thread that relays what each sender pushes over an ``inproc://``
socket of its own (``Sender``). The forwarder never waits for a proxy: with none
attached (or one that stopped reading) a message is dropped, as a direct
non-blocking send would drop it, and the proxy fails its requests on its own.
"""

from __future__ import annotations

import logging
import threading
import uuid

import zmq

from protocol import ProtocolError, ProxyMessage, WorkerMessage, decode_proxy_message, encode

log = logging.getLogger(__name__)

# Events must not be dropped while a proxy is attached but slow; the bound is
# there only to turn a proxy that stopped reading into a visible error.
_SEND_HWM = 100_000


class Sender:
    """One thread's way out: an ``inproc://`` PUSH to the forwarder. Create it on,
    and use it from, one thread only."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], relay_addr: str) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        self._sock.connect(relay_addr)

    def send(self, msg: WorkerMessage) -> bool:
        """Queue ``msg`` for the proxy. Returns False when it cannot be queued (no
        proxy attached, or it stopped reading): the message is dropped and the
        proxy fails its requests on its own."""
        try:
            self._sock.send_multipart(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self._sock.close(0)


class WorkerSockets:
    """The bound PULL (read by the loop thread with ``receive``), the bound PUSH
    behind its forwarder thread, and the loop thread's ``Sender`` (``send``).
    Other threads make their own with ``sender()``. Raises ``zmq.ZMQError`` when
    an address cannot be bound."""

    def __init__(self, input_addr: str, output_addr: str, ctx: zmq.Context[zmq.Socket[bytes]] | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(input_addr)
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, _SEND_HWM)
        push.bind(output_addr)
        self._relay_addr = f"inproc://worker-out-{uuid.uuid4().hex}"
        relay = self._ctx.socket(zmq.PULL)
        relay.setsockopt(zmq.LINGER, 0)
        relay.setsockopt(zmq.RCVHWM, _SEND_HWM)
        relay.bind(self._relay_addr)
        control_addr = f"inproc://worker-ctl-{uuid.uuid4().hex}"
        control_in = self._ctx.socket(zmq.PAIR)
        control_in.bind(control_addr)
        self._control = self._ctx.socket(zmq.PAIR)
        self._control.connect(control_addr)
        # The forwarder owns push, relay and control_in from here on (ZeroMQ
        # allows moving a socket to another thread before it is used there).
        self._owned = (push, relay, control_in)
        self.dropped = 0
        """Messages dropped because no proxy was attached or it stopped reading."""
        self._forwarder = threading.Thread(target=self._forward, name="worker-forwarder", daemon=True)
        self._forwarder.start()
        self._sender = Sender(self._ctx, self._relay_addr)
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)

    def _forward(self) -> None:
        push, relay, control_in = self._owned
        poller = zmq.Poller()
        poller.register(relay, zmq.POLLIN)
        poller.register(control_in, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                # Relay first: what was sent before close() (the last events of a
                # stopping worker) still goes out.
                while True:
                    try:
                        frames = relay.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        push.send_multipart(frames, zmq.NOBLOCK)
                    except zmq.Again:
                        self.dropped += 1
                if control_in in ready:
                    return
        except zmq.ZMQError as e:
            if e.errno != zmq.ETERM:
                log.exception("worker forwarder stopped")
        finally:
            for sock in self._owned:
                sock.close(0)

    def sender(self) -> Sender:
        """A ``Sender`` for the calling thread."""
        return Sender(self._ctx, self._relay_addr)

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
        """Queue ``msg`` for the proxy from the loop thread (see ``Sender.send``)."""
        return self._sender.send(msg)

    def close(self) -> None:
        """Relay what the loop thread sent, stop the forwarder, close every socket.
        Call it from the loop thread once other senders are closed."""
        self._control.send(b"TERMINATE")
        self._forwarder.join(5)
        self._sender.close()
        self._control.close(0)
        self._pull.close(0)
