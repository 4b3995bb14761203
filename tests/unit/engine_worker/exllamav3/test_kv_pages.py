"""ExLlamaV3's page table as KV-cache events, through the fake 1.6.5 generator (whose pages
hash as 1.6.5's do: ``tests/fakes/exllamav3/``, ``_chain_hash``)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np

from engine_worker.exllamav3.kv_pages import complete_pages
from engine_worker.kv_events import KVEventBatch
from engine_worker.options.exllamav3 import PAGE_SIZE
from tests.fakes import exllamav3 as fx
from tests.fakes import kv_subscriber as vllm
from tests.fakes.exllamav3_driver import add, make_backend, raw, run


class Sink:
    def __init__(self) -> None:
        self.index = vllm.BlockIndex()
        self.events: list[Any] = []
        self.dropped = 0

    def publish(self, batch: KVEventBatch) -> bool:
        seq = self.index.next_seq
        msg = vllm.Message("kv@pod@fake", seq, vllm.DECODER.decode(msgspec.msgpack.encode(batch)))
        self.index.apply(msg)
        self.events += msg.batch.events
        return True


def page_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """1.6.5's ``_tensor_blake2b_checksum`` (``generator/pagetable.py:23-28``), written here
    with numpy: blake2b-16 over the parent hash and the tokens as int64 bytes."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def prompt_ids(text: str) -> list[int]:
    return [fx.BOS, *text.encode()]


def _letters(n: int, start: int = 0) -> str:
    return "".join(chr(0x61 + (i + start) % 26) for i in range(n - 1))


def test_prefilled_pages_are_published_with_the_real_chained_hashes() -> None:
    backend, _ = make_backend(script=fx.reply("Hi"), max_chunk_size=256)
    sink = Sink()
    events = backend.attach_kv_events(sink)
    events.flush()
    text = _letters(700)
    add(backend, raw("a", text))
    run(backend)
    events.flush()
    ids = prompt_ids(text)
    # (700 - 1) // 256 = 2 whole prompt pages (Sequence.prepare, pagetable.py:248).
    h1 = page_hash(None, ids[:PAGE_SIZE])
    h2 = page_hash(h1, ids[PAGE_SIZE : 2 * PAGE_SIZE])
    stored = [e for e in sink.events if isinstance(e, vllm.BlockStored)]
    assert stored == [vllm.BlockStored([h1, h2], None, ids[: 2 * PAGE_SIZE], PAGE_SIZE, None, "GPU", None)]
    assert sink.index.chain_tokens(h2) == ids[: 2 * PAGE_SIZE]
    # The same prompt again: its pages are reused, nothing is new.
    sink.events.clear()
    add(backend, raw("b", text))
    run(backend)
    events.flush()
    assert sink.events == []


def test_a_page_completed_by_decoding_is_published_under_its_prefix() -> None:
    backend, _ = make_backend(script=fx.reply("x" * 300), max_chunk_size=256)
    sink = Sink()
    events = backend.attach_kv_events(sink)
    text = _letters(200)
    add(backend, raw("a", text, max_tokens=400))
    run(backend)
    events.flush()
    stored = [e for e in sink.events if isinstance(e, vllm.BlockStored)]
    (page,) = stored
    # The first page filled while generating: 200 prompt tokens and the first 56 sampled ones.
    assert page.token_ids[:200] == prompt_ids(text) and page.parent_block_hash is None
    assert page.block_hashes == [page_hash(None, page.token_ids)]


def test_evicted_pages_are_removed_and_a_new_generator_clears_everything() -> None:
    backend, rec = make_backend(script=fx.reply("Hi"), max_chunk_size=256, cache_tokens=1024)
    sink = Sink()
    events = backend.attach_kv_events(sink)
    first, second = _letters(700), _letters(700, start=5)
    add(backend, raw("a", first, max_tokens=8))
    run(backend)
    events.flush()
    stored_first = {h for e in sink.events if isinstance(e, vllm.BlockStored) for h in e.block_hashes}
    assert len(stored_first) == 2
    # 4 pages in all: the second prompt's 3 pages evict the first one's.
    add(backend, raw("b", second, max_tokens=8))
    run(backend)
    events.flush()
    removed = {h for e in sink.events if isinstance(e, vllm.BlockRemoved) for h in e.block_hashes}
    assert removed and removed <= stored_first
    assert sink.index.removed_unknown == 0 and sink.index.orphans == 0
    held = set(sink.index.blocks)
    assert held == set(complete_pages(rec.inner.pagetable))
    # A fault rebuilds the generator: an empty page table, said as removals then a clear.
    sink.events.clear()
    rec.inner.fail_next_iterate = RuntimeError("CUDA out of memory")
    add(backend, raw("c", "y", max_tokens=4))
    backend.step()
    events.flush()
    assert sink.events[-1] == vllm.AllBlocksCleared()
    assert {h for e in sink.events if isinstance(e, vllm.BlockRemoved) for h in e.block_hashes} == held
    run(backend)
