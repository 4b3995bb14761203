"""The wheel's ``exllamav3/generator/pagetable.py``: cache pages (``_Page``), their chained
content hashes (``_chain_hash``) and the page table that allocates, reuses, evicts and
restores them (``_PageTable``)."""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import deque
from collections.abc import Sequence
from typing import Any

from .constants import PAGE_SIZE
from .tensor import FakeTensor

_unique_hashes = 0


def _random_hash() -> bytes:
    """``_randomhash`` (``pagetable.py:30-34``): a process-wide counter, 16 bytes big-endian, so
    its first 8 bytes are zero."""
    global _unique_hashes
    _unique_hashes += 1
    return _unique_hashes.to_bytes(16, "big")


def _is_content_hash(h: bytes) -> bool:
    """``is_content_hash`` (``pagetable.py:39-42``)."""
    return h[:8] != bytes(8)


class _Page:
    """One cache page (``pagetable.py:45-81``). ``*_revert`` and ``can_revert`` keep what the
    page held before a job reserved it for new tokens, so that a reservation the job never
    writes gives the page back unchanged (``pagetable.py:112-127``). ``sequence`` is the
    ``(1, n)`` tensor of its tokens (1.6.5's is ``(1, PAGE_SIZE)``, valid up to
    ``kv_position``, ``pagetable.py:390``)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.phash: bytes = _random_hash()
        self.prev_hash: Any = None
        self.tokens: list[int] = []
        self.kv_position = 0
        self.ref_count = 0
        self.access = 0
        self.can_revert = False
        self.phash_revert: Any = self.phash
        self.prev_hash_revert: Any = None
        self.tokens_revert: list[int] = []
        self.kv_position_revert = 0
        self.access_revert = 0
        # pagetable.py:79-81: False once a page's chain holds an image id (set at allocation)
        self.persistable = True

    @property
    def content_hashed(self) -> bool:
        return _is_content_hash(self.phash)

    @property
    def sequence(self) -> FakeTensor:
        return FakeTensor(self.tokens)

    def backup(self) -> None:
        """``CachePage.backup`` (``pagetable.py:112-118``)."""
        self.phash_revert, self.prev_hash_revert = self.phash, self.prev_hash
        self.tokens_revert, self.kv_position_revert = self.tokens, self.kv_position
        self.access_revert = self.access
        self.can_revert = True


def _chain_hash(prev: bytes | None, tokens: Sequence[int]) -> bytes:
    """``_tensor_blake2b_checksum`` (``pagetable.py:23-28``): blake2b, 16 bytes, of the previous
    page's hash and the page's ``torch.long`` tokens as ``numpy().tobytes()`` (int64,
    little-endian on the x86 and ARM hosts CUDA runs on)."""
    h = hashlib.blake2b(digest_size=16)
    if prev is not None:
        h.update(prev)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class _PageTable:
    """Pages of ``PAGE_SIZE`` tokens; ``by_hash`` holds content-hashed pages whether
    referenced or not (``pagetable.py:553-680``).

    Reserved pages keep a backup: a page taken for new tokens (``add_ref_unique``,
    ``pagetable.py:153-164``) is restored to its previous hash, tokens and position when
    its last job releases it without having written it (``sub_ref``,
    ``pagetable.py:166-177``). Every prefill or decode write clears ``can_revert``
    (``job.py:1435,1497,1662``, ``generator.py:1678``, ``job.py:697``). A page missing
    by hash is cleared with no backup (``add_ref_clear``, ``pagetable.py:140-150``)."""

    def __init__(self, max_pages: int) -> None:
        self.pages = [_Page(i) for i in range(max_pages)]
        self.by_hash: dict[Any, _Page] = {}
        self.serial = 0

    @property
    def max_pages(self) -> int:
        return len(self.pages)

    @property
    def all_pages(self) -> list[_Page]:
        """``PageTable.all_pages`` (``pagetable.py:380-399``, ``reset_page_table``)."""
        return self.pages

    def num_unreferenced_pages(self) -> int:
        return sum(1 for p in self.pages if p.ref_count == 0)

    def _tick(self) -> int:
        self.serial += 1
        return self.serial

    def build_eviction_order(self, protected: set[Any]) -> deque[_Page]:
        """``PageTable.build_eviction_order`` (``pagetable.py:411-520``, the default "tree"
        policy): the unreferenced pages, least valuable first. Empty pages oldest first; then
        orphaned trees (a chain whose first page's ``prev_hash`` no longer names a page) and
        then rooted trees, each tree least recently used root first and eaten leaf-first, the
        oldest leaf first (a page in use or in ``protected`` blocks its ancestors); whatever
        that walk could not reach last, ``protected`` pages dead last."""
        order: list[_Page] = []
        emitted: set[int] = set()
        empty = [
            p for p in self.pages if p.ref_count == 0 and p.kv_position == 0 and p.phash not in protected
        ]
        for p in sorted(empty, key=lambda p: p.access):
            order.append(p)
            emitted.add(p.index)
        by_hash = {p.phash: p for p in self.pages}
        children: dict[int, list[_Page]] = {p.index: [] for p in self.pages}
        parent_of: dict[int, _Page] = {}
        roots: list[_Page] = []
        orphans: list[_Page] = []
        for p in self.pages:
            if p.prev_hash is None:
                roots.append(p)
                continue
            parent = by_hash.get(p.prev_hash)
            if parent is None or parent is p:
                orphans.append(p)
            else:
                children[parent.index].append(p)
                parent_of[p.index] = parent

        def prune(root: _Page) -> None:
            remaining: dict[int, int] = {}
            heap: list[tuple[int, int, _Page]] = []
            stack = [root]
            while stack:
                p = stack.pop()
                remaining[p.index] = len(children[p.index])
                if not children[p.index]:
                    heapq.heappush(heap, (p.access, p.index, p))
                stack.extend(children[p.index])
            while heap:
                _, _, p = heapq.heappop(heap)
                if p.index not in emitted:
                    if p.ref_count > 0 or p.phash in protected:
                        continue
                    order.append(p)
                    emitted.add(p.index)
                parent = parent_of.get(p.index)
                if parent is not None:
                    remaining[parent.index] -= 1
                    if remaining[parent.index] == 0:
                        heapq.heappush(heap, (parent.access, parent.index, parent))

        for root in sorted(orphans, key=lambda p: p.access) + sorted(roots, key=lambda p: p.access):
            prune(root)
        rest = [p for p in self.pages if p.ref_count == 0 and p.index not in emitted]
        order += sorted(rest, key=lambda p: (p.phash in protected, p.access))
        return deque(order)

    def set_hash(self, page: _Page, h: Any) -> None:
        if self.by_hash.get(page.phash) is page:
            del self.by_hash[page.phash]
        page.phash = h
        if _is_content_hash(h):
            assert self.by_hash.get(h) in (None, page), "two pages with one content hash"
            self.by_hash[h] = page

    def make_unique(self, page: _Page) -> None:
        self.set_hash(page, _random_hash())

    def clear(self, page: _Page) -> None:
        """``CachePage.clear`` (``pagetable.py:178-188``): an unreferenced page loses its content."""
        assert page.ref_count == 0
        self.make_unique(page)
        page.prev_hash, page.kv_position, page.tokens, page.can_revert = None, 0, [], False

    def allocate(self, page_hashes: list[Any], new_unique_pages: int) -> tuple[list[_Page], int]:
        """``PageTable.allocate_pages`` (``pagetable.py:553-680``) without the CPU tier. The
        eviction order is built once, at the first page not found by hash, and pages claimed
        by hash since are skipped (``next_evictable``, ``pagetable.py:577-587``); ``protected``
        is the job's own prompt hashes (``job.py:1705-1708``)."""
        protected = set(page_hashes)
        available: deque[_Page] | None = None

        def next_evictable() -> _Page:
            nonlocal available
            if available is None:
                available = self.build_eviction_order(protected)
            else:
                while available[0].ref_count:
                    available.popleft()
            return available.popleft()

        out: list[_Page] = []
        for h in page_hashes:
            tick = self._tick()
            page = self.by_hash.get(h)
            if page is not None:
                # add_ref (pagetable.py:130-137)
                page.access = max(tick, page.access)
            else:
                # add_ref_clear (pagetable.py:140-150)
                page = next_evictable()
                self.set_hash(page, h)
                page.tokens, page.kv_position, page.prev_hash = [], 0, None
                page.access = tick
            page.ref_count += 1
            page.can_revert = False
            out.append(page)
        for _ in range(new_unique_pages):
            tick = self._tick()
            # add_ref_unique (pagetable.py:153-164)
            page = next_evictable()
            page.backup()
            self.make_unique(page)
            page.tokens, page.kv_position, page.prev_hash = [], 0, None
            page.ref_count += 1
            page.access = tick
            # Link the first fresh page to a complete cached prefix (pagetable.py:640-646).
            if out and out[-1].kv_position == PAGE_SIZE:
                page.prev_hash = out[-1].phash
            out.append(page)
        cached = 0
        for page in out:
            if page.kv_position != PAGE_SIZE:
                break
            cached += 1
        return out, cached

    def deallocate(self, pages: list[_Page]) -> None:
        """``sub_ref`` per page (``pagetable.py:166-177``): the last release of a reserved page
        nobody wrote restores its previous content, under a fresh hash if another page has
        taken that content hash meanwhile."""
        for p in pages:
            p.ref_count -= 1
            if p.ref_count or not p.can_revert:
                continue
            old = p.phash_revert
            p.prev_hash, p.tokens = p.prev_hash_revert, p.tokens_revert
            p.kv_position, p.access = p.kv_position_revert, p.access_revert
            p.can_revert = False
            if any(q.phash == old for q in self.pages if q is not p):
                self.make_unique(p)
                p.prev_hash = None
            else:
                self.set_hash(p, old)
