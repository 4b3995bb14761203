"""The wheel's ``exllamav3/generator/generator.py`` (``Generator``: ``enqueue``,
``iterate``, drafting, ``close``)."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .constants import PAGE_SIZE
from .model import DOMINANT_BIAS, NonFiniteLogits, raw_probs, top_k
from .pagetable import _PageTable
from .tokenizer import VOCAB_SIZE

if TYPE_CHECKING:
    from .cache import Cache
    from .job import Job
    from .model import Model
    from .tokenizer import Tokenizer


class Generator:
    """``exllamav3.Generator`` with the exact 1.6.5 parameter list
    (``generator/generator.py:41-73``)."""

    def __init__(
        self,
        model: Model,
        cache: Cache,
        tokenizer: Tokenizer,
        max_batch_size: int = 256,
        max_chunk_size: int = 2048,
        shared_chunk_size: int | None = None,
        prefill_cooldown: int | None = 4,
        max_q_size: int = 8,
        draft_model: Model | None = None,
        draft_cache: Cache | None = None,
        num_draft_tokens: int | None = None,
        show_visualizer: bool = False,
        enable_defrag: bool = True,
        cpu_cache_size: int = 0,
        disk_cache_dir: str | None = None,
        disk_cache_size: int = 50 * 1024**3,
        disk_cache_flush_on_idle: bool = True,
        disk_cache_checkpoint_interval: int = 4096,
        disk_cache_write_interval: float = 2.0,
        recurrent_cache_size: int = 4 * 1024**3,
        recurrent_checkpoint_interval: int | None = None,
        recurrent_checkpoint_interval_pp: int = 32768,
        ngram_match_min: int = 0,
        dynamic_draft_tokens: bool = False,
        draft_confidence: float = 0.4,
        record_draft_stats: bool = False,
        ngram_corpus: str | None = None,
        hybrid_draft_tokens: int = 0,
        draft_max_rows: int = 0,
        sparse_draft_head: int = 0,
    ) -> None:
        if cpu_cache_size or disk_cache_dir or ngram_corpus or hybrid_draft_tokens or sparse_draft_head:
            raise NotImplementedError("feature not modelled by the fake")
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        cache.owner = self
        # A new generator takes the cache over with a fresh page table; the old one is
        # superseded (generator.py:242-245).
        cache.owner_serial += 1
        self.cache_owner_serial = cache.owner_serial
        cfg_vocab = model.config.vocab_size if model.config is not None else VOCAB_SIZE
        self.padded_vocab_size = (cfg_vocab + 31) // 32 * 32  # generator.py:239
        self.pagetable = _PageTable(cache.max_num_tokens // PAGE_SIZE)
        self.max_total_tokens = PAGE_SIZE * self.pagetable.max_pages
        self.draft_model = draft_model
        self.draft_cache = draft_cache
        self.mtp_draft = bool(draft_model is not None and draft_model.caps.get("mtp_draft", False))
        if draft_model:
            assert not ngram_match_min, "Cannot use both draft model and n-gram draft."
            assert draft_cache is not None, "Must supply cache for draft model"
            assert draft_cache.max_num_tokens == cache.max_num_tokens, (
                "Cache and draft cache must be same size"
            )
            self.num_draft_tokens = num_draft_tokens or int(draft_model.caps.get("default_draft_size", 4))
        elif ngram_match_min:
            self.num_draft_tokens = num_draft_tokens if num_draft_tokens is not None else 4
        else:
            self.num_draft_tokens = 0
        self.ngram_match_min = ngram_match_min
        self.max_draft_tokens = self.num_draft_tokens
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        if shared_chunk_size is None:
            shared_chunk_size = (max_chunk_size // 2 + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
        assert 0 < shared_chunk_size <= max_chunk_size and shared_chunk_size % PAGE_SIZE == 0, (
            "shared_chunk_size must be a multiple of the page size (256) and no larger than max_chunk_size"
        )
        self.shared_chunk_size = shared_chunk_size
        self.prefill_cooldown = 4 if prefill_cooldown is None else prefill_cooldown
        self.prefill_cooldown_left = 0
        self.prefill_rotation = 0
        self.job_serial = 0
        self.pending_jobs: list[Job] = []
        self.active_jobs: list[Job] = []
        # Filter masks run here, off the thread that calls iterate() (generator.py:318-320).
        self.filter_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="exllamav3-filter")
        self.closed = False
        self.fail_next_iterate: Exception | None = None
        self.iterations = 0

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def num_active_jobs(self) -> int:
        return len(self.active_jobs)

    def num_pending_jobs(self) -> int:
        return len(self.pending_jobs)

    def enqueue(self, job: Job) -> int:
        job.prepare_for_queue(self, self.job_serial)
        self.job_serial += 1
        self.pending_jobs.append(job)
        assert job.serial_number is not None
        return job.serial_number

    def cancel(self, job: Job) -> None:
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            job.deallocate_pages()
            self.active_jobs.remove(job)

    def close(self) -> None:
        """``generator.py:839-871``: releases host buffers; model and cache stay loaded for a
        replacement generator; the filter pool is shut down without waiting (``871``).
        Stricter here: a closed generator refuses ``iterate``."""
        self.closed = True
        self.filter_pool.shutdown(wait=False)

    def _reap(self, job: Job, error: Exception, results: list[dict[str, Any]]) -> None:
        job.deallocate_pages()
        if job in self.active_jobs:
            self.active_jobs.remove(job)
        # No "identifier" key here, unlike every other result.
        results.append(
            {"job": job, "serial": job.serial_number, "stage": "error", "eos": True, "error": error}
        )

    def _start_jobs(self, results: list[dict[str, Any]]) -> None:
        batch = len(self.active_jobs)
        free = self.pagetable.num_unreferenced_pages()
        if not (free and self.pending_jobs and batch < self.max_batch_size):
            return
        skipped: list[Job] = []
        for job in list(self.pending_jobs):
            if 1 + batch > self.max_batch_size or (
                job.current_new_pages_required() > self.pagetable.num_unreferenced_pages()
            ):
                skipped.append(job)
                continue
            # max_skips=None fails this comparison with TypeError in 1.6.5 too (generator.py:2196).
            if any(j.skips >= j.max_skips for j in skipped):  # type: ignore[operator]
                return
            for j in skipped:
                j.skips += 1
            self.pending_jobs.remove(job)
            self.active_jobs.append(job)
            job.activate()
            try:
                job.allocate_pages()
            except Exception as e:
                self._reap(job, e, results)
                continue
            batch += 1
            r: dict[str, Any] = {"job": job, "stage": "started", "eos": False, "serial": job.serial_number}
            if job.identifier is not None:
                r["identifier"] = job.identifier
            results.append(r)

    def iterate(self) -> list[dict[str, Any]]:
        assert self.cache.initialized, (
            "Cache tensors were never allocated. Construct the Cache BEFORE calling model.load()"
        )
        if self.cache.owner_serial != self.cache_owner_serial:
            # generator.py:741-749: a superseded generator drops its jobs and refuses to run.
            self.pending_jobs.clear()
            self.active_jobs.clear()
            raise RuntimeError(
                "This Generator no longer owns its Cache: a newer Generator was created over the same "
                "Cache. Close or discard the old Generator before creating a new one."
            )
        if self.closed:
            raise RuntimeError("iterate() on a closed Generator")
        if self.model.device_error is not None:
            raise self.model.device_error
        self.iterations += 1
        if self.fail_next_iterate is not None:
            e, self.fail_next_iterate = self.fail_next_iterate, None
            raise e
        results: list[dict[str, Any]] = []
        self._start_jobs(results)

        prefilling = [j for j in self.active_jobs if not j.is_prefill_done()]
        chunk_size = None
        deferred: list[Job] = []
        if (
            prefilling
            and len(prefilling) < len(self.active_jobs)
            and (self.shared_chunk_size < self.max_chunk_size or self.prefill_cooldown > 0)
        ):
            if self.shared_chunk_size < self.max_chunk_size:
                chunk_size = self.shared_chunk_size
            if self.prefill_cooldown_left > 0:
                self.prefill_cooldown_left -= 1
                deferred = prefilling
            else:
                self.prefill_cooldown_left = self.prefill_cooldown
                selected = prefilling[self.prefill_rotation % len(prefilling)]
                self.prefill_rotation += 1
                deferred = [j for j in prefilling if j is not selected]
        else:
            self.prefill_cooldown_left = 0
        for job in list(self.active_jobs):
            if any(job is d for d in deferred):
                continue
            try:
                job.prefill(results, chunk_size)
            except Exception as e:
                self._reap(job, e, results)

        self._decode(results)
        return results

    def _launch_filters(self, job: Job) -> None:
        """Start the masks of the job's next position: on the filter pool for filters that
        ``use_background_worker()`` (every ``LLGuidanceFilter``), inline for the others
        (``generator.py:1703-1712``, ``1743-1751`` for the first position; ``1969-1979``
        after each accepted draft token). ``Job.prepare_logit_mask`` collects them."""
        assert not job.filter_futures and not job.logit_masks
        for f in job.filters:
            if not f.is_active:
                continue
            if f.use_background_worker():
                job.filter_futures.append(self.filter_pool.submit(f.get_next_logit_mask))
                job.logit_masks.append(None)
            else:
                job.filter_futures.append(None)
                job.logit_masks.append(f.get_next_logit_mask())

    def _sample(self, job: Job) -> tuple[int, int]:
        """``(sampled token, the model's own choice)``. The script's choice stands for the
        largest raw logit (``raw_probs``). The logit mask (``Job.prepare_logit_mask``: filters,
        stop tokens before ``min_new_tokens``) is applied before the sampler stack
        (``sampler/custom.py:1247-1258``), whose first step is the logit bias
        (``generator/sampler/presets.py``, ``ComboSampler``): a bias of ``DOMINANT_BIAS`` or more
        outweighs the script's choice where the mask allows the biased token. A masked choice
        falls to the model's next preference: a space for a stop token held back by
        ``min_new_tokens``, else the allowed token with the lowest id."""
        generated = job.sequence_ids[len(job.client_prompt) :]
        choice = self.model.script(job.client_prompt, generated)
        job.prepare_logit_mask()
        allowed = job.logit_mask
        candidates = []
        bias = job.sampler.settings.get("logit_bias") or {}
        # A bias of -inf is a ban: LogitBias keeps it (sampler/custom.py:600-609) and the
        # token's probability is 0 whatever the model prefers.
        banned = {t for t, b in bias.items() if b == -math.inf}
        if bias:
            top = max(bias, key=lambda t: bias[t])
            if bias[top] >= DOMINANT_BIAS:
                candidates.append(top)
        candidates.append(choice)
        if job.new_tokens < job.min_new_tokens and choice in job.stop_tokens:
            candidates.append(0x20)
        for token in candidates:
            if (allowed is None or token in allowed) and token not in banned:
                return token, choice
        pool = allowed if allowed is not None else range(VOCAB_SIZE)
        in_vocab = sorted(t for t in pool if t < VOCAB_SIZE and t not in banned)
        # Everything masked: the sampler's argmax over -inf picks id 0.
        return (in_vocab[0] if in_vocab else 0), choice

    def _drafts(self, batch: list[Job]) -> dict[int, list[int]] | None:
        w = self.num_draft_tokens
        if self.draft_model is not None:
            drafts = {}
            for job in batch:
                generated = job.sequence_ids[len(job.client_prompt) :]
                d: list[int] = []
                for _ in range(w):
                    d.append(self.draft_model.script(job.client_prompt, generated + d))
                drafts[id(job)] = d
            return drafts
        if self.ngram_match_min:
            raw = {id(job): job.ngram_draft(w, self.ngram_match_min) for job in batch}
            n = min(len(d) for d in raw.values())
            return None if n == 0 else {k: d[:n] for k, d in raw.items()}
        return None

    def _decode(self, results: list[dict[str, Any]]) -> None:
        batch = [j for j in self.active_jobs if j.is_prefill_done()]
        if not batch:
            return
        for job in batch:
            if job.time_first_token is None:
                job.time_first_token = time.time()
        drafts = self._drafts(batch)
        for job in batch:
            self._launch_filters(job)  # "GPU workload is scheduled here"
        completed: list[Job] = []
        requeuing: list[Job] = []
        for job in batch:
            draft = drafts[id(job)] if drafts is not None else []
            width = len(draft) + 1
            for i in range(width):
                nonfinite = self.model.nonfinite
                if job.new_tokens < 1 and nonfinite is not None and nonfinite(job.client_prompt):
                    raise NonFiniteLogits(
                        f"Job {job.identifier!r} (serial {job.serial_number}) produced non-finite logits"
                    )
                token, choice = self._sample(job)
                prob = k_tokens = k_probs = None
                if job.return_probs or job.return_top_tokens > 0:
                    probs = raw_probs(choice)
                    prob = probs[token]
                    if job.return_top_tokens > 0:
                        top = top_k(probs, job.return_top_tokens)
                        k_tokens, k_probs = [t for t, _ in top], [p for _, p in top]
                eos, rq = job.receive_sample(token, results, prob, k_tokens, k_probs)
                if rq:
                    job.rejected_draft_tokens += width - 1 - i
                    requeuing.append(job)
                    break
                if eos:
                    unresolved = width - 1 - i
                    if unresolved:
                        job.rejected_draft_tokens += unresolved
                        for r in reversed(results):
                            if r.get("eos") and r["job"] is job:
                                if "rejected_draft_tokens" in r:
                                    r["rejected_draft_tokens"] = job.rejected_draft_tokens
                                break
                    completed.append(job)
                    break
                if i < width - 1:
                    if draft[i] != token:
                        job.rejected_draft_tokens += width - 1 - i
                        break
                    job.accepted_draft_tokens += 1
                    self._launch_filters(job)
        for job in completed + requeuing:
            job.deallocate_pages()
            self.active_jobs.remove(job)
        for job in requeuing:
            self.pending_jobs.insert(0, job.prepare_for_requeue())
