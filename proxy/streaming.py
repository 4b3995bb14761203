"""Per-request state: protocol events in, typed OpenAI chunks (or one response) out.

``ResponseState`` is fed the worker's events of one HTTP request (all its
choices) in order and appends the ``proxy.responses.StreamChunk`` structs to
stream; it enforces the client-facing rules of ``docs/http-contract.md`` that
depend on history rather than on one event (the chat/text differences are in
the request's ``proxy.responses.ResponseFormat``):

- the first chunk of each chat choice carries ``delta.role = "assistant"``; empty
  ``TokenDelta`` text is never sent (no ``content: ""`` fillers);
- ``finish_reason`` is on the last chunk of each choice; the usage chunk
  (``choices: []``) comes after all of them, only with ``include_usage``;
- ``queue_progress`` chunks only for choice 0, only when requested, only while
  the request waits in the worker's queue (none once it ``Started``), with a
  position that never increases;
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
import time
from dataclasses import dataclass, field

from msgspec import UNSET, UnsetType

from protocol.messages import (
    Event,
    Finished,
    PrefillProgress,
    QueueProgress,
    RequestError,
    Started,
    TokenDelta,
    TokenLogprob,
)
from proxy import responses
from proxy.errors import from_request_error
from proxy.openai_models import ToolPlan
from proxy.responses import (
    ChunkHeader,
    Completion,
    PromptProgress,
    QueuePosition,
    ResponseChoice,
    StreamChoice,
    StreamChunk,
    Timings,
    Usage,
)
from proxy.tools import ContentDelta, StreamEvent, ToolCallParser, parse_output
from proxy.tools import finish_reason as tool_finish_reason

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Choice:
    index: int
    started: Started | None = None
    first_sent: bool = False
    generating: bool = False
    completion_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    finished: Finished | None = None
    chars: int = 0  # characters of text sent so far (text completions' text_offset)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # all of them (non-stream)
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens that added no text yet
    tools: ToolCallParser | None = None  # splits content from tool calls (requests with tools)
    prefix: str = ""  # echo: its prompt, before its text


@dataclass(frozen=True, slots=True)
class StreamFlags:
    """What the client asked for: ``progress`` (stream and ``return_progress``),
    ``include_usage`` and ``continuous_usage`` (``stream_options``),
    ``logprobs`` (the worker sends them; they go on each content chunk and into
    the response), ``timings`` (llama.cpp's ``timings_per_token``: ``timings``
    on every chunk and on the response), ``echo`` (per prompt, the text put
    before each of its choices' text: the prompt, for ``/v1/completions`` with
    ``echo``), ``per_prompt`` (choices per prompt when a ``/v1/completions``
    request has several prompts: choice ``i`` belongs to prompt
    ``i // per_prompt``; 0: one prompt),
    ``tools`` (the answer may hold tool calls: parsed out of the text in the
    plan's format and sent as ``tool_calls``)."""

    progress: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    timings: bool = False
    echo: tuple[str, ...] = ()
    tools: ToolPlan | None = None
    per_prompt: int = 0


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
        self._fmt = header.fmt
        self._object = header.fmt.chunk_object
        self._choices = [_Choice(i) for i in range(len(request_ids))]
        if flags.echo:
            group = flags.per_prompt or len(request_ids)
            for c in self._choices:
                c.prefix = flags.echo[c.index // group]
        plan = flags.tools
        if plan is not None:
            for c in self._choices:
                c.tools = ToolCallParser(plan.format, plan.config)
        self._by_id = dict(zip(request_ids, self._choices, strict=True))
        self._last_progress: PrefillProgress | None = None
        self._last_position: int | None = None
        self._progress_closed = False
        self._unfinished = len(request_ids)
        self.first_token_at: float | None = None
        """``time.monotonic()`` when the first token of any choice arrived."""
        self._final_timings: Timings | None = None

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

    def feed(self, ev: Event, out: list[StreamChunk]) -> None:
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
        elif isinstance(ev, QueueProgress):
            if choice.index == 0 and self.flags.progress and choice.started is None:
                self._on_queue(ev, out)
        else:
            self._on_finished(choice, ev, out)

    def _chunk(self, choice: StreamChoice, progress: PromptProgress | UnsetType = UNSET) -> StreamChunk:
        usage: Usage | UnsetType | None = UNSET
        if self.flags.continuous_usage:
            usage = self.running_usage()
        elif self.flags.include_usage:
            usage = None
        h = self.header
        chunk = StreamChunk(h.id, self._object, h.created, h.model, [choice], progress, usage)
        if self.flags.timings:
            chunk.timings = self._final_timings or self.running_timings()
        return chunk

    def _on_queue(self, ev: QueueProgress, out: list[StreamChunk]) -> None:
        last = self._last_position
        if last is not None and ev.position >= last:
            return
        self._last_position = ev.position
        self._choices[0].first_sent = True
        chunk = self._chunk(self._fmt.progress_choice())
        chunk.queue_progress = QueuePosition.of(ev)
        out.append(chunk)

    def _progress_chunk(self, ev: PrefillProgress) -> StreamChunk:
        self._choices[0].first_sent = True
        return self._chunk(self._fmt.progress_choice(), PromptProgress.of(ev))

    def _on_progress(self, ev: PrefillProgress, out: list[StreamChunk]) -> None:
        last = self._last_progress
        if self._progress_closed or (last is not None and ev.processed < last.processed):
            return
        self._last_progress = ev
        self._progress_closed = ev.processed >= ev.total
        out.append(self._progress_chunk(ev))

    def _close_progress(self, out: list[StreamChunk]) -> None:
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
        out.append(self._progress_chunk(final))

    def _first(self, choice: _Choice) -> bool:
        """Whether the next chunk of ``choice`` is its first (marks it sent)."""
        if choice.first_sent:
            return False
        choice.first_sent = True
        return True

    def _on_delta(self, choice: _Choice, ev: TokenDelta, out: list[StreamChunk]) -> None:
        if not choice.generating:
            choice.generating = True
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if choice.index == 0 and self.flags.progress:
                self._close_progress(out)
        choice.completion_tokens += ev.num_tokens
        entries: list[TokenLogprob] | None = None
        if self.flags.logprobs:
            held = choice.held_logprobs
            held.extend(ev.logprobs or ())
            if not ev.text:
                return
            entries = list(held)
            held.clear()
            choice.logprobs.extend(entries)
        if not ev.text:
            return
        if choice.tools is not None:
            choice.texts.append(ev.text)
            self._tool_events(choice, choice.tools.feed(ev.text), out)
            return
        text = ev.text
        offset = choice.chars
        if choice.prefix and not choice.texts:
            text = choice.prefix + text
            offset += len(choice.prefix)
        choice.texts.append(ev.text)
        choice.chars += len(text)
        c = self._fmt.content_choice(choice.index, text, self._first(choice), entries, offset)
        out.append(self._chunk(c))

    def _on_finished(self, choice: _Choice, ev: Finished, out: list[StreamChunk]) -> None:
        if choice.index == 0 and self.flags.progress:
            self._close_progress(out)
        if choice.prefix and not choice.texts:
            # Nothing was generated: the echoed prompt is the whole text.
            c = self._fmt.content_choice(choice.index, choice.prefix, self._first(choice))
            choice.chars += len(choice.prefix)
            out.append(self._chunk(c))
        reason = str(ev.finish_reason)
        if choice.tools is not None:
            end = choice.tools.finish(cut=reason == "length")
            self._tool_events(choice, end.events, out)
            reason = tool_finish_reason(reason, end.tool_calls_made)
        choice.finished = ev
        choice.completion_tokens = ev.completion_tokens
        self._unfinished -= 1
        if self._unfinished == 0 and self.flags.timings:
            self._final_timings = self.final_timings()
        # Tokens at the very end that added no text (a special token under
        # ignore_eos): their logprobs go on the finish chunk, not lost.
        tail = choice.held_logprobs or None
        if tail is not None:
            choice.logprobs.extend(tail)
            choice.held_logprobs = []
        c = self._fmt.finish_choice(choice.index, reason, self._first(choice), tail, choice.chars)
        out.append(self._chunk(c))

    def _tool_events(self, choice: _Choice, events: list[StreamEvent], out: list[StreamChunk]) -> None:
        fmt = self._fmt
        for e in events:
            if isinstance(e, ContentDelta):
                c = fmt.content_choice(choice.index, e.text, self._first(choice))
            else:
                c = fmt.tool_calls_choice(choice.index, [e], self._first(choice))
            out.append(self._chunk(c))

    def running_timings(self) -> Timings:
        """llama.cpp's ``timings`` so far: prompt counts from choice 0's
        ``Started``, prefill ms from its latest progress, generated tokens over
        all choices and the seconds since the first one arrived here."""
        started = self._choices[0].started
        prompt = started.prompt_tokens if started is not None else 0
        cached = started.cached_tokens if started is not None else 0
        last = self._last_progress
        prompt_s = last.time_ms / 1000 if last is not None else 0.0
        predicted = sum(c.completion_tokens for c in self._choices)
        first = self.first_token_at
        predicted_s = time.monotonic() - first if first is not None else 0.0
        return Timings.of(cached, prompt - cached, prompt_s, predicted, predicted_s)

    def final_timings(self) -> Timings:
        """llama.cpp's ``timings`` of the finished response, from the worker's
        counters and times (``Finished``). Call when ``done``."""
        finished = self.finished()
        first = finished[0]
        drafted = [f for f in finished if f.draft_accepted is not None or f.draft_rejected is not None]
        draft = None
        if drafted:
            draft = (sum(f.draft_accepted or 0 for f in drafted), sum(f.draft_rejected or 0 for f in drafted))
        return Timings.of(
            first.cached_tokens,
            first.prompt_tokens - first.cached_tokens,
            first.time_prefill,
            sum(f.completion_tokens for f in finished),
            max(f.time_decode for f in finished),
            draft,
        )

    def running_usage(self) -> Usage:
        """Usage so far: prompt from choice 0's ``Started``, completion tokens
        summed over choices (``TokenDelta.num_tokens``, then ``Finished``)."""
        started = self._choices[0].started
        prompt = started.prompt_tokens if started is not None else 0
        cached = started.cached_tokens if started is not None else 0
        return responses.running_usage(prompt, cached, sum(c.completion_tokens for c in self._choices))

    def final_usage(self) -> Usage:
        """Usage of the finished response (``responses.final_usage``). Call when ``done``."""
        return responses.final_usage(self.finished(), self.flags.per_prompt)

    def usage_chunk(self) -> StreamChunk:
        """The last chunk of a stream with ``include_usage``: ``choices: []`` + usage."""
        h = self.header
        return StreamChunk(h.id, self._object, h.created, h.model, [], usage=self.final_usage())

    def response(self) -> Completion:
        """The non-stream response body. Call when ``done``."""
        plan = self.flags.tools
        if plan is not None:
            return self._tool_response(plan)
        body = responses.response(
            self.header,
            [c.prefix + "".join(c.texts) for c in self._choices],
            self.finished(),
            [c.logprobs for c in self._choices] if self.flags.logprobs else None,
            self.flags.per_prompt,
        )
        if self.flags.timings:
            body.timings = self._final_timings or self.final_timings()
        return body

    def _tool_response(self, plan: ToolPlan) -> Completion:
        finished = self.finished()
        choices: list[ResponseChoice] = []
        for c, f in zip(self._choices, finished, strict=True):
            parsed = parse_output(
                plan.format, plan.config, "".join(c.texts), cut=str(f.finish_reason) == "length"
            )
            reason = tool_finish_reason(str(f.finish_reason), bool(parsed.tool_calls))
            choices.append(self._fmt.tool_response_choice(c.index, parsed.content, parsed.tool_calls, reason))
        h = self.header
        body = Completion(
            h.id, self._fmt.response_object, h.created, h.model, choices, responses.final_usage(finished)
        )
        if self.flags.timings:
            body.timings = self._final_timings or self.final_timings()
        return body

    def finished(self) -> list[Finished]:
        """The ``Finished`` event of every choice, in choice order. Call when ``done``."""
        out = [c.finished for c in self._choices]
        if any(f is None for f in out):
            raise RuntimeError("response is not finished")
        return [f for f in out if f is not None]
