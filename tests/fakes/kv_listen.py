"""A KV-event subscriber in a process of its own, as llm-d's scorer runs beside the
engines: ``python -m tests.fakes.kv_listen ENDPOINT``.

It dials ``ENDPOINT`` with a SUB socket, prints ``connected`` once the TCP connection
is up (a socket monitor's ``EVENT_CONNECTED``; a PUB drops what it sends before a
subscription reaches it), then one JSON line per message until stdin closes:
``{"topic", "seq", "stored": [[token ids of one block], ...], "removed": n, "cleared": n}``
(a ``BlockStored`` event carries several blocks: its ``token_ids`` split by ``block_size``),
decoded with the structs written from vLLM's definitions (``kv_subscriber``).
"""

from __future__ import annotations

import json
import os
import sys

import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.fakes.kv_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, decode


def main(endpoint: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
    sub.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    try:
        while True:
            ready = dict(poller.poll(1000))
            if monitor in ready:
                recv_monitor_message(monitor)
                print("connected", flush=True)
            if sub in ready:
                msg = decode(sub.recv_multipart())
                events = msg.batch.events
                line = {
                    "topic": msg.topic,
                    "seq": msg.seq,
                    "stored": [
                        e.token_ids[k : k + e.block_size]
                        for e in events
                        if isinstance(e, BlockStored)
                        for k in range(0, len(e.token_ids), e.block_size)
                    ],
                    "removed": sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved)),
                    "cleared": sum(isinstance(e, AllBlocksCleared) for e in events),
                }
                print(json.dumps(line), flush=True)
            if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 1):
                return
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)
        ctx.term()


if __name__ == "__main__":
    main(sys.argv[1])
