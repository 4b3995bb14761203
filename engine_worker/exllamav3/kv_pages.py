"""ExLlamaV3's page table as KV-cache events (``engine_worker.kv_events``).

What 1.6.5 keeps (``exllamav3/generator/pagetable.py``): ``PageTable.all_pages``, one
``CachePage`` per 256-token page (``reset_page_table``, lines 374-400). A page holds
reusable KV when it is complete (``kv_position == PAGE_SIZE``) under a content hash:
``phash`` is then blake2b-16 of the previous page's hash and the page's tokens
(``_tensor_blake2b_checksum``, lines 23-28; set by ``Sequence.prepare`` for prompt
pages, lines 240-259, and by ``CachePage.update_hash`` when generation completes one,
lines 191-201), ``prev_hash`` names the page before it (``None`` at the start of a
sequence) and ``sequence`` (``(1, PAGE_SIZE)`` int64) its tokens (written at prefill,
``job.py:1661``, and decode, ``job.py:402``). Every other page has
a counter "random" hash whose first 8 bytes are zero (``_randomhash``, lines 30-34;
``is_content_hash``, lines 39-42). Pages enter that state at prefill and at a hash
update, and leave it when they are evicted for other content (``add_ref_clear``,
``add_ref_unique``, ``clear``), made unique again (``make_unique``), or the table is
reset (a new ``Generator`` builds a new one).

A page whose chain holds an image's ids (``FIRST_MM_EMBEDDING_INDEX`` and up: ids the
process allocates for each embedding, ``tokenizer/mm_embedding.py:4-21``) is not published:
1.6.5 marks it ``persistable = False`` at allocation (``pagetable.py:79-81``, ``295-297``),
and keeps it out of its own disk tier for the same reason (``disk_cache.py:610-618``). The
pages of the text before the first image are published as usual; what a router does with
the rest is in ``docs/kubernetes.md`` ("Images").

The table changes only inside ``Generator.iterate()`` (and ``cancel``, which keeps the
content of the pages it releases). So after each ``iterate()`` the set of complete
content-hashed pages is compared with the one published last: new pages become
``stored`` (their hash as the block hash, parent ``prev_hash``, tokens from
``sequence``), vanished ones ``removed``. Defragmentation moves pages but keeps
their hashes, so it publishes nothing. A walk is one pass over ``max_pages`` pages
(256 for a 64k-token cache; ``benchmarks/kv_events.py``, section ``pages``).
"""

from __future__ import annotations

from typing import Any

from engine_worker.kv_events import KvEvents
from engine_worker.options.exllamav3 import PAGE_SIZE


def is_content_hash(h: bytes) -> bool:
    """1.6.5's ``is_content_hash`` (``pagetable.py:39-42``): counter hashes start with 8 zero bytes."""
    return h[:8] != bytes(8)


def complete_pages(pagetable: Any) -> dict[bytes, Any]:
    """The pages of ``pagetable`` that hold a whole page of reusable KV, by hash."""
    return {
        p.phash: p for p in pagetable.all_pages if p.kv_position == PAGE_SIZE and is_content_hash(p.phash)
    }


class PageTableEvents:
    """Publishes a generator's page table through ``events`` (blocks of ``PAGE_SIZE``).

    Each ``sync`` collects the hashes of the complete pages in one pass (a set
    comprehension, the only per-step cost: about 0.1 µs a page), compares it with the
    last one in C (set differences), and looks pages up only when some are new."""

    def __init__(self, events: KvEvents) -> None:
        self.events = events
        self._complete: set[bytes] = set()  # complete pages at the last sync, any hash
        self._published: set[bytes] = set()  # those of them with a content hash

    def sync(self, pagetable: Any) -> None:
        """Tell ``events`` what changed in ``pagetable`` since the last ``sync``."""
        pages = pagetable.all_pages
        now = {p.phash for p in pages if p.kv_position == PAGE_SIZE}
        if now == self._complete:
            return
        for h in self._complete - now:
            if h in self._published:
                self._published.discard(h)
                self.events.removed(h)
        added = [h for h in now - self._complete if is_content_hash(h)]
        if added:
            by_hash = {p.phash: p for p in pages}
            for h in added:
                page = by_hash[h]
                if not page.persistable:
                    continue  # its chain holds image ids, which mean nothing outside this process
                self.events.stored(h, page.prev_hash, page.sequence.tolist()[0])
                self._published.add(h)
        self._complete = now

    def reset(self) -> None:
        """The table was replaced by an empty one (a rebuilt generator)."""
        self._complete = set()
        self._published = set()
        self.events.cleared()
