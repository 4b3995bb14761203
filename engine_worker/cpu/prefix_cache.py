"""Token-level prefix cache: the KV of earlier sequences, reused by later prompts.

Each entry is one finished (or aborted) sequence: the token ids whose KV exists
(prompt plus generated tokens that were fed back) and their KV (``kv_cache.KVTensors``).
A lookup returns the entry sharing the longest common token prefix with a new
prompt; the engine copies that many positions into the new sequence's cache, so
entries are never written after insertion and a later failure or abort cannot
corrupt them.

Memory is bounded by ``capacity_bytes``, counted from the actual tensor storages;
least-recently-used entries are evicted first. An entry whose tokens are a prefix
of a newly inserted sequence is dropped as redundant (the conversation grew).

``listen(on_store, on_evict)`` is told of every entry that enters and leaves
(KV-cache events, ``engine_worker.kv_events``): ``on_store(tokens, salt)`` after an
entry is stored, ``on_evict(tokens, salt)`` with the same ``tokens`` when it leaves
(eviction, redundancy, ``clear``), so each store is matched by one evict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine_worker.cpu.kv_cache import KVTensors, kv_length, kv_nbytes


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """Token ids (``[n]`` int64) and the KV of exactly those ``n`` positions,
    stored under ``salt`` (``Submit.cache_salt``): only a lookup with the same
    salt can find it."""

    tokens: torch.Tensor
    kv: KVTensors
    nbytes: int
    salt: str | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """``length`` leading positions of ``entry`` match the looked-up tokens."""

    entry: CacheEntry
    length: int


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of equal leading elements of two 1-D tensors."""
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0:
        return 0
    diff = torch.nonzero(a[:n] != b[:n])
    return int(diff[0, 0]) if diff.shape[0] else n


EntryListener = Callable[[torch.Tensor, str | None], None]
"""Told an entry's token ids (``[n]`` int64, not to be modified) and its salt."""


def _ignore(tokens: torch.Tensor, salt: str | None) -> None:
    pass


class PrefixCache:
    """LRU set of sequences' KV, bounded by ``capacity_bytes`` (0 disables it)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._next_id = 0
        self._bytes = 0
        self._on_store: EntryListener = _ignore
        self._on_evict: EntryListener = _ignore

    def listen(self, on_store: EntryListener, on_evict: EntryListener) -> None:
        """Call ``on_store`` for each entry stored from now on and ``on_evict`` for each
        that leaves (module docstring); called on the engine thread, in order."""
        self._on_store, self._on_evict = on_store, on_evict

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        """Bytes held by all entries' KV tensors."""
        return self._bytes

    def clear(self) -> None:
        for entry in self._entries.values():
            self._on_evict(entry.tokens, entry.salt)
        self._entries.clear()
        self._bytes = 0

    def lookup(
        self, tokens: Sequence[int] | torch.Tensor, max_length: int, salt: str | None = None
    ) -> PrefixHit | None:
        """The entry of ``salt`` with the longest common prefix with ``tokens``, at
        most ``max_length`` positions; ``None`` when nothing matches. Marks it used."""
        query = torch.as_tensor(tokens, dtype=torch.long)
        best_id, best_len = -1, 0
        for entry_id, entry in self._entries.items():
            if entry.salt != salt:
                continue
            n = min(common_prefix_length(entry.tokens, query), max_length)
            if n > best_len:
                best_id, best_len = entry_id, n
        if best_len == 0:
            return None
        self._entries.move_to_end(best_id)
        return PrefixHit(self._entries[best_id], best_len)

    def insert(self, tokens: Sequence[int] | torch.Tensor, kv: KVTensors, salt: str | None = None) -> bool:
        """Store ``kv`` (exactly ``len(tokens)`` positions) for ``tokens`` under ``salt``.

        Returns ``False`` when not stored: empty, larger than the whole budget, or
        already covered by an entry that extends it (that entry is marked used).
        Raises ``ValueError`` when ``kv``'s length differs from ``len(tokens)``.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).clone()
        n = int(ids.shape[0])
        if n == 0:
            return False
        if kv_length(kv) != n:
            raise ValueError(f"KV holds {kv_length(kv)} positions for {n} tokens")
        for entry_id, entry in list(self._entries.items()):
            if entry.salt != salt:
                continue
            lcp = common_prefix_length(entry.tokens, ids)
            if lcp == n and len(entry) >= n:
                self._entries.move_to_end(entry_id)
                return False
            if lcp == len(entry):
                self._remove(entry_id)
        nbytes = kv_nbytes(kv)
        if nbytes > self.capacity_bytes:
            return False
        while self._bytes + nbytes > self.capacity_bytes and self._entries:
            self._remove(next(iter(self._entries)))
        self._entries[self._next_id] = CacheEntry(ids, kv, nbytes, salt)
        self._next_id += 1
        self._bytes += nbytes
        self._on_store(ids, salt)
        return True

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._bytes -= entry.nbytes
        self._on_evict(entry.tokens, entry.salt)
