"""The sizes of an ExLlamaV3 start that depend on the model: each is the option where
the operator gave one, else a default from what the loader read of the model
(``loader.load_engine`` passes those facts in, so settings never read a model)."""

from __future__ import annotations

from engine_worker.options.exllamav3 import (
    EXLLAMAV3_DRAFT_TOKENS,
    EXLLAMAV3_MAX_BATCH_SIZE,
    EXLLAMAV3_MAX_BATCH_SIZE_RECURRENT,
    EXLLAMAV3_MAX_SEQ_LEN,
    PAGE_SIZE,
)
from engine_worker.settings import DraftMode, WorkerSettings


def max_seq_len(s: WorkerSettings, max_position_embeddings: int) -> int:
    """The context: ``max_seq_len``; else the model's ``max_position_embeddings`` capped
    by ``cache_size``; else ``EXLLAMAV3_MAX_SEQ_LEN`` (``max_position_embeddings`` 0:
    unknown)."""
    if s.max_seq_len:
        return s.max_seq_len
    if s.cache_size:
        return min(max_position_embeddings, s.cache_size) if max_position_embeddings else s.cache_size
    return max_position_embeddings or EXLLAMAV3_MAX_SEQ_LEN


def max_batch_size(s: WorkerSettings, recurrent: bool) -> int:
    """``max_batch_size``, else the default for a model with or without recurrent layers."""
    if s.max_batch_size is not None:
        return s.max_batch_size
    return EXLLAMAV3_MAX_BATCH_SIZE_RECURRENT if recurrent else EXLLAMAV3_MAX_BATCH_SIZE


def draft_tokens(s: WorkerSettings, drafter_default: int | None) -> int:
    """The draft window, tokens: ``num_draft_tokens``; else, with a draft model or MTP
    head, its ``default_draft_size`` (``drafter_default``, ``None`` when its caps have
    none); else ``EXLLAMAV3_DRAFT_TOKENS`` when drafting; 0 without drafting."""
    if s.draft_mode is DraftMode.NONE:
        return 0
    if s.num_draft_tokens is not None:
        return s.num_draft_tokens
    if s.draft_mode in (DraftMode.DRAFT_MODEL, DraftMode.MTP) and drafter_default is not None:
        return drafter_default
    return EXLLAMAV3_DRAFT_TOKENS


def cache_size(s: WorkerSettings, max_seq_len: int, draft_tokens: int) -> int:
    """``cache_size``, else room for one sequence of ``max_seq_len`` plus the token being
    sampled and the draft window, in whole pages (``PAGE_SIZE`` tokens)."""
    if s.cache_size:
        return s.cache_size
    return -(-(max_seq_len + 1 + draft_tokens) // PAGE_SIZE) * PAGE_SIZE
