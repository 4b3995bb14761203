"""The wheel's ``exllamav3/generator/job.py`` (``Job``: prefill, token acceptance, stop
conditions, re-queue), with the stop-string matcher of
``exllamav3_ext/generator/strings.cpp`` (``_partial_strings_match``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .constants import PAGE_SIZE
from .filter import _allowed_by
from .mm_embedding import FIRST_MM_EMBEDDING_INDEX
from .ngram import _SuffixAutomaton
from .pagetable import _chain_hash
from .sampler import ComboSampler
from .tensor import FakeArray, FakeTensor, _ids_of
from .tokenizer import _piece

if TYPE_CHECKING:
    from .filter import Filter
    from .generator import Generator
    from .pagetable import _Page, _PageTable


def _partial_strings_match(text: str, strings: Sequence[str]) -> int:
    """``exllamav3_ext/generator/strings.cpp:partial_strings_match``: index of the earliest full
    match, ``-2`` if a string runs off the end of ``text`` before any full match, else ``-1``."""
    none = len(text) + 1
    best_full = best_partial = none
    for s in strings:
        if not s:
            continue
        limit = min(best_full, best_partial)
        for a0 in range(min(len(text), limit)):
            k = 0
            while a0 + k < len(text) and k < len(s) and text[a0 + k] == s[k]:
                k += 1
            if k == len(s):
                best_full = a0
                break
            if a0 + k == len(text):
                best_partial = a0
                break
    if best_partial < best_full:
        return -2
    return best_full if best_full < none else -1


class Job:
    """``exllamav3.Job`` with the exact 1.6.5 parameter list (``generator/job.py:54-75``)."""

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int | None = None,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        sampler: Any = None,
        seed: int | None = None,
        stop_conditions: list[int | str] | tuple[int | str, ...] | set[int | str] | None = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: list[Any] | None = None,
        token_healing: bool = False,
        identifier: object | None = None,
        banned_strings: list[str] | None = None,
        embeddings: list[Any] | None = None,
        max_rq_tokens: int | None = None,
        stop_on_loop: tuple[int, int] | None = None,
        rq_state: dict[str, Any] | None = None,
    ) -> None:
        if token_healing or stop_on_loop or return_logits:
            raise NotImplementedError("feature not modelled by the fake")
        ids = _ids_of(input_ids)
        # job.py:297-298. Fake-only check: an image id no embedding covers would read rows of an
        # uninitialised tensor in 1.6.5 (modules/embedding.py:198-211), silently.
        self.embeddings: list[Any] = list(embeddings or [])
        uncovered = [
            i
            for i in ids
            if i >= FIRST_MM_EMBEDDING_INDEX
            and not any(e.first_index <= i < e.last_index for e in self.embeddings)
        ]
        assert not uncovered, f"fake: image ids {uncovered[:3]} without their embedding"
        mm = [k for k, i in enumerate(ids) if i >= FIRST_MM_EMBEDDING_INDEX]
        self.mm_first_page: int | None = mm[0] // PAGE_SIZE if mm else None  # pagetable.py:232-233
        assert len(ids) > 0, "Input IDs cannot be empty."
        assert max_new_tokens is None or max_new_tokens >= 1, (
            "max_new_tokens must be >= 1, or None for no limit"
        )
        rq = rq_state or {}
        self.is_requeued = rq_state is not None
        self.rq_new_tokens: int = rq.get("rq_new_tokens", 0)
        self.generator: Generator | None = None
        self.serial_number: int | None = None
        self.identifier = identifier
        self.max_skips = max_skips
        self.skips = 0
        self.sampler = sampler if sampler is not None else ComboSampler(min_p=0.08, temperature=0.8)
        self.seed = seed
        self.input_ids = ids
        self.sequence_ids = list(ids)
        self.client_prompt: list[int] = rq.get("client_prompt", list(ids))
        self.sam: _SuffixAutomaton | None = rq.get("sam")
        self.kv_position = 0
        self.page_hashes: list[Any] = []
        self.max_cached_pages: int | None = None
        self.new_unique_pages = 0
        self.allocated_pages: list[_Page] = []
        self.prefill_complete = False
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.new_tokens = 0
        self.orig_max_rq_tokens = max_rq_tokens
        self.max_rq_tokens: int = max_rq_tokens or 0
        self.rq_margin = 0
        self.rq_headroom = 0
        self.decode_special_tokens = decode_special_tokens
        self.return_top_tokens = return_top_tokens
        self.return_probs = return_probs
        # job.py:289; a re-queued job keeps the same filter objects and their state (job.py:1250)
        self.filters: list[Filter] = list(filters) if filters is not None else []
        self.logit_mask: set[int] | None = None
        # One entry per active filter, the position's mask (job.py:411-434): a future from the
        # generator's filter pool, or None, and the mask computed inline, or None.
        self.filter_futures: list[Future[Any] | None] = []
        self.logit_masks: list[Any] = []
        self.stop_tokens: set[int] = set(rq.get("stop_tokens", set()))
        self.stop_strings: set[str] = set(rq.get("stop_strings", set()))
        if stop_conditions is not None:
            for t in [stop_conditions] if isinstance(stop_conditions, int | str) else stop_conditions:
                if isinstance(t, int):
                    self.stop_tokens.add(t)
                elif isinstance(t, str):
                    self.stop_strings.add(t)
                else:
                    raise ValueError("Unsupported type in stop_conditions")
        self.stop_string_max_length = max([0] + [len(s) for s in self.stop_strings])
        # job.py:615-623: lowercased; matched against the lowercased held text.
        self.banned_strings: list[str] = [s.lower() for s in banned_strings or []]
        self.checkpoint: dict[str, Any] | None = None
        self.held_text: str = rq.get("held_text", "")
        self.held_tokens: list[int] = list(rq.get("held_tokens", []))
        self.held_probs: list[float] = list(rq.get("held_probs", []))
        self.held_k_tokens: list[list[int]] = list(rq.get("held_k_tokens", []))
        self.held_k_probs: list[list[float]] = list(rq.get("held_k_probs", []))
        self.full_completion: str = rq.get("full_completion", "")
        self.time_enqueue: float | None = None
        self.time_first_prefill: float | None = None
        self.time_first_token: float | None = None
        self.time_last_token: float | None = None
        self.time_enqueued: float = rq.get("time_enqueued", 0.0)
        self.time_prefill: float = rq.get("time_prefill", 0.0)
        self.time_generate: float = rq.get("time_generate", 0.0)
        self.accepted_draft_tokens: int = rq.get("accepted_draft_tokens", 0)
        self.rejected_draft_tokens: int = rq.get("rejected_draft_tokens", 0)
        self.rq_prompt_tokens: int | None = rq.get("prompt_tokens")
        self.rq_cached: tuple[int, int] | None = rq.get("cached")
        self.cached_pages = 0
        self.cached_tokens = 0
        self.is_finished = False

    def __repr__(self) -> str:
        return f"Generator job #{self.serial_number}"

    def _cached(self) -> tuple[int, int]:
        return self.cached_pages, self.cached_pages * PAGE_SIZE + self.cached_tokens

    # -- queueing

    def prepare_for_queue(self, generator: Generator, serial_number: int, rq: bool = False) -> None:
        """``job.py:1264-1378``."""
        self.serial_number = serial_number
        self.generator = generator
        self.skips = 0
        room = generator.max_total_tokens - len(self.input_ids) - 1 - generator.max_draft_tokens
        if self.max_new_tokens is None:
            self.max_new_tokens = max(1, room)
        elif room >= 1:
            self.max_new_tokens = min(self.max_new_tokens, room)
        if self.orig_max_rq_tokens is not None:
            x = len(self.input_ids)
            y = (x - 1 + self.orig_max_rq_tokens + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
            y = min(y, generator.max_total_tokens - generator.max_draft_tokens)
            self.max_rq_tokens = max(1, y - x)
            self.rq_margin = 0
            self.rq_headroom = generator.max_draft_tokens
        else:
            self.max_rq_tokens = self.max_new_tokens + 1 + generator.max_draft_tokens
            self.rq_margin = generator.max_draft_tokens
            self.rq_headroom = 0
        # Sequence.prepare (pagetable.py:240-259)
        seq = self.sequence_ids
        max_len = len(seq) + self.max_rq_tokens + self.rq_headroom
        context_pages = (len(seq) - 1) // PAGE_SIZE
        total = (max_len + PAGE_SIZE - 1) // PAGE_SIZE
        h = None
        self.page_hashes = []
        for i in range(context_pages):
            h = _chain_hash(h, seq[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
            self.page_hashes.append(h)
        self.new_unique_pages = total - context_pages
        # MTP: the page holding the last prompt token is never reused, so that prefill runs at
        # least one real token through the target model (job.py:1329-1333).
        self.max_cached_pages = max(0, (len(seq) - 2) // PAGE_SIZE) if generator.mtp_draft else None
        total_pages = len(set(self._reusable_hashes())) + self._fresh_pages()
        max_pages = generator.pagetable.max_pages
        assert total_pages <= max_pages, (
            f"Job requires {total_pages} pages (only {max_pages} available) and cannot "
            + f"be enqueued. Total cache allocated is {max_pages} * {PAGE_SIZE} = "
            + f"{generator.max_total_tokens} tokens"
        )
        if not rq:
            self.held_text = ""
            self.held_tokens = []
            self.held_probs, self.held_k_tokens, self.held_k_probs = [], [], []  # job.py:1351-1355
            self.full_completion = ""
        self.time_enqueue = time.time()

    def _reusable_hashes(self) -> list[Any]:
        """Prompt page hashes looked up at allocation (``pagetable.py:291-296``)."""
        return (
            self.page_hashes if self.max_cached_pages is None else self.page_hashes[: self.max_cached_pages]
        )

    def _fresh_pages(self) -> int:
        """Pages taken without a lookup: new tokens plus prompt pages MTP leaves out."""
        return self.new_unique_pages + len(self.page_hashes) - len(self._reusable_hashes())

    def current_new_pages_required(self) -> int:
        """``job.py:1380-1388``."""
        pt = self.pagetable
        referenced = {p.phash for p in pt.pages if p.ref_count > 0}
        return sum(1 for h in set(self._reusable_hashes()) if h not in referenced) + self._fresh_pages()

    @property
    def pagetable(self) -> _PageTable:
        assert self.generator is not None
        return self.generator.pagetable

    def activate(self) -> None:
        """``job.py:1764-1773``: filters are attached and reset when the job starts, not when a
        re-queued segment starts again (their state carries over)."""
        if not self.is_requeued:
            for f in self.filters:
                f.attach(self)
                f.reset()
                f.is_active = f.trigger_token is None

    def prepare_logit_mask(self) -> None:
        """``job.py:411-486`` for the masks the fake models: the active filters' bitmasks ANDed,
        stop tokens blocked before ``min_new_tokens`` (``job.py:461-462``). ``logit_mask`` is the
        set of allowed ids, ``None`` when nothing is masked. The masks were started by
        ``Generator._launch_filters``; a background filter's is waited for here, on the
        engine thread, which re-raises whatever ``get_next_logit_mask`` raised on the pool
        (``job.py:423-434``)."""
        gen = self.generator
        assert gen is not None
        allowed: set[int] | None = None
        i = 0
        for f in self.filters:
            if not f.is_active:
                continue
            future = self.filter_futures[i]
            mask = future.result() if future is not None else self.logit_masks[i]
            i += 1
            bits = _allowed_by(mask, gen.padded_vocab_size)
            allowed = bits if allowed is None else allowed & bits
        self.filter_futures.clear()
        self.logit_masks.clear()
        if self.checkpoint is not None and self.checkpoint["offset"] == 0:
            # job.py:457-460: the tokens already tried where a banned string began.
            if allowed is None:
                allowed = set(range(gen.padded_vocab_size))
            allowed -= set(self.checkpoint["explored_tokens"])
        if self.new_tokens < self.min_new_tokens and self.stop_tokens:
            if allowed is None:
                allowed = set(range(gen.padded_vocab_size))
            allowed -= self.stop_tokens
        self.logit_mask = allowed

    def allocate_pages(self) -> None:
        self.allocated_pages, cached = self.pagetable.allocate(self._reusable_hashes(), self._fresh_pages())
        # pagetable.py:295-297: pages from the first one holding an image id on are process-local
        for i, page in enumerate(self.allocated_pages):
            page.persistable = self.mm_first_page is None or i < self.mm_first_page
        self.kv_position = cached * PAGE_SIZE
        self.cached_pages += cached

    def deallocate_pages(self) -> None:
        if self.allocated_pages:
            self.pagetable.deallocate(self.allocated_pages)
            self.allocated_pages = []

    def is_prefill_done(self) -> bool:
        return self.kv_position == len(self.sequence_ids) - 1

    def _hash_completed_page(self, index: int, h: Any) -> _Page:
        """``Job.hash_completed_page`` (``job.py:652-697``): a referenced page already holding
        ``h`` replaces this job's page; an unreferenced one is cleared. Returns the page now
        at ``index``."""
        pt = self.pagetable
        page = self.allocated_pages[index]
        other = pt.by_hash.get(h)
        if other is not None and other is not page:
            if other.ref_count > 0:
                access = page.access
                pt.deallocate([page])
                other.ref_count += 1
                other.access = max(access, other.access)
                other.can_revert = False
                self.allocated_pages[index] = other
                return other
            pt.clear(other)
        pt.set_hash(page, h)
        page.can_revert = False
        return page

    # -- prefill (job.py:1391-1693)

    def prefill(self, results: list[dict[str, Any]], chunk_size: int | None = None) -> None:
        gen = self.generator
        assert gen is not None
        if self.time_first_prefill is None:
            self.time_first_prefill = time.time()
        progress = 0
        seq = self.sequence_ids
        pages = self.allocated_pages
        if not self.prefill_complete:
            start = self.kv_position
            end = min((self.kv_position + gen.max_chunk_size) // PAGE_SIZE * PAGE_SIZE, len(seq) - 1)
            p0, p1 = start // PAGE_SIZE, (end + PAGE_SIZE - 1) // PAGE_SIZE
            for i in range(p0, p1):
                if pages[i].kv_position != PAGE_SIZE:
                    break
                start = self.kv_position = (i + 1) * PAGE_SIZE
                self.cached_pages += 1
                pages[i].can_revert = False
            for i in range(start // PAGE_SIZE, p1):
                if pages[i].kv_position == PAGE_SIZE:
                    end = i * PAGE_SIZE
                    break
            if chunk_size is not None:
                end = min(end, (start + chunk_size) // PAGE_SIZE * PAGE_SIZE)
            if end > start:
                p0 = start // PAGE_SIZE
                if start == p0 * PAGE_SIZE:
                    prev_hash = None if p0 == 0 else pages[p0 - 1].phash
                    chunk = seq[start:end]
                    best, best_page = 0, None
                    for page in gen.pagetable.pages:
                        if page.prev_hash != prev_hash or page is pages[p0]:
                            continue
                        m = 0
                        while m < min(page.kv_position, len(chunk)) and page.tokens[m] == chunk[m]:
                            m += 1
                        if m > best:
                            best, best_page = m, page
                    # MTP keeps one real prompt token for the target model (job.py:1476-1479).
                    if gen.mtp_draft and end == len(seq) - 1:
                        best = min(best, len(chunk) - 1)
                    if best_page is not None and best > 1:
                        target = pages[p0]
                        target.tokens = list(chunk[:best])
                        target.prev_hash = best_page.prev_hash
                        target.kv_position = best
                        target.can_revert = False
                        start += best
                        self.kv_position += best
                        self.cached_tokens += best
                        progress += best
                if end > start:
                    model = gen.model
                    if model.fail_prefill is not None and model.fail_prefill(self.client_prompt):
                        raise RuntimeError(f"prefill failed for job {self.serial_number}")
                    self.kv_position = end
                    # Pages p0..end // PAGE_SIZE, the one after an aligned end included, reset to
                    # position 0 (job.py:1463,1646-1662); hashing follows in a second pass, so a
                    # page rebuilt in this chunk links to its predecessor's old hash (job.py:1664-1672).
                    touched = range(p0, min(end // PAGE_SIZE + 1, len(pages)))
                    for i in touched:
                        page = pages[i]
                        page.kv_position = min(max(end - i * PAGE_SIZE, 0), PAGE_SIZE)
                        page.tokens = list(seq[i * PAGE_SIZE : i * PAGE_SIZE + page.kv_position])
                        page.prev_hash = None if i == 0 else pages[i - 1].phash
                        page.can_revert = False
                    for i in touched:
                        page = pages[i]
                        if (
                            page.kv_position == PAGE_SIZE
                            and i < len(self.page_hashes)
                            and page.phash != self.page_hashes[i]
                        ):
                            self._hash_completed_page(i, self.page_hashes[i])
                    progress += end - start
                    if self.kv_position >= len(seq) - 1:
                        self.prefill_complete = True
        if progress:
            r: dict[str, Any] = {
                "job": self,
                "stage": "prefill",
                "eos": False,
                "curr_progress": self.kv_position,
                "max_progress": len(seq) - 1,
                "serial": self.serial_number,
            }
            if self.identifier is not None:
                r["identifier"] = self.identifier
            results.append(r)

    # -- decoding

    def ngram_draft(self, length: int, match_min: int) -> list[int]:
        """``Job.get_ngram_draft`` (``job.py:1899-1920``, no corpus): the tokens after the
        earlier occurrence of the longest suffix the job's suffix automaton matches, when that
        suffix has ``match_min`` tokens or more."""
        if self.sam is None:
            self.sam = _SuffixAutomaton()
        seq = self.sequence_ids
        begin, end = self.sam.accept(seq)
        return seq[end : end + length] if end - begin >= match_min else []

    def receive_sample(
        self,
        token: int,
        results: list[dict[str, Any]],
        prob: float | None = None,
        k_tokens: list[int] | None = None,
        k_probs: list[float] | None = None,
    ) -> tuple[bool, bool]:
        """``job.py:781-1191`` without healing or loop detection; ``prob`` and
        ``k_tokens``/``k_probs`` are what ``receive_logits`` returned (``job.py:764-778``).
        Returns ``(eos, requeue)``."""
        gen = self.generator
        assert gen is not None
        # Filters are fed first (job.py:807-811).
        filter_eos_condition = False
        for f in self.filters:
            filter_eos_condition |= f.feed(token)
        self.new_tokens += 1
        requeue_now = self.new_tokens > self.max_rq_tokens - self.rq_margin
        # The forward pass wrote the K/V of the token it was fed (the last one of the sequence,
        # generator.py:1671-1679); the sampled token is fed by the next pass.
        page_before = self.kv_position // PAGE_SIZE
        page = self.allocated_pages[page_before]
        page.tokens.append(self.sequence_ids[self.kv_position])
        page.kv_position += 1
        page.can_revert = False
        self.sequence_ids.append(token)
        self.kv_position += 1
        if self.kv_position // PAGE_SIZE > page_before:
            page = self._hash_completed_page(page_before, _chain_hash(page.prev_hash, page.tokens))
            if page_before + 1 < len(self.allocated_pages):
                nxt = self.allocated_pages[page_before + 1]
                nxt.prev_hash = page.phash
                nxt.can_revert = False

        def emit(
            emit_eos: bool = False,
            eos_reason: str | None = None,
            emit_held: bool = False,
            stop_token: int | None = None,
            stop_string: str | None = None,
            rem_held_text: str | None = None,
        ) -> tuple[bool, bool]:
            nonlocal requeue_now
            if emit_eos:
                requeue_now = False
            r: dict[str, Any] = {"job": self, "stage": "streaming", "eos": emit_eos}
            r["serial"] = self.serial_number
            if eos_reason is not None:
                r["eos_reason"] = eos_reason
                if eos_reason == "stop_token":
                    assert stop_token is not None
                    r["eos_triggering_token_id"] = stop_token
                    r["eos_triggering_token_str"] = _piece(stop_token)
                if eos_reason == "stop_string":
                    r["eos_triggering_string"] = stop_string
            if requeue_now:
                r["requeue"] = True
                if self.checkpoint is not None:
                    emit_held = True  # job.py:882-884: no rewinding past a requeue
            if emit_held:
                if emit_eos and "\ufffd" in self.held_text and self.held_tokens:
                    self.held_text = gen.tokenizer.decode(
                        FakeTensor(self.held_tokens), decode_special_tokens=self.decode_special_tokens
                    )[0]
                if self.held_text != "":
                    self.full_completion += self.held_text
                    r["text"] = self.held_text
                    self.held_text = ""
                if self.held_tokens:
                    r["token_ids"] = FakeTensor(self.held_tokens)
                    self.held_tokens = []
                # job.py:902-907
                if self.held_probs:
                    r["token_probs"] = FakeArray([self.held_probs])
                    self.held_probs = []
                if self.held_k_tokens:
                    r["top_k_tokens"] = FakeArray([self.held_k_tokens])
                    r["top_k_probs"] = FakeArray([self.held_k_probs])
                    self.held_k_tokens, self.held_k_probs = [], []
            if emit_eos or requeue_now:
                assert self.time_first_prefill is not None and self.time_enqueue is not None
                assert self.time_first_token is not None
                self.time_last_token = time.time()
                self.time_enqueued += self.time_first_prefill - self.time_enqueue
                self.time_prefill += self.time_first_token - self.time_first_prefill
                self.time_generate += self.time_last_token - self.time_first_token
            if emit_eos:
                self.is_finished = True
                cached = self.rq_cached or self._cached()
                r.update(
                    {
                        "full_completion": self.full_completion,
                        "new_tokens": self.rq_new_tokens + self.new_tokens,
                        "prompt_tokens": self.rq_prompt_tokens or len(self.input_ids),
                        "time_enqueued": self.time_enqueued,
                        "time_prefill": self.time_prefill,
                        "time_generate": self.time_generate,
                        "cached_pages": cached[0],
                        "cached_tokens": cached[1],
                    }
                )
                if gen.draft_model or gen.ngram_match_min:
                    r["accepted_draft_tokens"] = self.accepted_draft_tokens
                    r["rejected_draft_tokens"] = self.rejected_draft_tokens
                if eos_reason == "stop_string":
                    assert rem_held_text is not None
                    self.held_text = rem_held_text
                rh: dict[str, Any] = {}
                if self.held_text:
                    rh["text"] = self.held_text
                if self.held_tokens:
                    rh["token_ids"] = FakeTensor(self.held_tokens)
                if self.held_probs:
                    rh["token_probs"] = FakeArray([self.held_probs])
                if self.held_k_tokens:
                    rh["top_k_tokens"] = FakeArray([self.held_k_tokens])
                    rh["top_k_probs"] = FakeArray([self.held_k_probs])
                if rh:
                    r["held"] = rh
            if self.identifier is not None:
                r["identifier"] = self.identifier
            results.append(r)
            return emit_eos, requeue_now

        held_text_before = self.held_text
        self.held_text += gen.tokenizer.get_id_to_piece_list(self.decode_special_tokens)[token]
        self.held_tokens.append(token)
        # job.py:981-985
        if self.return_probs:
            assert prob is not None
            self.held_probs.append(prob)
        if self.return_top_tokens > 0:
            assert k_tokens is not None and k_probs is not None
            self.held_k_tokens.append(k_tokens)
            self.held_k_probs.append(k_probs)
        if token in self.stop_tokens:
            return emit(emit_eos=True, eos_reason="stop_token", stop_token=token)
        assert self.max_new_tokens is not None
        if self.new_tokens >= self.max_new_tokens:
            return emit(emit_eos=True, emit_held=True, eos_reason="max_new_tokens")
        if filter_eos_condition:
            # job.py:1001-1002
            return emit(emit_eos=True, emit_held=True, eos_reason="end_filter")
        if "\ufffd" in self.held_text:
            test = gen.tokenizer.decode(
                FakeTensor(self.held_tokens), decode_special_tokens=self.decode_special_tokens
            )[0]
            if test.endswith("\ufffd") and len(test) <= self.stop_string_max_length + 20:
                return emit()
            self.held_text = test
        if requeue_now:
            self.checkpoint = None  # job.py:1133-1134
        elif self.banned_strings and self.new_tokens > 0:
            # job.py:1136-1159
            found = _partial_strings_match(self.held_text.lower(), self.banned_strings)
            if found == -1:
                self.checkpoint = None
            else:
                self._set_checkpoint(held_text_before, token)
                if found >= 0:
                    self._rewind_checkpoint()
                    return emit(emit_held=True)
                return emit()
        if self.stop_strings:
            match = _partial_strings_match(self.held_text, sorted(self.stop_strings))
            if match >= 0:
                held = self.held_text[match:]
                self.held_text = self.held_text[:match]
                for s in self.stop_strings:
                    if held.startswith(s):
                        return emit(
                            emit_eos=True,
                            emit_held=True,
                            eos_reason="stop_string",
                            stop_string=s,
                            rem_held_text=held,
                        )
                raise AssertionError("Detected stop string but couldn't identify it (logic error)")
            if match == -2:
                return emit()
        return emit(emit_held=True)

    def _set_checkpoint(self, held_text_before: str, token: int) -> None:
        """``set_checkpoint`` (``job.py:1023-1042``): where a possible banned string began."""
        cp = self.checkpoint
        if cp is None:
            self.checkpoint = {
                "offset": 1,
                "held_text": held_text_before,
                "held_tokens": self.held_tokens[:-1],
                "held_probs": self.held_probs[:-1],
                "held_k_tokens": self.held_k_tokens[:-1],
                "held_k_probs": self.held_k_probs[:-1],
                "explored_tokens": [token],
            }
        else:
            cp["offset"] += 1
            if cp["offset"] == 1:
                cp["explored_tokens"].append(token)

    def _rewind_checkpoint(self) -> None:
        """``rewind_checkpoint`` (``job.py:1044-1128``) for an attention cache: the
        ``offset`` tokens since the checkpoint leave the sequence, its pages and the
        filters; the held buffers go back to the checkpoint's, which stays (offset 0,
        buffers empty) so that a second failure bans one more token there. A rewind
        into a page that was already hashed is not modelled (1.6.5 defers hashing
        while a checkpoint holds tokens, ``job.py:828-833``)."""
        cp = self.checkpoint
        assert cp is not None
        offset = cp["offset"]
        self.new_tokens -= offset
        if self.filters:
            raise NotImplementedError("a banned-string rewind through filters is not modelled")
        for _ in range(offset):
            self.kv_position -= 1
            page = self.allocated_pages[self.kv_position // PAGE_SIZE]
            if page.content_hashed or not page.tokens:
                raise NotImplementedError("a banned-string rewind across a hashed page is not modelled")
            page.tokens.pop()
            page.kv_position -= 1
            self.sequence_ids.pop()
        self.held_text = cp["held_text"]
        self.held_tokens = list(cp["held_tokens"])
        self.held_probs = list(cp["held_probs"])
        self.held_k_tokens = list(cp["held_k_tokens"])
        self.held_k_probs = list(cp["held_k_probs"])
        cp["offset"] = 0
        cp["held_text"] = ""
        for k in ("held_tokens", "held_probs", "held_k_tokens", "held_k_probs"):
            cp[k] = []

    def prepare_for_requeue(self) -> Job:
        """``job.py:1194-1261``: the same object, re-initialised with its sequence as the prompt."""
        gen = self.generator
        assert gen is not None and self.serial_number is not None and self.max_new_tokens is not None
        last_completed = len(self.sequence_ids) - len(self.input_ids)
        rq_state = {
            "stop_strings": self.stop_strings,
            "stop_tokens": self.stop_tokens,
            "held_text": self.held_text,
            "held_tokens": self.held_tokens,
            "held_probs": self.held_probs,
            "held_k_tokens": self.held_k_tokens,
            "held_k_probs": self.held_k_probs,
            "full_completion": self.full_completion,
            "time_enqueued": self.time_enqueued,
            "time_prefill": self.time_prefill,
            "time_generate": self.time_generate,
            "rq_new_tokens": self.rq_new_tokens + self.new_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "rejected_draft_tokens": self.rejected_draft_tokens,
            "prompt_tokens": self.rq_prompt_tokens or len(self.input_ids),
            "cached": self.rq_cached or self._cached(),
            "client_prompt": self.client_prompt,
            "sam": self.sam,  # job.py:1232
        }
        serial = self.serial_number
        self.__init__(  # type: ignore[misc]
            input_ids=FakeTensor(self.sequence_ids),
            max_new_tokens=self.max_new_tokens - last_completed,
            min_new_tokens=max(self.min_new_tokens - last_completed, 0),
            sampler=self.sampler,
            decode_special_tokens=self.decode_special_tokens,
            return_top_tokens=self.return_top_tokens,
            return_probs=self.return_probs,
            filters=self.filters,
            identifier=self.identifier,
            banned_strings=self.banned_strings,  # job.py:1253
            embeddings=self.embeddings,  # job.py:1254
            max_rq_tokens=self.orig_max_rq_tokens,
            rq_state=rq_state,
        )
        self.prepare_for_queue(gen, serial, rq=True)
        return self
