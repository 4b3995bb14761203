"""The synthetic engine: real loop, real sockets, no model.

- A prompt's tokens are its whitespace-separated words (``prompt_words``): for
  chat, ``"role: content"`` per message, then ``"assistant:"`` when a generation
  prompt is asked for.
- Output token ``k`` of every choice is word ``k`` of the prompt, cycling, followed
  by a space (``expected_text``): deterministic, so a load test can check each
  stream's whole text, and a stream that got another's tokens shows it.
- Steps come every ``synthetic_step_ms``: a step prefills ``chunk_size`` prompt
  tokens of each prefilling sequence (one ``PrefillProgress`` each) or emits
  ``synthetic_tokens_per_step`` tokens of each decoding one. A sequence ends with
  ``finish_reason: "length"`` at ``max_tokens``. No drafting.
- Images (``--synthetic-image-tokens N`` above 0; else the engine reads text
  only): each image of a turn is ``N`` tokens, ``<image:<digest>:<k>>`` for ``k``
  in ``0..N-1``, where ``<digest>`` is the first 16 hex digits of the SHA-256 of
  its bytes, placed at its ``offset`` in the turn's text (``image_words``). The
  same image is the same tokens, as an embedding cache keyed by the bytes' hash
  makes it on a vision model.
- Prefix cache (``--synthetic-prefix-cache``; else ``cached_tokens`` is 0): a
  prompt's longest common prefix with one of the last ``PREFIX_CACHE_PROMPTS``
  prompts prefilled under the same ``cache_salt``, at most all of its tokens but
  the last (one is always computed, as every engine does), counts as cached and
  is skipped by the prefill.
- Sampling parameters other than ``max_tokens`` do not change the output: this
  engine exists to exercise everything around a model, not sampling.
- Stamps, for latency measurements: when one of the prompt's words is
  ``STAMP_WORD``, every output token is written ``word@<us> `` instead of
  ``word ``, where ``<us>`` is ``time.monotonic()`` in whole microseconds when
  the step that emitted it began. Every process of the host reads that clock
  (``CLOCK_MONOTONIC``), so a client can tell each token's latency from the
  engine step to its own arrival, through any proxy that passes the text on
  (``benchmarks/proxy_load.py``). ``strip_stamps`` gives back ``expected_text``.
"""

from __future__ import annotations

import hashlib
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from engine_worker.admission import full_reservation
from engine_worker.backend import ModelInfo, Prepared
from engine_worker.requests.events import opening
from engine_worker.settings import WorkerSettings
from protocol.messages import (
    ChatMessage,
    Event,
    Finished,
    FinishReason,
    ImageInput,
    PrefillProgress,
    SamplingParams,
    Submit,
    TokenDelta,
)

STAMP_WORD = "@stamp"
"""A prompt word that asks for stamped output tokens (module docstring)."""

STAMP = re.compile(r"@([0-9]+) ")
"""One token's stamp in stamped output; group 1 is the step's microseconds."""


SYNTHETIC_VOCAB = 50_000
"""Size of the id space ``prompt_ids`` maps words into."""

PREFIX_CACHE_PROMPTS = 64
"""Prompts the synthetic prefix cache keeps (module docstring), the oldest dropped first."""


def strip_stamps(text: str) -> str:
    """Stamped output text without its stamps: ``expected_text`` again (for
    prompts none of whose words ends in ``@`` and digits)."""
    return STAMP.sub(" ", text)


def image_words(image: ImageInput, count: int) -> list[str]:
    """The ``count`` tokens of ``image`` (module docstring)."""
    digest = hashlib.sha256(image.data).hexdigest()[:16]
    return [f"<image:{digest}:{k}>" for k in range(count)]


def _turn_words(m: ChatMessage, image_tokens: int) -> list[str]:
    words = [f"{m.role}:"]
    at = 0
    for image in m.images:
        words += m.content[at : image.offset].split()
        words += image_words(image, image_tokens)
        at = image.offset
    return words + m.content[at:].split()


def prompt_words(submit: Submit, image_tokens: int = 0) -> list[str]:
    """The prompt's tokens as this engine counts them (see the module docstring),
    each image ``image_tokens`` of them."""
    if submit.prompt is not None:
        return submit.prompt.split()
    words: list[str] = []
    for m in submit.messages:
        words += _turn_words(m, image_tokens)
    if submit.add_generation_prompt:
        words.append("assistant:")
    for piece in submit.forced_prefix:  # a named tool call's opening, after the template
        words += piece.text.split()
    return words


def expected_text(words: list[str], completion_tokens: int) -> str:
    """The text of ``completion_tokens`` output tokens for a prompt of ``words``."""
    return "".join(words[k % len(words)] + " " for k in range(completion_tokens))


@dataclass(slots=True)
class _Sequence:
    request_id: str
    words: list[str]
    max_tokens: int
    reservation: int
    t_added: float
    processed: int = 0
    generated: int = 0
    t_start: float = 0.0
    t_prefill_end: float = 0.0
    started: bool = False
    stamped: bool = False
    salt: str | None = None
    cached: int = 0


def _common_prefix(a: tuple[str, ...], b: list[str]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


class SyntheticBackend:
    """``engine_worker.backend.Backend`` without a model (see the module docstring)."""

    def __init__(self, settings: WorkerSettings) -> None:
        assert settings.max_seq_len and settings.chunk_size and settings.max_batch_size
        self._chunk = settings.chunk_size
        self._tokens_per_step = settings.synthetic_tokens_per_step
        self._step_s = settings.synthetic_step_ms / 1000
        self._next_step = 0.0
        self._info = ModelInfo(
            model_id="synthetic",
            max_context_tokens=settings.max_seq_len,
            drafting=None,
            kv_cache_tokens=settings.synthetic_kv_tokens,
            max_batch_size=settings.max_batch_size,
            longest_token_chars=0,  # words have no longest length
            cache_salt=True,  # the prefix cache is kept per salt
            vision=settings.synthetic_image_tokens > 0,
        )
        self._image_tokens = settings.synthetic_image_tokens
        self._prefix_cache = settings.synthetic_prefix_cache
        self._prefilled: OrderedDict[tuple[str | None, tuple[str, ...]], None] = OrderedDict()
        self._seqs: dict[str, _Sequence] = {}

    @property
    def info(self) -> ModelInfo:
        return self._info

    def prepare(self, submit: Submit) -> Prepared:
        param = "prompt" if submit.prompt is not None else "messages"
        words = prompt_words(submit, self._image_tokens)
        return Prepared(submit, words, len(words), param)

    def prompt_ids(self, prepared: Prepared) -> list[int]:
        """A word's id is a checksum of it (this engine has no vocabulary)."""
        words: list[str] = prepared.prompt
        return [zlib.crc32(w.encode()) % SYNTHETIC_VOCAB for w in words]

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """``t<id>`` per id, space-separated (ids cannot be turned back into words; none
        is special)."""
        return " ".join(f"t{t}" for t in token_ids)

    def text_prefix_ids(self) -> list[int]:
        """No BOS: this engine has no vocabulary."""
        return []

    def reservation(self, prepared: Prepared) -> int:
        return full_reservation(prepared)

    def kv_reserved(self) -> int:
        return sum(s.reservation for s in self._seqs.values())

    def start(self, request_id: str, prepared: Prepared, params: SamplingParams) -> None:
        words = prepared.prompt
        self._seqs[request_id] = _Sequence(
            request_id,
            words,
            prepared.max_new_tokens,
            self.reservation(prepared),
            time.monotonic(),
            stamped=STAMP_WORD in words,
            salt=prepared.submit.cache_salt,
        )
        if self._prefix_cache:
            seq = self._seqs[request_id]
            hits = (_common_prefix(p, words) for salt, p in self._prefilled if salt == seq.salt)
            seq.cached = seq.processed = max(0, min(max(hits, default=0), len(words) - 1))

    def _remember(self, seq: _Sequence) -> None:
        key = (seq.salt, tuple(seq.words))
        self._prefilled[key] = None
        self._prefilled.move_to_end(key)
        if len(self._prefilled) > PREFIX_CACHE_PROMPTS:
            self._prefilled.popitem(last=False)

    def abort(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)

    def active_ids(self) -> Collection[str]:
        return self._seqs.keys()

    def step(self) -> list[Event]:
        now = time.monotonic()
        if now < self._next_step:
            time.sleep(self._next_step - now)
            now = time.monotonic()
        self._next_step = now + self._step_s
        stamp: str | None = None  # made once per step, for the stamped sequences
        events: list[Event] = []
        for seq in list(self._seqs.values()):
            total = len(seq.words)
            if not seq.started:
                seq.started, seq.t_start = True, now
                events += opening(seq.request_id, total, seq.cached, 0)
            elif seq.processed < total:
                seq.processed = min(total, seq.processed + self._chunk)
                ms = int((now - seq.t_start) * 1000)
                events.append(PrefillProgress(seq.request_id, total, seq.cached, seq.processed, ms))
                if seq.processed == total:
                    seq.t_prefill_end = now
                    if self._prefix_cache:
                        self._remember(seq)
            else:
                k = seq.generated
                n = min(self._tokens_per_step, seq.max_tokens - k)
                end = " "
                if seq.stamped:
                    if stamp is None:
                        stamp = f"@{int(now * 1_000_000)} "
                    end = stamp
                text = "".join(seq.words[(k + i) % total] + end for i in range(n))
                seq.generated += n
                events.append(TokenDelta(seq.request_id, text, n))
                if seq.generated >= seq.max_tokens:
                    del self._seqs[seq.request_id]
                    events.append(
                        Finished(
                            seq.request_id,
                            FinishReason.LENGTH,
                            total,
                            seq.cached,
                            seq.generated,
                            time_queued=seq.t_start - seq.t_added,
                            time_prefill=seq.t_prefill_end - seq.t_start,
                            time_decode=now - seq.t_prefill_end,
                        )
                    )
        return events

    def close(self) -> None:
        self._seqs.clear()
