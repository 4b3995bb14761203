"""What a large ``Submit`` (a chat turn with images) costs the proxy's event loop on its
way to the worker: the msgpack encode (``protocol.codec.encode``) and the PUSH socket's
``send_multipart``, with the frame copied into a zmq message (``copy=True``) and handed
over as it is (``copy=False``, what ``ZmqEngineClient`` does; pyzmq still copies frames
under the socket's ``copy_threshold``, 64 KiB).
A PULL on ``ipc://`` in another thread receives every message, as the worker does.

Usage: python benchmarks/submit_wire.py [--images 8] [--mib 4] [--repeats 10]
Prints, per mode: the encoded size, and the least and median milliseconds of each part.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import threading
import time

import zmq

from protocol.codec import encode
from protocol.messages import ChatMessage, ImageInput, SamplingParams, Submit


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--mib", type=float, default=4.0, help="MiB per image")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    images = tuple(
        ImageInput(os.urandom(int(args.mib * 2**20)), 0, f"messages[0].content[{k}]")
        for k in range(args.images)
    )
    submit = Submit("r", SamplingParams(max_tokens=8), messages=(ChatMessage("user", "hi", images=images),))
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        addr = f"ipc://{tmp}/wire"
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(addr)
        push.connect(addr)
        total = 2 * args.repeats
        receiver = threading.Thread(target=lambda: [pull.recv_multipart(copy=False) for _ in range(total)])
        receiver.start()
        print(f"{_cpu()}, {os.cpu_count()} CPUs: {args.images} images of {args.mib:g} MiB")
        for copy in (True, False):
            enc: list[float] = []
            send: list[float] = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                frames = encode(submit)
                t1 = time.perf_counter()
                push.send_multipart(frames, zmq.NOBLOCK, copy=copy)
                t2 = time.perf_counter()
                enc.append(t1 - t0)
                send.append(t2 - t1)
                time.sleep(0.05)  # the receiver drains: each send starts from an empty queue
            size = len(frames[-1]) / 2**20
            print(
                f"copy={copy!s:5}  {size:6.1f} MiB  encode min {min(enc) * 1e3:6.2f} ms, median "
                f"{statistics.median(enc) * 1e3:6.2f}  send min {min(send) * 1e3:6.2f} ms, median "
                f"{statistics.median(send) * 1e3:6.2f}"
            )
        receiver.join(30)
        pull.close(0)
        push.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
