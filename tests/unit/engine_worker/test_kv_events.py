"""KV-cache events: vLLM's wire format, the block index behind it, the publisher's sockets."""

from __future__ import annotations

import errno
import hashlib
import socket
import time

import msgspec
import pytest
import torch
import zmq

from engine_worker.cpu.kv_cache import KVTensors
from engine_worker.cpu.prefix_cache import PrefixCache
from engine_worker.kv_events import (
    MEDIUM_CPU,
    KVEventBatch,
    KvEventPublisher,
    KvEvents,
    default_topic,
)
from tests.fakes import kv_subscriber as vllm


class Sink:
    """Keeps every batch as the bytes the publisher would send; refuses the next ``refuse``."""

    def __init__(self) -> None:
        self.batches: list[vllm.KVEventBatch] = []
        self.refuse = 0
        self.dropped = 0

    def publish(self, batch: KVEventBatch) -> bool:
        if self.refuse:
            self.refuse -= 1
            self.dropped += 1
            return False
        # Through msgpack and vLLM's structs, as a subscriber gets it.
        self.batches.append(vllm.DECODER.decode(msgspec.msgpack.encode(batch)))
        return True

    def events(self) -> list[vllm.BlockStored | vllm.BlockRemoved | vllm.AllBlocksCleared]:
        out = [e for b in self.batches for e in b.events]
        self.batches.clear()
        return out


def blake(parent: bytes | None, tokens: list[int]) -> bytes:
    """ExLlamaV3's page hash (``generator/pagetable.py:23-28``): blake2b-16 of the parent's
    hash and the tokens' int64 bytes (a ``torch.long`` tensor's ``numpy().tobytes()``)."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(torch.tensor(tokens, dtype=torch.long).numpy().tobytes())
    return h.digest()


def test_a_stored_sequence_is_its_whole_blocks_chained_by_parent() -> None:
    sink = Sink()
    ev = KvEvents(sink, block_size=4, medium=MEDIUM_CPU)
    ev.flush()
    assert sink.events() == [vllm.AllBlocksCleared()]  # a new process holds nothing
    tokens = list(range(100, 111))  # 2 whole blocks and 3 tokens
    ev.store_tokens(tokens, None)
    ev.flush()
    (stored,) = sink.events()
    h1 = blake(None, tokens[:4])
    h2 = blake(h1, tokens[4:8])
    assert stored == vllm.BlockStored([h1, h2], None, tokens[:8], 4, None, "CPU", None)
    ev.flush()
    assert sink.batches == []  # nothing changed: no batch


def test_shared_prefixes_are_counted_and_evictions_remove_only_what_left() -> None:
    sink = Sink()
    ev = KvEvents(sink, block_size=2, medium=MEDIUM_CPU)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9]
    ev.store_tokens(a, None)
    ev.store_tokens(b, None)
    ev.flush()
    _, first, branch = sink.events()
    h1, h2 = blake(None, [1, 2]), blake(blake(None, [1, 2]), [3, 4])
    assert isinstance(first, vllm.BlockStored) and first.block_hashes == [h1, h2, blake(h2, [5, 6])]
    # The second entry's own block hangs off the shared one, published once.
    assert branch == vllm.BlockStored([blake(h2, [9, 9])], h2, [9, 9], 2, None, "CPU", None)
    ev.evict_tokens(a, None)
    ev.flush()
    assert sink.events() == [vllm.BlockRemoved([blake(h2, [5, 6])], "CPU")]
    ev.evict_tokens(b, None)
    ev.flush()
    (removed,) = sink.events()
    assert isinstance(removed, vllm.BlockRemoved) and set(removed.block_hashes) == {h1, h2, blake(h2, [9, 9])}
    assert len(ev) == 0


def test_a_block_stored_and_evicted_in_one_step_is_not_published() -> None:
    sink = Sink()
    ev = KvEvents(sink, block_size=2, medium=MEDIUM_CPU)
    ev.flush()
    sink.events()
    ev.store_tokens([1, 2, 3, 4], None)
    ev.evict_tokens([1, 2, 3, 4], None)
    # An entry replaced by one that extends it: its blocks stay, only the new one is news.
    ev.store_tokens([5, 6], None)
    ev.evict_tokens([5, 6], None)
    ev.store_tokens([5, 6, 7, 8], None)
    ev.flush()
    (stored,) = sink.events()
    assert isinstance(stored, vllm.BlockStored) and stored.token_ids == [5, 6, 7, 8]


def test_salted_entries_are_not_published() -> None:
    sink = Sink()
    ev = KvEvents(sink, block_size=2, medium=MEDIUM_CPU)
    ev.flush()
    sink.events()
    ev.store_tokens([1, 2, 3, 4], "tenant-a")
    ev.flush()
    ev.evict_tokens([1, 2, 3, 4], "tenant-a")
    ev.flush()
    assert sink.batches == [] and ev.skipped_salted == 1


def test_a_reset_removes_every_published_block_then_clears() -> None:
    """llm-d's pool only logs AllBlocksCleared (pool.go), so the removals come first."""
    sink = Sink()
    ev = KvEvents(sink, block_size=2, medium=MEDIUM_CPU)
    ev.store_tokens([1, 2, 3, 4], None)
    ev.flush()
    sink.events()
    ev.cleared()
    ev.store_tokens([7, 8], None)
    ev.flush()
    removed, cleared, stored = sink.events()
    h1 = blake(None, [1, 2])
    assert isinstance(removed, vllm.BlockRemoved) and set(removed.block_hashes) == {h1, blake(h1, [3, 4])}
    assert cleared == vllm.AllBlocksCleared()
    assert isinstance(stored, vllm.BlockStored) and stored.block_hashes == [blake(None, [7, 8])]


def test_a_dropped_batch_is_followed_by_a_full_resend() -> None:
    sink = Sink()
    ev = KvEvents(sink, block_size=2, medium=MEDIUM_CPU)
    ev.store_tokens([1, 2, 3, 4], None)
    ev.flush()
    sink.events()
    sink.refuse = 1
    ev.evict_tokens([1, 2, 3, 4], None)
    ev.store_tokens([5, 6], None)
    ev.flush()  # dropped: subscribers still believe in [1, 2, 3, 4]
    assert sink.dropped == 1 and sink.batches == []
    ev.flush()
    removed, cleared, stored = sink.events()
    h1 = blake(None, [1, 2])
    assert isinstance(removed, vllm.BlockRemoved)
    assert set(removed.block_hashes) == {h1, blake(h1, [3, 4]), blake(None, [5, 6])}
    assert cleared == vllm.AllBlocksCleared()
    assert stored == vllm.BlockStored([blake(None, [5, 6])], None, [5, 6], 2, None, "CPU", None)


def test_engine_keyed_blocks_are_published_parents_first() -> None:
    sink = Sink()
    ev = KvEvents(sink, block_size=2, medium="GPU")
    ev.flush()
    sink.events()
    h1, h2, h3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    # Found in any order (a page table's), published parent first, as one chain.
    ev.stored(h3, h2, [5, 6])
    ev.stored(h1, None, [1, 2])
    ev.stored(h2, h1, [3, 4])
    ev.flush()
    assert sink.events() == [vllm.BlockStored([h1, h2, h3], None, [1, 2, 3, 4, 5, 6], 2, None, "GPU", None)]


def _kv(n: int) -> KVTensors:
    return torch.zeros(2, 2, 1, n, 8)  # layers, (k, v), batch, positions, head_dim: 128 bytes a position


def test_the_prefix_cache_tells_each_entry_in_and_out_once() -> None:
    log: list[tuple[str, list[int], str | None]] = []
    cache = PrefixCache(9 * 128)  # room for 9 positions
    cache.listen(
        lambda t, s: log.append(("store", t.tolist(), s)), lambda t, s: log.append(("evict", t.tolist(), s))
    )
    cache.insert([1, 2, 3], _kv(3))
    cache.insert([1, 2, 3, 4, 5], _kv(5))  # extends the first: it leaves as redundant
    cache.insert([9, 9, 9, 9, 9], _kv(5), salt="s")  # over the budget: the LRU one leaves
    cache.clear()
    assert log == [
        ("store", [1, 2, 3], None),
        ("evict", [1, 2, 3], None),
        ("store", [1, 2, 3, 4, 5], None),
        ("evict", [1, 2, 3, 4, 5], None),
        ("store", [9, 9, 9, 9, 9], "s"),
        ("evict", [9, 9, 9, 9, 9], "s"),
    ]


def test_default_topic_names_the_pod_by_its_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert default_topic("SmolLM2-135M-Instruct") == "kv@10.1.2.3@SmolLM2-135M-Instruct"
    monkeypatch.delenv("POD_IP")
    assert default_topic("m") == f"kv@{socket.gethostname()}@m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_publisher_sends_three_frames_numbered_from_0_and_replays() -> None:
    port, replay_port = _free_port(), _free_port()
    pub = KvEventPublisher(f"tcp://*:{port}", "kv@pod@model", f"tcp://*:{replay_port}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    # A DEALER with REQ's empty delimiter: the ROUTER streams several answers to one request.
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(f"tcp://127.0.0.1:{port}")
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        ev = KvEvents(pub, block_size=2, medium=MEDIUM_CPU)
        # A SUB joins asynchronously: publish until three messages arrived (bounded).
        got: list[vllm.Message] = []
        deadline = time.monotonic() + 10
        i = 0
        while len(got) < 3 and time.monotonic() < deadline:
            ev.store_tokens([i, i], None)
            ev.flush()
            i += 1
            while sub.poll(20):
                got.append(vllm.decode(sub.recv_multipart()))
        assert len(got) >= 3
        assert all(m.topic == "kv@pod@model" for m in got)
        assert [m.seq for m in got] == list(range(got[0].seq, got[0].seq + len(got)))
        # Replay from 1: every batch from 1 on, the ones this SUB missed too, then the end marker.
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed: list[vllm.Message] = []
        while True:
            assert dealer.poll(5000)
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append(vllm.decode([b"kv@pod@model", seq, payload]))
        assert [m.seq for m in replayed] == list(range(1, i))  # one batch per flush, from 0
        by_seq = {m.seq: m for m in replayed}
        assert all(by_seq[m.seq] == m for m in got if m.seq >= 1)
        # Batch 1 stored [0, 0]; batch 0 (not replayed here) was AllBlocksCleared plus it.
        first = by_seq[1].batch.events[0]
        assert isinstance(first, vllm.BlockStored) and first.token_ids == [1, 1]
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        pub.close()


def test_a_full_queue_drops_without_waiting() -> None:
    pub = KvEventPublisher(f"tcp://127.0.0.1:{_free_port()}", "t", max_queue=1)
    pub._stop.set()
    pub._thread.join(5)  # no sender: the queue fills
    try:
        batch = KVEventBatch(0.0, [], 0)
        assert pub.publish(batch)
        assert not pub.publish(batch)
        assert pub.dropped == 1
    finally:
        pub.close()


def _one_message(pub: KvEventPublisher, sub: zmq.Socket[bytes]) -> vllm.Message:
    """Publish until ``sub`` gets a message (a SUB joins asynchronously; bounded)."""
    ev = KvEvents(pub, block_size=2, medium=MEDIUM_CPU)
    deadline = time.monotonic() + 10
    i = 0
    while time.monotonic() < deadline:
        ev.store_tokens([i, i], None)
        ev.flush()
        i += 1
        if sub.poll(50):
            return vllm.decode(sub.recv_multipart())
    raise AssertionError("no message within 10 s")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_a_local_address_is_listened_on_for_a_subscriber_that_dials(host: str) -> None:
    """``--kv-events-endpoint tcp://127.0.0.1:5591`` listens there (issue 41: it used to
    dial it, vLLM's rule, and nothing answered a SUB connecting to it)."""
    port = _free_port()
    pub = KvEventPublisher(f"tcp://{host}:{port}", "kv@pod@model")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        assert pub.bound
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(f"tcp://{host}:{port}")
        assert _one_message(pub, sub).topic == "kv@pod@model"
    finally:
        sub.close(0)
        ctx.term()
        pub.close()


def test_connect_dials_a_subscriber_that_binds() -> None:
    """``--kv-events-connect`` (and any address that is not this host's): llm-d's central
    indexer binds its SUB and every engine dials it."""
    port = _free_port()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    pub = KvEventPublisher(f"tcp://127.0.0.1:{port}", "kv@pod@model", connect=True)
    try:
        assert not pub.bound
        assert _one_message(pub, sub).topic == "kv@pod@model"
    finally:
        pub.close()
        sub.close(0)
        ctx.term()


@pytest.mark.parametrize("host", ["192.0.2.1", "indexer.example.invalid"])
def test_another_hosts_address_is_dialled(host: str) -> None:
    """An IP this host does not have (TEST-NET-1) and a name that is not one of its
    interfaces: connected to, never an error at start."""
    pub = KvEventPublisher(f"tcp://{host}:{_free_port()}", "t")
    try:
        assert not pub.bound
    finally:
        pub.close()


def test_a_port_in_use_is_an_error_not_a_silent_dial() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(zmq.ZMQError) as e:
            KvEventPublisher(f"tcp://127.0.0.1:{port}", "t")
        assert e.value.errno == errno.EADDRINUSE
