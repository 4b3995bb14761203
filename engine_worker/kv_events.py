"""KV-cache events in vLLM's format, for routers that index what each engine holds.

llm-d's precise prefix-cache scorer (``llm-d-kv-cache``, ``pkg/kvevents/``) subscribes
to every engine's events and keeps an index of which pod holds which blocks; vLLM
publishes them with ``--kv-events-config``. This module publishes the same stream
from this worker's prefix cache (``--kv-events-endpoint``, off by default).

Wire format, as vLLM's ``ZmqEventPublisher`` sends it (``vllm/distributed/kv_events.py``)
and llm-d's ``VLLMAdapter`` reads it (``pkg/kvevents/engineadapter/vllm_adapter.go``):

- A ZeroMQ PUB socket; each message is three frames: the topic (UTF-8; llm-d splits
  ``kv@<pod>@<model>`` on ``@`` and takes the pod and the model from it), the batch's
  sequence number (8 bytes, big-endian, 0 for the first batch of this process, +1 per
  batch), and the msgpack payload.
- The payload is a ``KVEventBatch`` as a msgpack array ``[ts, events, data_parallel_rank]``
  (``ts`` Unix seconds as a float); each event an array whose first element is its tag:
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``
  (the field order of vLLM's structs; llm-d decodes them as arrays, ``msgpack:",array"``).
- The optional replay socket is a ROUTER: a request ``[identity, b"", start_seq]``
  (8 bytes, big-endian) is answered with ``[identity, b"", seq, payload]`` for every
  buffered batch from ``start_seq`` on, then ``[identity, b"", -1 (8 bytes, signed), b""]``.
- The PUB endpoint is bound where this host can bind it (a wildcard such as
  ``tcp://*:5557``, ``localhost``, a loopback address or one of this host's own
  addresses, ``ipc://``, ``inproc://``), as llm-d's pod discovery needs (the scorer
  dials each pod), and connected to otherwise (a name or address of another host: a
  subscriber there binds, as llm-d's central indexer does). ``connect=True``
  (``--kv-events-connect``) connects whatever the address, for a subscriber on this
  host that binds. vLLM binds only endpoints with ``*``, ``::`` or ``ipc://``, so its
  ``tcp://127.0.0.1:5557`` dials a subscriber; this one listens there, which is what
  the address reads as (and what a SUB socket dialling it needs).

What llm-d does with it (``pkg/kvevents/pool.go``): engine hashes are opaque keys
(an int, or bytes of which the last 8 count); it recomputes its own keys from
``token_ids`` (so they are always sent) in blocks of its ``blockSize``, which must
divide ours; a ``BlockStored`` whose parent it has not indexed is dropped, so parents
are always published before their children; a parent hash of 0 means none, and
``AllBlocksCleared`` is only logged. Hence a reset here sends ``BlockRemoved`` for
every block it had published and then ``AllBlocksCleared``.

Threads: ``KvEvents`` is called from the engine thread only (the backends' store and
evict hooks, ``flush`` once per turn of the loop); it hands one batch per step to
``KvEventPublisher``, whose bounded queue a sender thread drains. The engine thread
never waits: a full queue drops the batch (counted, ``dropped``) and marks the index
for a resync (the next batch re-sends every block); a slow or absent subscriber costs
nothing, since PUB drops at its high-water mark instead of blocking.

``cache_salt``: blocks stored under a salt are not published. llm-d skips every
extra key but multimodal hashes (``kvblock.ParseRawExtraKeys``: "Skip unknown entry
types (e.g. LoRA, cache salt)"), so a salted block sent with its salt in vLLM's
``extra_keys`` would be indexed under the unsalted prefix: requests of other tenants
would be routed to where they cannot hit, and where they go would tell them that
someone sent that prefix, the cross-tenant signal ``cache_salt`` exists to remove
(issue 20). Salted requests are routed by load only.
"""

from __future__ import annotations

import array
import errno
import hashlib
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Protocol, runtime_checkable

import msgspec
import zmq

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
"""``medium`` of the ExLlamaV3 page table's blocks (vLLM's ``MEDIUM_GPU``)."""
MEDIUM_CPU = "CPU"
"""``medium`` of the CPU engine's prefix cache (llm-d lower-cases it into a device tier)."""

QUEUE_BATCHES = 1024
"""Batches the engine thread may hand over before the sender has sent them; beyond, dropped."""
REPLAY_BATCHES = 10_000
"""Batches kept for replay (vLLM's ``buffer_steps`` default) ..."""
REPLAY_BYTES = 64 << 20
"""... and at most this many payload bytes of them."""
PUB_HWM = 100_000
"""The PUB socket's high-water mark in messages (vLLM's ``hwm`` default)."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay answer's last sequence frame."""


# ---------------------------------------------------------------- the wire format


class _Event(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """Base of the events: tagged arrays, the tag the class name (vLLM's ``KVCacheEvent``)."""


class BlockStored(_Event, frozen=True):
    """Blocks entered the cache: ``block_hashes`` a chain, the first one's parent
    ``parent_block_hash`` (``None``: the chain starts the sequence), ``token_ids`` all
    their tokens in order (``len(block_hashes) * block_size``)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event, frozen=True):
    """Blocks left the cache."""

    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(_Event, frozen=True):
    """Everything this engine held is gone (a reset, a start)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    """One message's payload: the events of one engine step."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = 0


def default_topic(model_id: str) -> str:
    """``kv@<pod>@<model>``: the pod is ``$POD_IP`` (the manifests set it from the
    downward API, ``status.podIP``: llm-d's scorer names a pod by its address), else the
    host name."""
    pod = os.environ.get("POD_IP") or socket.gethostname()
    return f"kv@{pod}@{model_id}"


def chained_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A block's key: blake2b (16 bytes) of the parent's key and the tokens as
    little-endian int64, the scheme of ExLlamaV3's page table
    (``generator/pagetable.py:23-28``: ``tensor.numpy().tobytes()`` of a ``torch.long``
    tensor on a little-endian host)."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(ids.tobytes())
    return h.digest()


# ---------------------------------------------------------------- publishing


class BatchSink(Protocol):
    """Where ``KvEvents`` hands its batches: ``publish`` returns at once, ``False``
    when the batch was dropped; ``dropped`` counts those."""

    dropped: int

    def publish(self, batch: KVEventBatch) -> bool: ...


# What libzmq answers a bind to an address that is not this host's: an IP it does not
# have (EADDRNOTAVAIL) or a name that is not an interface of it (ENODEV).
_NOT_HERE = (errno.EADDRNOTAVAIL, errno.ENODEV)


def _bind_or_connect(sock: zmq.Socket[bytes], endpoint: str, *, connect: bool) -> bool:
    """Bind ``endpoint`` where this host can, else connect to it (module docstring);
    ``True`` when bound. Raises ``zmq.ZMQError`` for a port in use or a malformed
    address."""
    if not connect:
        try:
            sock.bind(endpoint)
            return True
        except zmq.ZMQError as e:
            if e.errno not in _NOT_HERE or not endpoint.startswith("tcp://"):
                raise
    sock.connect(endpoint)
    return False


class KvEventPublisher:
    """The PUB (and optional replay ROUTER) socket behind a bounded queue and a sender thread.

    ``publish`` (any thread) never blocks: ``False`` and ``dropped`` + 1 when
    ``max_queue`` batches are already waiting. Sequence numbers are given by the
    sender thread, so a dropped batch leaves no gap: ``KvEvents`` resyncs instead.
    ``bound``: whether the PUB socket listens at ``endpoint`` (subscribers dial it) or
    dialled it (a subscriber there binds); ``connect`` forces the latter. Raises
    ``zmq.ZMQError`` when an endpoint cannot be bound (port in use).
    """

    def __init__(
        self,
        endpoint: str,
        topic: str,
        replay_endpoint: str | None = None,
        *,
        connect: bool = False,
        max_queue: int = QUEUE_BATCHES,
        replay_batches: int = REPLAY_BATCHES,
        replay_bytes: int = REPLAY_BYTES,
    ) -> None:
        self.topic = topic
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(max_queue)
        self._replay_batches = replay_batches
        self._replay_bytes = replay_bytes
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered_bytes = 0
        self._stop = threading.Event()
        self.dropped = 0
        """Batches refused because the queue was full (read by the heartbeat thread)."""
        self.sent = 0
        """Batches sent on the PUB socket."""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
            self._pub.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:5557 and IPv6-only pods
            self.bound = _bind_or_connect(self._pub, endpoint, connect=connect)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        # The sockets move to the sender thread here; Thread.start is the memory
        # barrier ZeroMQ asks for when a socket changes threads.
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> bool:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued for up to ``timeout`` seconds, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except zmq.ZMQError as e:
                    log.warning("kv events: replay request failed: %s", e)
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            n = next(seq)
            payload = encoder.encode(batch)
            try:
                # PUB never blocks: past its high-water mark a subscriber misses messages.
                self._pub.send_multipart((self._topic, n.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                self.sent += 1
            except zmq.ZMQError as e:
                log.warning("kv events: cannot send batch %d: %s", n, e)
            self._keep(n, payload)

    def _keep(self, n: int, payload: bytes) -> None:
        self._buffer.append((n, payload))
        self._buffered_bytes += len(payload)
        while len(self._buffer) > self._replay_batches or (
            self._buffered_bytes > self._replay_bytes and len(self._buffer) > 1
        ):
            self._buffered_bytes -= len(self._buffer.popleft()[1])

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: replay request of %d frames ignored", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for n, payload in list(self._buffer):
            if n >= first:
                self._replay.send_multipart((identity, b"", n.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))


# ---------------------------------------------------------------- the index of published blocks


@dataclass(slots=True)
class _Block:
    parent: bytes | None
    token_ids: tuple[int, ...]
    refs: int


class KvEvents:
    """What the engine's cache holds, in blocks, and the events that tell it (engine thread only).

    Two ways in: ``stored``/``removed`` for an engine that keys blocks itself
    (ExLlamaV3's pages), and ``store_tokens``/``evict_tokens`` for a cache of token
    sequences (the CPU engine's prefix cache), cut here into ``block_size`` blocks
    keyed by ``chained_hash``. A block is present while its reference count is
    above 0; each ``stored``/``store_tokens`` must be matched by one
    ``removed``/``evict_tokens`` of the same block or tokens, or a ``cleared``.
    ``flush`` publishes the net change since the last one as one batch (a block
    stored and evicted within one step is not published at all). The first batch
    is ``AllBlocksCleared``: a new process holds nothing.
    """

    def __init__(self, sink: BatchSink, *, block_size: int, medium: str) -> None:
        if block_size < 1:
            raise ValueError(f"block_size={block_size}")
        self.block_size = block_size
        self.medium = medium
        self._sink = sink
        self._blocks: dict[bytes, _Block] = {}
        self._published: set[bytes] = set()  # what subscribers were told is present
        self._stale: set[bytes] = set()  # removals that a dropped batch carried
        self._touched: dict[bytes, None] = {}  # changed since the last flush, in order
        self._clear = True
        self._resync = False
        self.skipped_salted = 0
        """``store_tokens`` calls not published because of their ``cache_salt``."""

    def __len__(self) -> int:
        return len(self._blocks)

    # ------------------------------------------------------------ engine-keyed blocks

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int]) -> None:
        """One reference more to the block ``block_hash`` (``token_ids``: its
        ``block_size`` tokens, ``parent``: the block before it, ``None`` at the start)."""
        block = self._blocks.get(block_hash)
        if block is None:
            self._blocks[block_hash] = _Block(parent, tuple(token_ids), 1)
            self._touched[block_hash] = None
        else:
            block.refs += 1

    def removed(self, block_hash: bytes) -> None:
        """One reference fewer; the block leaves at 0. Unknown hashes are ignored."""
        block = self._blocks.get(block_hash)
        if block is None:
            return
        block.refs -= 1
        if block.refs <= 0:
            del self._blocks[block_hash]
            self._touched[block_hash] = None

    def cleared(self) -> None:
        """Everything is gone (reset)."""
        self._blocks.clear()
        self._touched.clear()
        self._clear = True

    def present(self) -> set[bytes]:
        """The hashes of the blocks present now."""
        return set(self._blocks)

    # ------------------------------------------------------------ token sequences

    def block_chain(self, tokens: Iterable[int]) -> list[tuple[bytes, bytes | None, tuple[int, ...]]]:
        """``(hash, parent, token_ids)`` of each whole block of ``tokens``, in order."""
        ids = list(tokens)
        out: list[tuple[bytes, bytes | None, tuple[int, ...]]] = []
        parent: bytes | None = None
        size = self.block_size
        for start in range(0, len(ids) - size + 1, size):
            block = tuple(ids[start : start + size])
            h = chained_hash(parent, block)
            out.append((h, parent, block))
            parent = h
        return out

    def store_tokens(self, tokens: Iterable[int], salt: str | None) -> None:
        """The KV of ``tokens`` entered the cache as one entry; its whole blocks are
        published, unless it is stored under a ``cache_salt`` (module docstring)."""
        if salt is not None:
            self.skipped_salted += 1
            return
        for h, parent, block in self.block_chain(tokens):
            self.stored(h, parent, block)

    def evict_tokens(self, tokens: Iterable[int], salt: str | None) -> None:
        """The entry ``store_tokens`` was given ``tokens`` for left the cache."""
        if salt is not None:
            return
        for h, _, _ in self.block_chain(tokens):
            self.removed(h)

    # ------------------------------------------------------------ publishing

    def flush(self, now: float | None = None) -> None:
        """Publish the change since the last flush as one batch (nothing when none)."""
        events: list[KvEvent] = []
        if self._clear or self._resync:
            gone = self._published | self._stale
            if gone:
                events.append(BlockRemoved(sorted(gone), self.medium))
            events.append(AllBlocksCleared())
            published: set[bytes] = set()
            touched: Iterable[bytes] = list(self._blocks)
        else:
            published = self._published
            touched = self._touched
        removed = [h for h in touched if h in published and h not in self._blocks]
        added = [h for h in touched if h not in published and h in self._blocks]
        if removed:
            events.append(BlockRemoved(removed, self.medium))
        events += self._stored_events(added)
        self._touched = {}
        if not events:
            return
        new_published = (published - set(removed)) | set(added)
        batch = KVEventBatch(time.time() if now is None else now, events, 0)
        if self._sink.publish(batch):
            self._published = new_published
            self._stale = set()
            self._clear = self._resync = False
        else:
            # Subscribers may now miss any of this: send everything again next time.
            self._stale |= self._published | set(removed)
            self._published = new_published
            self._resync = True

    def _stored_events(self, added: list[bytes]) -> list[KvEvent]:
        """``BlockStored`` events for ``added``: chains of blocks, each after its parent."""
        if not added:
            return []
        new = set(added)
        depth: dict[bytes, int] = {}

        def depth_of(h: bytes) -> int:
            # Blocks in ``added`` count from the first one whose parent is not new.
            chain: list[bytes] = []
            x: bytes | None = h
            while x is not None and x in new and x not in depth:
                chain.append(x)
                x = self._blocks[x].parent
            base = depth[x] if x is not None and x in depth else -1
            for c in reversed(chain):
                base += 1
                depth[c] = base
            return depth[h]

        for h in added:
            depth_of(h)
        runs: list[list[bytes]] = []
        tails: dict[bytes, list[bytes]] = {}
        for h in sorted(added, key=lambda x: depth[x]):
            parent = self._blocks[h].parent
            run = tails.pop(parent, None) if parent is not None else None
            if run is None:
                run = []
                runs.append(run)
            run.append(h)
            tails[h] = run
        events: list[KvEvent] = []
        for run in runs:
            tokens: list[int] = []
            for h in run:
                tokens += self._blocks[h].token_ids
            events.append(
                BlockStored(
                    run,
                    self._blocks[run[0]].parent,
                    tokens,
                    self.block_size,
                    None,
                    self.medium,
                    None,
                )
            )
        return events


@runtime_checkable
class KvEventSource(Protocol):
    """A backend whose cache can be published: ``attach_kv_events`` hooks a ``KvEvents``
    of the backend's block size and medium into its cache and returns it (the loop
    flushes it once per turn, after the step)."""

    def attach_kv_events(self, sink: BatchSink) -> KvEvents: ...
