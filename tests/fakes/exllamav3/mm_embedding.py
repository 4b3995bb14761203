"""The wheel's ``exllamav3/tokenizer/mm_embedding.py`` (``MMEmbedding``, ``global_allocator``)
and the fake vision component's embedding rows. No wheel module."""

from __future__ import annotations

from typing import Any

FIRST_MM_EMBEDDING_INDEX = 1_000_000_000
"""``mm_embedding.py:4``: ids from here on stand for embedding rows."""


class MMTokenAllocator:
    """``mm_embedding.py:9-21``: one counter per process, never reused."""

    def __init__(self) -> None:
        self.next_token_index = FIRST_MM_EMBEDDING_INDEX

    def allocate(self, num_tokens: int) -> int:
        idx = self.next_token_index
        self.next_token_index += num_tokens
        return idx


global_allocator = MMTokenAllocator()


class Rows:
    """Stands for the ``(mm_length, hidden)`` half-precision tensor of an embedding's rows:
    ``shape``, ``numel()`` and ``element_size()`` as ``torch.Tensor`` has them (2 bytes:
    ``torch.half``)."""

    def __init__(self, rows: int, hidden: int) -> None:
        self.shape = (rows, hidden)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> int:
        return 2


class MMEmbedding:
    """``MMEmbedding`` (``mm_embedding.py:24``) as built from a vision forward pass: ids
    allocated at construction (``mm_embedding.py:87-88``), the ``-1`` placeholders of
    ``token_string`` replaced by them (``104-109``), the alias ``<$EMB_{first_index}$>``
    (``91``), and ``token_list_at`` with the alignment rule (``111-119``)."""

    def __init__(
        self,
        embeddings: Rows,
        token_string: list[int],
        text_alias: str | None = None,
        deepstack_embeddings: list[Any] | None = None,
        grid_thw: tuple[int, int, int] | None = None,
        mrope_merge_size: int | None = None,
        align: int = 0,
        align_phase: int = 0,
        align_lead: int = 0,
    ) -> None:
        self.metadata: dict[str, Any] = {}
        self.full_length = len(token_string)
        self.mm_length = embeddings.shape[-2]
        self.first_index = global_allocator.allocate(self.mm_length)
        self.last_index = self.first_index + self.mm_length
        self.embeddings = embeddings
        self.deepstack_embeddings = deepstack_embeddings
        self.text_alias = text_alias or f"<$EMB_{self.first_index}$>"
        self.grid_thw = grid_thw
        self.mrope_merge_size = mrope_merge_size
        assert align == 0 or (
            0 <= align_phase < align and 0 <= align_lead < align and align_lead < self.full_length
        ), "MMEmbedding: align_lead / align_phase must be smaller than align"
        self.align, self.align_phase, self.align_lead = align, align_phase, align_lead
        rows = iter(range(self.first_index, self.last_index))
        self.token_list = [next(rows) if t == -1 else t for t in token_string]

    def token_list_at(self, position: int) -> list[int]:
        if not self.align:
            return self.token_list
        n_pad = (self.align_phase - position) % self.align
        assert n_pad <= self.align_lead
        return self.token_list[self.align_lead - n_pad :]
