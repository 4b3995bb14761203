"""A KV-event subscriber written from vLLM's definitions, independent of ``engine_worker``.

The structs follow ``vllm/distributed/kv_events.py`` (``EventBatch``, ``KVCacheEvent``
``tag=True``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``;
``ExternalBlockHash`` is ``bytes | int``, ``vllm/v1/core/kv_cache_utils.py``), with
``array_like=True`` as in vLLM's example subscriber
(``examples/online_serving/kv_events_subscriber.py``) and as llm-d decodes them
(``msgpack:",array"`` in ``pkg/kvevents/engineadapter/vllm_adapter.go``). Fields vLLM
gives defaults (``extra_keys``, ``group_idx``, ...) keep their defaults, so a message
that leaves them out decodes, and one that put anything unexpected there fails.

``BlockIndex`` is what a router keeps per pod: the blocks it was told of, by hash,
each with its parent and tokens; ``prefix_tokens`` is how many leading tokens of a
prompt a pod holds (whole blocks, chained from the start), the number a precise
prefix-cache scorer routes by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass(frozen=True)
class Message:
    """One PUB message: ``topic``, ``seq`` (the 8-byte big-endian frame) and its batch."""

    topic: str
    seq: int
    batch: KVEventBatch


def decode(frames: list[bytes]) -> Message:
    """Raises ``ValueError`` for anything but three frames with an 8-byte sequence number,
    ``msgspec.ValidationError`` for a payload vLLM's structs do not accept."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(
            f"{len(frames)} frames, sequence frame of {len(frames[1]) if len(frames) > 1 else 0}"
        )
    return Message(frames[0].decode(), int.from_bytes(frames[1], "big"), DECODER.decode(frames[2]))


@dataclass
class BlockIndex:
    """A pod's blocks as its events told them. ``orphans`` counts stored blocks whose
    parent was unknown (llm-d drops those); ``removed_unknown`` removals of hashes never
    stored; ``cleared`` the ``AllBlocksCleared`` seen."""

    blocks: dict[ExternalBlockHash, tuple[ExternalBlockHash | None, tuple[int, ...]]] = field(
        default_factory=dict
    )
    ever_stored: set[ExternalBlockHash] = field(default_factory=set)
    removed: list[ExternalBlockHash] = field(default_factory=list)
    block_size: int = 0
    orphans: int = 0
    removed_unknown: int = 0
    cleared: int = 0
    next_seq: int = 0

    def apply(self, msg: Message) -> None:
        assert msg.seq == self.next_seq, f"sequence {msg.seq}, expected {self.next_seq}"
        self.next_seq += 1
        for ev in msg.batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if self.blocks.pop(h, None) is None:
                        self.removed_unknown += 1
                    self.removed.append(h)
            else:
                self.blocks.clear()
                self.cleared += 1

    def _stored(self, ev: BlockStored) -> None:
        size = ev.block_size
        assert len(ev.token_ids) == size * len(ev.block_hashes), "token_ids must cover every block"
        self.block_size = size
        parent = ev.parent_block_hash
        if parent is not None and parent not in self.blocks:
            self.orphans += 1
            return
        for i, h in enumerate(ev.block_hashes):
            self.blocks[h] = (parent, tuple(ev.token_ids[i * size : (i + 1) * size]))
            self.ever_stored.add(h)
            parent = h

    def chain_tokens(self, h: ExternalBlockHash) -> list[int]:
        """The tokens from the start of the sequence to the end of block ``h``, by parents."""
        out: list[tuple[int, ...]] = []
        cur: ExternalBlockHash | None = h
        while cur is not None:
            parent, tokens = self.blocks[cur]
            out.append(tokens)
            cur = parent
        return [t for block in reversed(out) for t in block]

    def prefix_tokens(self, prompt: list[int]) -> int:
        """Leading tokens of ``prompt`` held here in whole blocks chained from the start
        (matched by tokens and parent, not by hash: the router's own keys)."""
        if not self.block_size:
            return 0
        children: dict[ExternalBlockHash | None, dict[tuple[int, ...], ExternalBlockHash]] = {}
        for h, (parent, tokens) in self.blocks.items():
            children.setdefault(parent, {})[tokens] = h
        size, n, parent_h = self.block_size, 0, None
        while n + size <= len(prompt):
            nxt = children.get(parent_h, {}).get(tuple(prompt[n : n + size]))
            if nxt is None:
                break
            parent_h, n = nxt, n + size
        return n
