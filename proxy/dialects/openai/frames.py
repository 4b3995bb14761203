"""The stream encoder chat and text completions share (``ChunkFrames``)."""

from __future__ import annotations

from typing import ClassVar

from msgspec import UNSET, UnsetType

from protocol.messages import PrefillProgress, QueueProgress
from proxy.core.dialect import Header
from proxy.core.generation import Generation
from proxy.core.progress import PromptProgress, QueuePosition
from proxy.dialects.openai.shapes import StreamChoice, StreamChunk, Timings, Usage, usage_of
from proxy.errors import ProxyError, envelope
from proxy.server import sse


class ChunkFrames:
    """The stream encoder chat and text completions share: one ``data:`` event
    per chunk (``StreamChunk``), ``prompt_progress``/``queue_progress`` on
    chunks of their own, usage per ``stream_options``, llama.cpp's ``timings``
    with ``timings_per_token``; then the usage chunk (with ``include_usage``) and
    ``data: [DONE]``; an error after the headers is one ``data: {"error": ...}``
    event and ``[DONE]``. Subclasses give the ``object`` name and the choices."""

    __slots__ = ("_continuous", "_include_usage", "_last_timings", "_object", "_timings", "gen", "header")

    ping = sse.PING
    progress_choice: ClassVar[StreamChoice]
    """Choice 0 of a progress or queue chunk (no text yet): the subclass's."""

    def __init__(
        self,
        gen: Generation,
        header: Header,
        object_: str,
        *,
        include_usage: bool,
        continuous_usage: bool,
        timings: bool,
    ) -> None:
        self.gen = gen
        self.header = header
        self._object = object_
        self._include_usage = include_usage
        self._continuous = continuous_usage
        self._timings = timings
        self._last_timings: Timings | None = None

    def timings_now(self) -> Timings:
        """Final ``timings`` once the response is done, running ones before, as
        llama.cpp's server reports them (``get_timings``: ``prompt_n`` is
        ``n_prompt_tokens_processed``, the prompt tokens processed so far, and each
        rate is over what was processed in the time so far): during prefill
        ``prompt_n`` is the latest progress' ``processed - cached``, 0 before it.
        No time goes backwards from one chunk to the next: the final numbers are
        the worker's, which can be a little lower than the running ones the
        proxy measured (they include the trip to the proxy), so each of
        ``prompt_ms`` and ``predicted_ms`` is at least the one sent before."""
        gen = self.gen
        if gen.done:
            t = Timings.final(gen.final_counts())
        else:
            c = gen.running_counts()
            last = gen.last_progress
            if gen.first_token_at is not None or last is None:
                cached = c.cached_tokens
                prompt_n = c.prompt_tokens - c.cached_tokens if gen.first_token_at is not None else 0
            else:  # prefilling: what has been processed so far
                cached, prompt_n = last.cached, max(0, last.processed - last.cached)
            t = Timings.of(cached, prompt_n, gen.prefill_seconds(), c.completion_tokens, gen.decode_seconds())
        before = self._last_timings
        if before is not None and (t.prompt_ms < before.prompt_ms or t.predicted_ms < before.predicted_ms):
            draft = None
            if isinstance(t.draft_n, int) and isinstance(t.draft_n_accepted, int):
                draft = (t.draft_n_accepted, t.draft_n - t.draft_n_accepted)
            t = Timings.of(
                t.cache_n,
                t.prompt_n,
                max(t.prompt_ms, before.prompt_ms) / 1000,
                t.predicted_n,
                max(t.predicted_ms, before.predicted_ms) / 1000,
                draft,
            )
        self._last_timings = t
        return t

    def chunk(self, choice: StreamChoice) -> StreamChunk:
        usage: Usage | UnsetType | None = UNSET
        if self._continuous:
            usage = usage_of(self.gen.running_counts(), final=False)
        elif self._include_usage:
            usage = None
        h = self.header
        chunk = StreamChunk(h.id, self._object, h.created, h.model, [choice], UNSET, usage)
        if self._timings:
            chunk.timings = self.timings_now()
        return chunk

    def queue(self, ev: QueueProgress, out: list[bytes]) -> None:
        self.gen.choices[0].first_sent = True
        chunk = self.chunk(self.progress_choice)
        chunk.queue_progress = QueuePosition.of(ev)
        out.append(sse.event(chunk))

    def progress(self, ev: PrefillProgress, out: list[bytes]) -> None:
        self.gen.choices[0].first_sent = True
        chunk = self.chunk(self.progress_choice)
        chunk.prompt_progress = PromptProgress.of(ev)
        out.append(sse.event(chunk))

    def open(self, out: list[bytes]) -> None:
        pass

    def close(self, out: list[bytes]) -> None:
        if self._include_usage:
            h = self.header
            usage = usage_of(self.gen.final_counts())
            out.append(sse.event(StreamChunk(h.id, self._object, h.created, h.model, [], usage=usage)))
        out.append(sse.DONE)

    def error(self, exc: ProxyError, out: list[bytes]) -> None:
        out.append(sse.event(envelope(exc)))
        out.append(sse.DONE)
