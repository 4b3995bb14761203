"""Per-request state: protocol events in, OpenAI chunks (or one response) out.

``ResponseState`` is fed the worker's events of one HTTP request (all its
choices) in order and returns the chunk dicts to stream; it enforces the
client-facing rules of ``shared/reference/http-contract.md`` that depend on
history rather than on one event:

- the first chunk of each chat choice carries ``delta.role = "assistant"``; empty
  ``TokenDelta`` text is never sent (no ``content: ""`` fillers);
- ``finish_reason`` is on the last chunk of each choice; the usage chunk
  (``choices: []``) comes after all of them, only with ``include_usage``;
- ``prompt_progress`` chunks only for choice 0, only when requested, never once
  generation started, never with ``processed`` going backwards, and none after
  the one with ``processed == total`` (an engine re-running prefill mid-stream,
  as ExLlamaV3 does on requeue, is not progress of the client's prompt). If the
  worker's last progress did not reach ``total`` before the first token (its
  events merged away for a slow client, or a backend omission), one with
  ``processed == total`` and the last seen ``time_ms`` is sent first, so a
  progress bar always completes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from protocol.messages import Event, Finished, PrefillProgress, RequestError, Started, TokenDelta
from proxy import chunks
from proxy.chunks import ChunkHeader
from proxy.errors import from_request_error

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Choice:
    index: int
    started: Started | None = None
    role_sent: bool = False
    generating: bool = False
    completion_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    finished: Finished | None = None


@dataclass(frozen=True, slots=True)
class StreamFlags:
    """What the client asked for: ``progress`` (stream and ``return_progress``),
    ``include_usage`` and ``continuous_usage`` (``stream_options``)."""

    progress: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


class ResponseState:
    """Assembles one response from the events of its choices.

    ``request_ids[i]`` is the engine request id of choice ``i``. Events of other
    ids are ignored. ``feed`` raises the ``ProxyError`` of a ``RequestError``
    (``proxy.errors.from_request_error``) after appending the chunks of the
    events before it.
    """

    def __init__(self, header: ChunkHeader, request_ids: list[str], flags: StreamFlags) -> None:
        self.header = header
        self.flags = flags
        self._choices = [_Choice(i) for i in range(len(request_ids))]
        self._by_id = dict(zip(request_ids, self._choices, strict=True))
        self._last_progress: PrefillProgress | None = None
        self._progress_closed = False
        self._unfinished = len(request_ids)

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return self._unfinished == 0

    @property
    def started(self) -> bool:
        """Every choice has been admitted by the worker (``Started`` seen)."""
        return all(c.started is not None for c in self._choices)

    def unfinished_ids(self) -> list[str]:
        """Engine request ids of the choices without a ``Finished`` event."""
        return [rid for rid, c in self._by_id.items() if c.finished is None]

    def feed(self, ev: Event, out: list[dict[str, Any]]) -> None:
        """Apply one event, appending the stream chunks it produces to ``out``.
        Raises ``ProxyError`` for a ``RequestError`` of one of our choices."""
        choice = self._by_id.get(ev.request_id) if ev.request_id is not None else None
        if isinstance(ev, RequestError):
            if ev.request_id is None or choice is not None:
                raise from_request_error(ev)
            return
        if choice is None or choice.finished is not None:
            log.debug("dropping event for a request that is not (or no longer) ours: %r", ev)
            return
        if isinstance(ev, TokenDelta):
            self._on_delta(choice, ev, out)
        elif isinstance(ev, PrefillProgress):
            if choice.index == 0 and self.flags.progress and not choice.generating:
                self._on_progress(ev, out)
        elif isinstance(ev, Started):
            choice.started = ev
        else:
            self._on_finished(choice, ev, out)

    def _with_usage(self, c: dict[str, Any]) -> dict[str, Any]:
        if self.flags.continuous_usage:
            c["usage"] = self.running_usage()
        elif self.flags.include_usage:
            c["usage"] = None
        return c

    def _on_progress(self, ev: PrefillProgress, out: list[dict[str, Any]]) -> None:
        last = self._last_progress
        if self._progress_closed or (last is not None and ev.processed < last.processed):
            return
        self._last_progress = ev
        self._progress_closed = ev.processed >= ev.total
        self._choices[0].role_sent = True
        out.append(self._with_usage(chunks.progress_chunk(self.header, ev)))

    def _close_progress(self, out: list[dict[str, Any]]) -> None:
        if self._progress_closed:
            return
        self._progress_closed = True
        last = self._last_progress
        started = self._choices[0].started
        if last is not None:
            final = PrefillProgress(last.request_id, last.total, last.cached, last.total, last.time_ms)
        elif started is not None:
            final = PrefillProgress(
                started.request_id, started.prompt_tokens, started.cached_tokens, started.prompt_tokens, 0
            )
        else:
            return
        self._last_progress = final
        self._choices[0].role_sent = True
        out.append(self._with_usage(chunks.progress_chunk(self.header, final)))

    def _on_delta(self, choice: _Choice, ev: TokenDelta, out: list[dict[str, Any]]) -> None:
        if not choice.generating:
            choice.generating = True
            if choice.index == 0 and self.flags.progress:
                self._close_progress(out)
        choice.completion_tokens += ev.num_tokens
        if not ev.text:
            return
        choice.texts.append(ev.text)
        if self.header.kind == "chat":
            delta: dict[str, Any] = {"content": ev.text}
            if not choice.role_sent:
                choice.role_sent = True
                delta = {"role": "assistant", "content": ev.text}
            c = chunks.chat_delta_choice(choice.index, delta)
        else:
            c = chunks.text_choice(choice.index, ev.text)
        out.append(self._with_usage(chunks.chunk(self.header, [c])))

    def _on_finished(self, choice: _Choice, ev: Finished, out: list[dict[str, Any]]) -> None:
        if choice.index == 0 and self.flags.progress:
            self._close_progress(out)
        choice.finished = ev
        choice.completion_tokens = ev.completion_tokens
        self._unfinished -= 1
        reason = str(ev.finish_reason)
        if self.header.kind == "chat":
            delta: dict[str, Any] = {}
            if not choice.role_sent:
                choice.role_sent = True
                delta = {"role": "assistant"}
            c = chunks.chat_delta_choice(choice.index, delta, reason)
        else:
            c = chunks.text_choice(choice.index, "", reason)
        out.append(self._with_usage(chunks.chunk(self.header, [c])))

    def running_usage(self) -> dict[str, Any]:
        """Usage so far: prompt from choice 0's ``Started``, completion tokens
        summed over choices (``TokenDelta.num_tokens``, then ``Finished``)."""
        started = self._choices[0].started
        prompt = started.prompt_tokens if started is not None else 0
        cached = started.cached_tokens if started is not None else 0
        return chunks.running_usage(prompt, cached, sum(c.completion_tokens for c in self._choices))

    def final_usage(self) -> dict[str, Any]:
        """Usage of the finished response (``chunks.final_usage``). Call when ``done``."""
        return chunks.final_usage(self._finished())

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: ``choices: []`` + usage."""
        c = chunks.chunk(self.header, [])
        c["usage"] = self.final_usage()
        return c

    def response(self) -> dict[str, Any]:
        """The non-stream response body. Call when ``done``."""
        return chunks.response(self.header, ["".join(c.texts) for c in self._choices], self._finished())

    def _finished(self) -> list[Finished]:
        out = [c.finished for c in self._choices]
        if any(f is None for f in out):
            raise RuntimeError("response is not finished")
        return [f for f in out if f is not None]
