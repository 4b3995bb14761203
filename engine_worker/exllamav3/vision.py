"""Images for ExLlamaV3's vision models: one embedding per distinct image, kept for reuse,
computed in turns with the generator's steps.

1.6.5 turns an image into an ``MMEmbedding`` (``tokenizer/mm_embedding.py:24``) with the
vision component's ``get_image_embeddings(tokenizer, image)`` (``architecture/qwen3_vl.py:368``,
``architecture/gemma3.py:548``, ``architecture/mistral3.py:473``, ...). The embedding's
``token_list`` is what stands for the image in the prompt: the model's own start and end
tokens around ``mm_length`` ids from ``global_allocator``, which counts up from
``FIRST_MM_EMBEDDING_INDEX``
(``mm_embedding.py:4``, ``9-21``), so each new embedding gets ids no other one has. The
page table hashes those ids with the text (``generator/pagetable.py:249-256``), so the same
image embedded twice never hits the prefix cache: hence ``ImageEmbeddings`` keeps the
embeddings by the SHA-256 of the image's bytes (least recently used dropped first, bounded in
bytes), and a conversation that sends its screenshot again reuses the pages of its first
turn. TabbyAPI keeps 32 embeddings by URL (``backends/exllamav3/vision.py``); bytes are the
key here, since a data URL is the image itself and two URLs may serve one image.

Threads: the worker prepares requests on a thread of its own (``engine_worker.loop``) and
answers ``/tokenize`` on another (``engine_worker.lookups``), while the loop thread runs
``Generator.iterate()``. The vision forward pass is GPU work like a step, and the generator
may capture CUDA graphs during a step, so the two never run at the same time: both go
through one ``GpuTurns``, first come first served, which lets at most one embedding in
between two steps and never holds a step back for more than the embeddings already waiting.
Image decoding (PIL) happens outside the turn.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_worker.backend import RequestRejected
from protocol.messages import ErrorCode, ImageInput

FIRST_EMBEDDING_ID = 1_000_000_000
"""1.6.5's ``FIRST_MM_EMBEDDING_INDEX`` (``tokenizer/mm_embedding.py:4``): ids at or above it
stand for image embeddings, and mean something only inside the process that made them."""


class GpuTurns:
    """A first-come-first-served lock over the GPU: ``with turns:`` waits for the holders
    that came before and keeps the others out until the block ends."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next_ticket
            self._next_ticket += 1
            while self._serving != ticket:
                self._cond.wait()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class Vision:
    """The vision component as the backend uses it (``EngineHandle.vision``).

    - ``open(data)``: the image file's bytes as the image the model takes (a PIL image in
      the real engine), on the calling thread, no GPU. Raises for a file it cannot read.
    - ``embed(image)``: the ``MMEmbedding`` of an opened image (GPU work, called inside a
      ``GpuTurns`` turn). Its ``token_list_at(position)`` gives the ids that stand for it
      when its first one lands at prompt position ``position`` (``mm_embedding.py:111-119``).
    - ``nbytes(embedding)``: the host memory it holds, bytes (its tensors).
    """

    open: Callable[[bytes], Any]
    embed: Callable[[Any], Any]
    nbytes: Callable[[Any], int]


class ImageEmbeddings:
    """The embeddings of recent images by the SHA-256 of their bytes, at most ``max_bytes``
    of them (the least recently used dropped first; one larger than the bound is used and
    not kept). Thread-safe; ``turns`` is the lock the generator's steps take too."""

    def __init__(self, vision: Vision, turns: GpuTurns, max_bytes: int) -> None:
        self._vision = vision
        self._turns = turns
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        """Images found here instead of embedded (for tests and logs)."""
        self.embedded = 0
        """Images embedded."""

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def _lookup(self, key: bytes) -> Any | None:
        with self._lock:
            found = self._kept.get(key)
            if found is None:
                return None
            self._kept.move_to_end(key)
            self.hits += 1
            return found[0]

    def _keep(self, key: bytes, embedding: Any) -> None:
        size = max(0, int(self._vision.nbytes(embedding)))
        with self._lock:
            if key in self._kept or size > self._max_bytes:
                return
            self._kept[key] = (embedding, size)
            self._bytes += size
            while self._bytes > self._max_bytes:
                _, (_, dropped) = self._kept.popitem(last=False)
                self._bytes -= dropped

    def embedding(self, image: ImageInput) -> Any:
        """The embedding of ``image``: a kept one, or a new one (decoded here, embedded in a
        GPU turn). Raises ``RequestRejected`` naming ``image.param`` when the model cannot
        read it (``INVALID_REQUEST``), or ``OVERLOADED`` when the GPU ran out of memory."""
        key = hashlib.sha256(image.data).digest()
        found = self._lookup(key)
        if found is not None:
            return found
        try:
            opened = self._vision.open(image.data)
        except Exception as e:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"'{image.param}': the image cannot be read: {e}", image.param
            ) from e
        with self._turns:
            found = self._lookup(key)  # embedded by the other thread while this one waited
            if found is not None:
                return found
            try:
                embedding = self._vision.embed(opened)
            except Exception as e:
                # Out of memory is the server's state, not the image's fault: retryable.
                oom = "out of memory" in str(e).lower()
                raise RequestRejected(
                    ErrorCode.OVERLOADED if oom else ErrorCode.INVALID_REQUEST,
                    f"'{image.param}': the model's vision component failed on the image: "
                    f"{type(e).__name__}: {e}",
                    image.param,
                ) from e
        self.embedded += 1
        self._keep(key, embedding)
        return embedding

    def for_turns(self, turns: Sequence[Sequence[ImageInput]]) -> list[list[tuple[int, Any]]]:
        """``(offset, embedding)`` of each turn's images (``ChatMessage.images``), in order."""
        return [[(image.offset, self.embedding(image)) for image in images] for images in turns]


def distinct(embeddings: Iterable[Any]) -> list[Any]:
    """Each embedding object once, in order of first use: what ``Job(embeddings=...)``
    takes (``generator/job.py:71``); a repeated image's ids are found by id range
    (``util/rope.py:471-479``), so one entry covers every place it occurs."""
    seen: dict[int, Any] = {}
    for e in embeddings:
        seen.setdefault(id(e), e)
    return list(seen.values())
