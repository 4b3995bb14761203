"""``FakeWorker``: the engine worker's side of the ZeroMQ sockets, for the proxy's
client tests (``tests/integration/test_zmq_client.py``)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from protocol import ProxyMessage, WorkerMessage, decode_proxy_message, encode

GUARD_S = 10.0  # safety limit for waits that must end; never a speed check


class FakeWorker:
    """Binds the worker's two sockets and speaks the protocol by hand."""

    def __init__(self, ctx: zmq.asyncio.Context, input_addr: str, output_addr: str) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(input_addr)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(output_addr)

    async def recv(self) -> ProxyMessage:
        async with asyncio.timeout(GUARD_S):
            return decode_proxy_message(await self.pull.recv_multipart())

    async def recv_until(self, cls: type[ProxyMessage]) -> ProxyMessage:
        while True:
            msg = await self.recv()
            if isinstance(msg, cls):
                return msg

    async def send(self, msg: WorkerMessage) -> None:
        await self.push.send_multipart(encode(msg))

    def close(self) -> None:
        self.pull.close(linger=0)
        self.push.close(linger=0)
