"""One response's state, fed by the worker's events, before any dialect names it.

``Generation`` is fed the worker's events of one HTTP request (all its choices)
in order. It keeps what every dialect needs (each choice's text, tool calls,
logprobs, finish, the counts) and enforces the rules of ``docs/http-contract.md``
that depend on history rather than on one event; for a stream it calls the
request's dialect encoder (``Frames``) with what is new:

- ``queue``: only for choice 0, only when progress was asked for, only while
  the request waits in the worker's queue (none once it ``Started``), with a
  position that never increases;
- ``progress``: only for choice 0, only when asked for, never once generation
  started, never with ``processed`` going backwards, and none after the one
  with ``processed == total`` (an engine re-running prefill mid-stream, as
  ExLlamaV3 does on requeue, is not progress of the client's prompt). If the
  worker's last progress did not reach ``total`` before the first token (its
  events merged away for a slow client, or a backend omission), one with
  ``processed == total`` and the last seen ``time_ms`` is sent first, so a
  progress bar always completes;
- ``text``: generated text, never empty; with tools, the text outside calls
  (``proxy.tools.ToolCallParser``: marker text never is content);
- ``reasoning`` (``ReasoningFrames``): a reasoning model's thinking, never empty,
  kept apart from the text (the worker's ``Channel.REASONING`` deltas); tools and
  logprobs are the answer's. A dialect without it shows the answer only;
- ``tool_call``: one ``ToolCallDelta`` of a call the parser recognised;
- ``finish``: a choice's end, with its finish reason (``tool_calls`` when it
  called a tool);
- ``close`` once every choice finished.

A non-stream response has no ``Frames``: the events only accumulate, and the
dialect builds its body from ``results()`` and ``final_counts()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from protocol.messages import (
    Channel,
    Event,
    Finished,
    PrefillProgress,
    QueueProgress,
    RequestError,
    Started,
    TokenDelta,
    TokenLogprob,
)
from proxy.core.task import ToolPlan
from proxy.core.usage import Counts, final_counts
from proxy.errors import SAME_NAMES, FieldNames, ProxyError, from_request_error
from proxy.tools import ContentDelta, StreamEvent, ToolCall, ToolCallDelta, ToolCallParser, parse_output
from proxy.tools import finish_reason as tool_finish_reason

log = logging.getLogger(__name__)

Logprobs = Sequence[TokenLogprob] | None
"""A chunk's or a choice's generated tokens with their log-probabilities, or
``None`` when the request did not ask for them."""


@dataclass(slots=True)
class Choice:
    """One choice's state. ``first_sent`` is the dialect's: whether it sent
    anything for this choice yet (a chat delta then carries ``role``)."""

    index: int
    started: Started | None = None
    first_sent: bool = False
    generating: bool = False
    completion_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    finished: Finished | None = None
    chars: int = 0  # characters of text sent so far (text completions' text_offset)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # all of them
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens that added no text yet
    tools: ToolCallParser | None = None  # splits content from tool calls (streams with tools)
    prefix: str = ""  # echo: its prompt, before its text
    finish_reason: str | None = None  # as the client sees it (``tool_calls`` when it called)
    reasoning: list[str] = field(default_factory=list)  # the thinking, kept apart from texts
    thinking: bool = False  # its latest delta was thinking (the request's stage)
    reasoning_tokens: int = 0  # thinking tokens so far (the deltas' counts, then Finished's)


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """A finished choice as a non-stream body shows it: ``text`` (echoed prompt
    included), ``content`` (the text outside tool calls, ``None`` when the answer
    is only calls) and ``tool_calls`` when the request had tools, its
    ``finish_reason`` and ``logprobs`` (when asked for)."""

    index: int
    text: str
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    reasoning: str | None = None
    """The thinking (``None``: the model did not think)."""


class Frames(Protocol):
    """A dialect's stream encoder for one request: each method appends whole
    SSE events (bytes) to ``out``. ``Generation`` calls the first five in
    event order; ``proxy.serving.delivery`` calls ``open`` when the headers go out,
    ``close`` when the response is done, ``error`` when it fails after the
    headers, and writes ``ping`` after a silence."""

    @property
    def ping(self) -> bytes:
        """A keep-alive event (an SSE comment, or the dialect's own ping)."""
        ...

    def queue(self, ev: QueueProgress, out: list[bytes]) -> None: ...

    def progress(self, ev: PrefillProgress, out: list[bytes]) -> None: ...

    def text(self, choice: Choice, text: str, logprobs: Logprobs, offset: int, out: list[bytes]) -> None:
        """Generated ``text`` (never empty), with the logprobs of its tokens when
        asked for; ``offset``: characters of the choice's text before it."""
        ...

    def finish(self, choice: Choice, reason: str, logprobs: Logprobs, out: list[bytes]) -> None:
        """``choice`` ended with ``reason``; ``logprobs`` of its last tokens that
        added no text, if any."""
        ...

    def open(self, out: list[bytes]) -> None:
        """The stream's first events, if the dialect has any (called once the
        headers are out; a dialect also opens by itself before its first event)."""
        ...

    def close(self, out: list[bytes]) -> None:
        """The events after every choice finished, terminator included."""
        ...

    def error(self, exc: ProxyError, out: list[bytes]) -> None:
        """The response failed after the headers: its error event(s) and terminator."""
        ...


@runtime_checkable
class ToolFrames(Frames, Protocol):
    """A stream encoder for dialects whose answers may hold tool calls."""

    def tool_call(self, choice: Choice, delta: ToolCallDelta, out: list[bytes]) -> None:
        """One ``ToolCallDelta`` of a call the parser recognised in ``choice``."""
        ...


@runtime_checkable
class ReasoningFrames(Frames, Protocol):
    """A stream encoder for dialects that show a reasoning model's thinking."""

    def reasoning(self, choice: Choice, text: str, out: list[bytes]) -> None:
        """Thinking text of ``choice`` (never empty)."""
        ...


@dataclass(frozen=True, slots=True)
class Options:
    """What the request asked of the core: ``progress`` (stream and
    ``return_progress``), ``logprobs`` (the worker sends them), ``echo`` (per
    prompt, the text put before each of its choices' text), ``per_prompt``
    (choices per prompt when a request has several prompts: choice ``i``
    belongs to prompt ``i // per_prompt``; 0: one prompt), ``tools`` (the
    answer may hold tool calls, parsed in the plan's format), ``fields`` (the
    dialect's names for the fields a worker error names). ``progress`` and
    ``fields`` are set by the core (``proxy.serving.serve``), never by a dialect."""

    progress: bool = False
    logprobs: bool = False
    echo: tuple[str, ...] = ()
    tools: ToolPlan | None = None
    per_prompt: int = 0
    fields: FieldNames = SAME_NAMES
    reasoning_field: str = "reasoning_content"
    """Chat completions' name for the thinking (``reasoning_content``, ``reasoning`` or
    ``both``)."""


class Generation:
    """Assembles one response from the events of its choices.

    ``request_ids[i]`` is the engine request id of choice ``i``. Events of other
    ids are ignored. ``feed`` raises the ``ProxyError`` of a ``RequestError``
    (``proxy.errors.from_request_error``) after handling the events before it.
    ``frames`` is the dialect's stream encoder, ``None`` for a non-stream
    response (set it before the first ``feed``).
    """

    def __init__(self, request_ids: list[str], options: Options) -> None:
        self.options = options
        self.frames: Frames | None = None
        self._tool_frames: ToolFrames | None = None
        self._reasoning_frames: ReasoningFrames | None = None
        self.choices = [Choice(i) for i in range(len(request_ids))]
        if options.echo:
            group = options.per_prompt or len(request_ids)
            for c in self.choices:
                c.prefix = options.echo[c.index // group]
        self._by_id = dict(zip(request_ids, self.choices, strict=True))
        self.last_progress: PrefillProgress | None = None
        self._last_position: int | None = None
        self._progress_closed = False
        self._unfinished = len(request_ids)
        self.first_token_at: float | None = None
        """``time.monotonic()`` when the first token of any choice arrived."""
        self.queue: QueueProgress | None = None
        """The latest ``QueueProgress`` of choice 0 before it started, asked for or not
        (``proxy.ops.inflight``'s view; frames follow the rules above)."""
        self.prefill: PrefillProgress | None = None
        """The latest ``PrefillProgress`` of choice 0 before its first token, asked for or not."""
        self._counts: Counts | None = None

    def stream_to(self, frames: Frames) -> None:
        """Encode with ``frames`` (a stream); with tools, parse calls as they
        come (``frames`` must then be ``ToolFrames``: raises ``TypeError``)."""
        self.frames = frames
        if isinstance(frames, ReasoningFrames):
            self._reasoning_frames = frames
        plan = self.options.tools
        if plan is not None:
            if not isinstance(frames, ToolFrames):
                raise TypeError(f"{type(frames).__name__} cannot stream tool calls")
            self._tool_frames = frames
            for c in self.choices:
                c.tools = ToolCallParser(plan.format, plan.config, primer=plan.primer)

    @property
    def done(self) -> bool:
        """Every choice has finished."""
        return self._unfinished == 0

    @property
    def started(self) -> bool:
        """Every choice has been admitted by the worker (``Started`` seen)."""
        return all(c.started is not None for c in self.choices)

    def unfinished_ids(self) -> list[str]:
        """Engine request ids of the choices without a ``Finished`` event."""
        return [rid for rid, c in self._by_id.items() if c.finished is None]

    def feed(self, ev: Event, out: list[bytes]) -> None:
        """Apply one event, appending the SSE events it produces to ``out``.
        Raises ``ProxyError`` for a ``RequestError`` of one of our choices."""
        choice = self._by_id.get(ev.request_id) if ev.request_id is not None else None
        if isinstance(ev, RequestError):
            if ev.request_id is None or choice is not None:
                raise self.options.fields.rename(from_request_error(ev))
            return
        if choice is None or choice.finished is not None:
            log.debug("dropping event for a request that is not (or no longer) ours: %r", ev)
            return
        if isinstance(ev, TokenDelta):
            self._on_delta(choice, ev, out)
        elif isinstance(ev, PrefillProgress):
            if choice.index == 0 and not choice.generating:
                self.prefill = ev
                if self.options.progress:
                    self._on_progress(ev, out)
        elif isinstance(ev, Started):
            choice.started = ev
        elif isinstance(ev, QueueProgress):
            if choice.index == 0 and choice.started is None:
                self._on_queue(ev, out)
        elif isinstance(ev, Finished):
            self._on_finished(choice, ev, out)

    def _on_queue(self, ev: QueueProgress, out: list[bytes]) -> None:
        self.queue = ev
        if not self.options.progress:
            return
        last = self._last_position
        if last is not None and ev.position >= last:
            return
        self._last_position = ev.position
        if self.frames is not None:
            self.frames.queue(ev, out)

    def _on_progress(self, ev: PrefillProgress, out: list[bytes]) -> None:
        last = self.last_progress
        if self._progress_closed or (last is not None and ev.processed < last.processed):
            return
        self.last_progress = ev
        self._progress_closed = ev.processed >= ev.total
        if self.frames is not None:
            self.frames.progress(ev, out)

    def _close_progress(self, out: list[bytes]) -> None:
        if self._progress_closed:
            return
        self._progress_closed = True
        last = self.last_progress
        started = self.choices[0].started
        if last is not None:
            final = PrefillProgress(last.request_id, last.total, last.cached, last.total, last.time_ms)
        elif started is not None:
            final = PrefillProgress(
                started.request_id, started.prompt_tokens, started.cached_tokens, started.prompt_tokens, 0
            )
        else:
            return
        self.last_progress = final
        if self.frames is not None:
            self.frames.progress(final, out)

    def _on_delta(self, choice: Choice, ev: TokenDelta, out: list[bytes]) -> None:
        if not choice.generating:
            choice.generating = True
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            if choice.index == 0 and self.options.progress:
                self._close_progress(out)
        choice.completion_tokens += ev.num_tokens
        choice.thinking = ev.channel is Channel.REASONING
        if choice.thinking:
            choice.reasoning_tokens += ev.num_tokens
            if ev.text:
                choice.reasoning.append(ev.text)
                if self._reasoning_frames is not None:
                    self._reasoning_frames.reasoning(choice, ev.text, out)
            return
        entries: list[TokenLogprob] | None = None
        if self.options.logprobs:
            held = choice.held_logprobs
            held.extend(ev.logprobs or ())
            if not ev.text:
                return
            entries = list(held)
            held.clear()
            choice.logprobs.extend(entries)
        if not ev.text:
            return
        frames = self.frames
        if frames is None:
            choice.texts.append(ev.text)
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
        frames.text(choice, text, entries, offset, out)

    def _on_finished(self, choice: Choice, ev: Finished, out: list[bytes]) -> None:
        frames = self.frames
        if choice.index == 0 and self.options.progress:
            self._close_progress(out)
        if frames is not None and choice.prefix and not choice.texts:
            # Nothing was generated: the echoed prompt is the whole text.
            frames.text(choice, choice.prefix, None, choice.chars, out)
            choice.chars += len(choice.prefix)
        reason = str(ev.finish_reason)
        if choice.tools is not None:
            end = choice.tools.finish(cut=reason == "length")
            self._tool_events(choice, end.events, out)
            reason = tool_finish_reason(reason, end.tool_calls_made)
        choice.finished = ev
        choice.thinking = False
        choice.reasoning_tokens = ev.reasoning_tokens
        choice.finish_reason = reason
        choice.completion_tokens = ev.completion_tokens
        self._unfinished -= 1
        if self._unfinished == 0:
            self._counts = final_counts(self.finished(), self.options.per_prompt)
        # Tokens at the very end that added no text (a special token under
        # ignore_eos): their logprobs go on the finish event, not lost.
        tail = choice.held_logprobs or None
        if tail is not None:
            choice.logprobs.extend(tail)
            choice.held_logprobs = []
        if frames is not None:
            frames.finish(choice, reason, tail, out)

    def _tool_events(self, choice: Choice, events: list[StreamEvent], out: list[bytes]) -> None:
        frames = self._tool_frames
        assert frames is not None
        for e in events:
            if isinstance(e, ContentDelta):
                frames.text(choice, e.text, None, 0, out)
            else:
                frames.tool_call(choice, e, out)

    # ------------------------------------------------------------ accounting

    def running_counts(self) -> Counts:
        """Counts so far: prompt from choice 0's ``Started``, completion tokens
        summed over choices (``TokenDelta.num_tokens``, then ``Finished``)."""
        if self._counts is not None:
            return self._counts
        started = self.choices[0].started
        return Counts(
            started.prompt_tokens if started is not None else 0,
            started.cached_tokens if started is not None else 0,
            sum(c.completion_tokens for c in self.choices),
        )

    def final_counts(self) -> Counts:
        """Counts of the finished response (``proxy.core.usage.final_counts``). Call when ``done``."""
        if self._counts is None:
            raise RuntimeError("response is not finished")
        return self._counts

    def prefill_seconds(self) -> float:
        """Seconds of prefill so far (the latest progress' ``time_ms``)."""
        last = self.last_progress
        return last.time_ms / 1000 if last is not None else 0.0

    def decode_seconds(self) -> float:
        """Seconds since the first token arrived here (0 before it)."""
        first = self.first_token_at
        return time.monotonic() - first if first is not None else 0.0

    def finished(self) -> list[Finished]:
        """The ``Finished`` event of every choice, in choice order. Call when ``done``."""
        out = [c.finished for c in self.choices]
        if any(f is None for f in out):
            raise RuntimeError("response is not finished")
        return [f for f in out if f is not None]

    def results(self) -> list[ChoiceResult]:
        """Every choice as a non-stream body shows it. Call when ``done``."""
        plan = self.options.tools
        logprobs = self.options.logprobs
        out: list[ChoiceResult] = []
        for c, f in zip(self.choices, self.finished(), strict=True):
            text = "".join(c.texts)
            reason = str(f.finish_reason)
            content: str | None = c.prefix + text
            calls: list[ToolCall] = []
            if plan is not None:
                parsed = parse_output(
                    plan.format, plan.config, text, cut=reason == "length", primer=plan.primer
                )
                content, calls = parsed.content, parsed.tool_calls
                reason = tool_finish_reason(reason, bool(calls))
            out.append(
                ChoiceResult(
                    c.index,
                    c.prefix + text,
                    content,
                    calls,
                    reason,
                    c.logprobs if logprobs else None,
                    "".join(c.reasoning) if c.reasoning else None,
                )
            )
        return out
