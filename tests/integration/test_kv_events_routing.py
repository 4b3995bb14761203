"""Two ``exl3-sidecar serve`` replicas on the CPU engine, their KV-cache events, and a
router that reads them (issue 29).

Each replica publishes its prefix cache (``--kv-events-endpoint``, an ``ipc://`` socket);
a subscriber in this test decodes every message with structs written from vLLM's
definitions (``tests/fakes/kv_subscriber.py``) and keeps one ``BlockIndex`` per replica,
as llm-d's precise prefix-cache scorer keeps its index. The same multi-turn conversations
(different texts, the same shape) go through round robin and then through a
prefix-aware router, in this one run, and the fraction of prompt tokens the replicas
report as cached (``usage.prompt_tokens_details.cached_tokens``) is compared.

Three conversations of three turns, interleaved: with an odd count round robin sends
each conversation's turns to alternating replicas (an even one would keep every
conversation on one replica by accident). The prefix cache is small enough that the
second phase evicts what the first left, so eviction shows in the events.

``EXL3_SIDECAR_TEST_PORT_BASE``: take the two HTTP ports from there (default: free ports).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import zmq

from tests.fakes.kv_subscriber import BlockIndex, BlockRemoved, BlockStored, Message, decode

pytestmark = pytest.mark.slow

CHUNK = 32  # --chunk-size
BLOCK = 16  # the CPU engine's prefix-cache block, min(16, --chunk-size): entries end at its multiples
PREFIX_CACHE_MB = 8  # 182 positions of float32 KV (46,080 bytes each): the second phase evicts
STARTUP_S = 300.0


def _port(i: int) -> int:
    base = os.environ.get("EXL3_SIDECAR_TEST_PORT_BASE")
    if base:
        return int(base) + i
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    events_addr: str
    replay_addr: str
    log: Path


def _start(tmp: Path, i: int) -> Replica:
    port = _port(i)
    name = f"replica-{i}"
    events_addr = f"ipc://{tmp}/kv-{i}.sock"
    replay_addr = f"ipc://{tmp}/kv-replay-{i}.sock"
    log = tmp / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3_SIDECAR_")}
    cmd = [
        sys.executable, "-m", "launcher", "serve", "--host", "127.0.0.1", "--port", str(port), "--",
        "--threads", "1", "--chunk-size", str(CHUNK), "--prefix-cache-mb", str(PREFIX_CACHE_MB),
        "--kv-cache-mb", "256", "--max-batch-size", "2",
        "--kv-events-endpoint", events_addr, "--kv-events-replay-endpoint", replay_addr,
        "--kv-events-topic", f"kv@{name}@SmolLM2-135M-Instruct",
    ]  # fmt: skip
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Replica(name, proc, f"http://127.0.0.1:{port}", events_addr, replay_addr, log)


def _wait_ready(r: Replica, deadline: float) -> None:
    while time.monotonic() < deadline:
        if r.proc.poll() is not None:
            raise RuntimeError(f"{r.name} exited:\n{r.log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{r.url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{r.name} not ready:\n{r.log.read_text()[-3000:]}")


@dataclass
class Subscriber:
    """One SUB socket on every replica's events, decoding in a thread of its own.

    A SUB misses what its PUB sends before the subscription has reached it (ZeroMQ's
    slow joiner: here the first batches, ``AllBlocksCleared`` at seq 0 among them), so
    a gap in a replica's sequence numbers is filled from its replay socket first, as
    vLLM's replay protocol is meant to be used; batches seen twice are applied once."""

    addrs: dict[str, tuple[str, str]]  # pod -> (events, replay)
    indexes: dict[str, BlockIndex] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    replayed: int = 0
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        dealers = {pod: ctx.socket(zmq.DEALER) for pod in self.addrs}
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            for pod, (events, replay) in self.addrs.items():
                sub.connect(events)
                dealers[pod].connect(replay)
            while not self.stop.is_set():
                if not sub.poll(50):
                    continue
                frames = sub.recv_multipart()
                try:
                    msg = decode(frames)
                    pod = msg.topic.split("@")[1]
                    with self.lock:
                        index = self.indexes.setdefault(pod, BlockIndex())
                        if msg.seq > index.next_seq:
                            self._replay(dealers[pod], msg.topic, index)
                        if msg.seq == index.next_seq:
                            self.messages.append(msg)
                            index.apply(msg)
                except BaseException as e:  # reported by the test, not lost in a thread
                    self.errors.append(e)
        finally:
            sub.close(0)
            for d in dealers.values():
                d.close(0)
            ctx.term()

    def _replay(self, dealer: zmq.Socket[bytes], topic: str, index: BlockIndex) -> None:
        # REQ's envelope (an empty delimiter) from a DEALER: the answer is many messages.
        dealer.send_multipart([b"", index.next_seq.to_bytes(8, "big")])
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return
            msg = decode([topic.encode(), seq, payload])
            if msg.seq == index.next_seq:
                self.messages.append(msg)
                index.apply(msg)
                self.replayed += 1

    def prefix_tokens(self, pod: str, tokens: list[int]) -> int:
        with self.lock:
            index = self.indexes.get(pod)
            return index.prefix_tokens(tokens) if index is not None else 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Replica], Subscriber]]:
    tmp = tmp_path_factory.mktemp("kv")
    replicas = [_start(tmp, i) for i in range(2)]
    sub = Subscriber({r.name: (r.events_addr, r.replay_addr) for r in replicas})
    thread = threading.Thread(target=sub.run, daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + STARTUP_S
        for r in replicas:
            _wait_ready(r, deadline)
        yield replicas, sub
    finally:
        sub.stop.set()
        thread.join(5)
        for r in replicas:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in replicas:
            try:
                r.proc.wait(30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()


SYSTEMS = [
    "You are a ship's navigator on a long voyage. Answer in one short sentence about stars, tides, "
    "charts and the weather at sea.",
    "You are a patient baker who explains bread. Answer in one short sentence about flour, water, "
    "salt, yeast, ovens and proofing times.",
    "You are a mountain guide in the Alps. Answer in one short sentence about ropes, weather, "
    "glaciers, huts and safe routes up and down.",
    "You are a librarian in an old city library. Answer in one short sentence about books, "
    "catalogues, reading rooms and quiet study.",
    "You are a gardener who keeps bees. Answer in one short sentence about hives, flowers, honey, "
    "seasons and the care of fruit trees.",
    "You are a railway signalman on a branch line. Answer in one short sentence about levers, "
    "timetables, points, lamps and the trains that pass.",
]
QUESTIONS = ["What matters most?", "Why is that so?", "What would you do next?"]


@dataclass
class Phase:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_request: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens


def _tokens(client: httpx.Client, url: str, messages: list[dict[str, str]]) -> list[int]:
    r = client.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def _converse(
    client: httpx.Client,
    replicas: list[Replica],
    sub: Subscriber,
    systems: list[str],
    prefix_aware: bool,
) -> Phase:
    phase = Phase()
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": s}] for s in systems]
    sent = 0
    for question in QUESTIONS:
        for chat in chats:
            chat.append({"role": "user", "content": question})
            tokens = _tokens(client, replicas[0].url, chat)
            if prefix_aware:
                # The replica holding the longest prefix; ties (nothing held) in turn.
                held = [sub.prefix_tokens(r.name, tokens) for r in replicas]
                best = max(held)
                ties = [i for i, h in enumerate(held) if h == best]
                target = replicas[ties[sent % len(ties)]]
            else:
                target = replicas[sent % len(replicas)]
            sent += 1
            body = {"model": "m", "messages": chat, "max_tokens": 6, "temperature": 0}
            r = client.post(f"{target.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == len(tokens)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            phase.prompt_tokens += usage["prompt_tokens"]
            phase.cached_tokens += cached
            phase.per_request.append((target.name, usage["prompt_tokens"], cached))
            chat.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            # The prompt's whole blocks enter the cache when the request ends; wait for
            # their events (bounded), so the router's next look sees them.
            whole = len(tokens) // BLOCK * BLOCK
            deadline = time.monotonic() + 10
            while sub.prefix_tokens(target.name, tokens) < whole:
                assert time.monotonic() < deadline, f"{target.name}: the blocks of {whole} tokens never came"
                time.sleep(0.02)
    return phase


def test_prefix_aware_routing_on_kv_events_beats_round_robin(
    cluster: tuple[list[Replica], Subscriber],
) -> None:
    replicas, sub = cluster
    with httpx.Client(timeout=120) as client:
        rr = _converse(client, replicas, sub, SYSTEMS[:3], prefix_aware=False)
        aware = _converse(client, replicas, sub, SYSTEMS[3:], prefix_aware=True)
    print(
        f"\ncached fraction: prefix-aware {aware.fraction:.3f} "
        f"({aware.cached_tokens}/{aware.prompt_tokens} tokens), round robin {rr.fraction:.3f} "
        f"({rr.cached_tokens}/{rr.prompt_tokens})"
    )
    print("round robin   (replica, prompt, cached):", rr.per_request)
    print("prefix-aware  (replica, prompt, cached):", aware.per_request)
    assert aware.fraction > rr.fraction
    time.sleep(0.3)  # the last batches
    assert sub.errors == []
    with sub.lock:
        messages = list(sub.messages)
        indexes = dict(sub.indexes)
    # Every message decoded with vLLM's structs; each replica's numbered 0, 1, 2, ...
    # (BlockIndex.apply asserts the order) and starting with AllBlocksCleared.
    assert set(indexes) == {r.name for r in replicas}
    for name, index in indexes.items():
        first = next(m for m in messages if m.topic.split("@")[1] == name)
        assert first.seq == 0 and index.cleared >= 1
        assert index.orphans == 0 and index.removed_unknown == 0
        assert index.block_size == BLOCK
    # Eviction: BlockRemoved events name blocks that were stored.
    removed = [
        (m.topic, h)
        for m in messages
        for e in m.batch.events
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    ]
    assert removed, "the second phase evicted nothing: no BlockRemoved seen"
    for topic, h in removed:
        assert h in indexes[topic.split("@")[1]].ever_stored
    stored = [e for m in messages for e in m.batch.events if isinstance(e, BlockStored)]
    assert all(e.medium == "CPU" and e.lora_id is None and e.lora_name is None for e in stored)


def test_stored_blocks_are_the_prompts_tokens_in_order(cluster: tuple[list[Replica], Subscriber]) -> None:
    """A prompt sent to one replica comes back, block by block, as its own tokens chained by parent."""
    replicas, sub = cluster
    chat = [
        {"role": "system", "content": SYSTEMS[0] + " Keep it brief."},
        {"role": "user", "content": "Name one star used for navigation and say why it is useful."},
    ]
    with httpx.Client(timeout=120) as client:
        tokens = _tokens(client, replicas[1].url, chat)
        body = {"model": "m", "messages": chat, "max_tokens": 2, "temperature": 0}
        assert client.post(f"{replicas[1].url}/v1/chat/completions", json=body).status_code == 200
    whole = len(tokens) // BLOCK * BLOCK
    deadline = time.monotonic() + 10
    while sub.prefix_tokens(replicas[1].name, tokens) < whole:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with sub.lock:
        index = sub.indexes[replicas[1].name]
        last = next(
            h for h, (_, block) in index.blocks.items()
            if block == tuple(tokens[whole - BLOCK : whole]) and index.chain_tokens(h) == tokens[:whole]
        )  # fmt: skip
        assert index.chain_tokens(last) == tokens[:whole]
