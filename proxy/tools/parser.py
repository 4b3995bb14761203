"""Tool calls out of generated text, incrementally (``ToolCallParser``) and for a
whole output (``parse_output``); both give the same result for the same text
however it was split.

Events, in output order::

    ContentDelta(text)         content; never any part of a start marker
    ToolCallDelta              the entries of a chunk's ``delta.tool_calls``:
      {"index": i, "id": "call_...", "type": "function",
       "function": {"name": str, "arguments": ""}}        first, once per call
      {"index": i, "function": {"arguments": str}}         then the arguments

Arguments **stream as the model writes them**. A call's first delta (the header
above) goes out once its function name is complete and callable and its
arguments have opened (``{`` in the JSON formats; the function tag in the XML
ones); then each piece of the model's text that extends the arguments sends
the part of their compact JSON (``proxy.tools.jsontext``: no whitespace outside
strings) that can no longer change: string contents as they arrive, an
unfinished number, literal or escape held until it is complete (each format
decides this per state, ``CallBlock.progress``). The rule is that a delta once
sent is never taken back; the fragments of a call joined are its arguments as
the whole-output parse gives them. A call whose arguments have not opened
(its name written after them, say) comes whole once it is checked.

Malformed output is never an error. A block that never became a streamed call
(bad JSON before the arguments, an unknown function, arguments that are not an
object, a block still open when the model stopped) is content, its start marker
and text verbatim.

**A call that goes wrong** after part of it streamed (its JSON breaks, its end
tag never comes, the model stops inside it, an unknown function follows it in
the same block) is not taken back: the call ends with the arguments that had
streamed (a prefix of JSON, so an agent that parses them refuses the call
rather than run half of it), and the model's text from the first character
that did not fit the call on is content. Nothing the model wrote is lost.

**A cut call is still a call** (``finish(cut=True)``, ``parse_output(...,
cut=True)``: the output ended at ``max_tokens`` or the context's end, as
OpenAI reports it): a block still open is the call it was becoming, its
arguments as far as written, compact (``'{"city":"Par'``; ``""`` if they had
not started), the choice's ``finish_reason`` staying ``length``; a block whose
function name is not complete yet, and text held back as a possible start
marker, are dropped: format markers never reach ``content``. Whitespace next
to a valid call (before its marker, after its end, ``;`` between Llama calls) is
dropped; a partial marker, and whitespace that may turn out to precede a call,
are held back until known. An output with no valid call comes out as its exact
text.

``parallel_tool_calls: false``: calls after the first are dropped (their text too).

**Primed** (``primer``): the output continues text the server wrote into the
prompt, the opening of a named function's call (``proxy.tools.grammar.named_call_prefix``);
the parser reads ``primer`` first, as if the model had written it, without
events, so the output (the arguments and the close) completes that call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from proxy.tools.formats import BlockProgress, CallBlock, ToolCallFormat
from proxy.tools.jsontext import WHITESPACE
from proxy.tools.spec import FunctionCall, ToolCall, ToolConfig

log = logging.getLogger(__name__)


class FunctionDelta(msgspec.Struct, frozen=True, gc=False):
    """``delta.tool_calls[].function``: ``{"name"?, "arguments"?}``."""

    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One entry of a stream chunk's ``delta.tool_calls``, OpenAI's shape:
    ``{"index": int, "id"?: str, "type"?: "function", "function": FunctionDelta}``
    (``id``/``type``/``name`` only on a call's first delta)."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: FunctionDelta


class ContentDelta(msgspec.Struct, frozen=True, gc=False):
    """Text for ``delta.content``; never empty."""

    text: str


StreamEvent = ContentDelta | ToolCallDelta


class ParseEnd(msgspec.Struct, frozen=True):
    """What ``ToolCallParser.finish`` returns: the last events (held-back text,
    an unfinished block as content) and whether any tool call was emitted (the
    choice's ``finish_reason`` becomes ``tool_calls``, see ``finish_reason``)."""

    events: list[StreamEvent]
    tool_calls_made: bool


class ParsedOutput(msgspec.Struct, frozen=True):
    """A whole output: ``content`` (``None`` when calls were made and there is no
    text; ``""`` for an empty output without calls) and the calls in order."""

    content: str | None
    tool_calls: list[ToolCall]


class ToolCallParser:
    """Splits one choice's output into content and tool calls as it streams.

    ``feed`` each text delta as it arrives and send the events it returns;
    ``finish`` once the choice has finished. ``new_id`` makes call ids (default:
    the format's, ``call_`` + 24 random characters for most); inject a
    deterministic one in tests. ``config`` gives the callable functions and
    ``parallel_tool_calls``; with ``tool_choice: required`` or a named function
    the same parser reads the constrained output. ``primer``: text the output
    continues (module docstring); it must leave a call open, which the
    server's prefix always does (``ValueError`` otherwise).
    """

    def __init__(
        self,
        fmt: ToolCallFormat,
        config: ToolConfig,
        *,
        new_id: Callable[[], str] | None = None,
        primer: str = "",
    ) -> None:
        self._fmt = fmt
        self._tools = config.callable_by_name()
        self._parallel = config.parallel
        self._new_id = new_id or fmt.new_call_id
        self._buf = ""  # text received and not yet decided on
        self._ws = ""  # trailing whitespace of emitted content, held until text follows
        self._call_ws = ""  # that whitespace while a call block is open (dropped if it is a call)
        self._block: CallBlock | None = None
        self._marker = ""
        self._streams: list[_Streamed] = []  # the open block's calls that have started streaming
        self._after_call = False  # drop whitespace and separators until the next text
        self._bare_ok = fmt.bare_json  # a "{" here opens a call (nothing but whitespace so far)
        self._calls: list[ToolCall] = []
        self._count = 0  # calls given an index (streaming ones included)
        self._finished = False
        self._primed: list[StreamEvent] = []
        if primer:
            self._buf = primer
            events: list[StreamEvent] = []
            self._run(events, final=False)
            if self._block is None or any(isinstance(e, ContentDelta) for e in events):
                raise ValueError(f"the primer {primer!r} does not open a call")
            # A format whose primer already opens the arguments streams its header now:
            # it goes out with the first events of the output.
            self._primed = events

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls ended so far, with their ids, in index order."""
        return list(self._calls)

    def feed(self, text: str) -> list[StreamEvent]:
        """Events for the output so far; text that may still be a marker or
        belongs to an unfinished call is held back."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        out, self._primed = self._primed, []
        if text:
            self._buf += text
            self._run(out, final=False)
        return out

    def finish(self, *, cut: bool = False) -> ParseEnd:
        """The remaining events at the end of the output, and whether any call
        was made. ``cut``: the output was ended by a length limit
        (``finish_reason: "length"``): a call still being written is a call
        with its arguments as far as written, and text held back as a possible
        marker is dropped (see the module's docstring). Idempotent."""
        out: list[StreamEvent] = []
        if not self._finished:
            out, self._primed = self._primed, []
            self._finished = True
            if cut:
                self._cut(out)
            self._run(out, final=True)
            if self._ws:
                out.append(ContentDelta(self._ws))
                self._ws = ""
        return ParseEnd(out, bool(self._calls))

    # ---------------------------------------------------------------- internals

    def _cut(self, out: list[StreamEvent]) -> None:
        if self._block is not None:
            progress = self._stream(out)
            for k, call in enumerate(progress.calls):
                pending = call.arguments.pending if call.arguments is not None else ""
                if k < len(self._streams):
                    self._end_streamed(self._streams[k], pending, out)
                else:
                    self._emit_call(FunctionCall(call.name, ""), call.call_id, out)
            self._streams = []
            # The block is the call, or format text that is no content either.
            self._block = None
            self._call_ws = ""
        self._buf = ""

    def _run(self, out: list[StreamEvent], final: bool) -> None:
        while self._call_step(out, final) if self._block is not None else self._text_step(out, final):
            pass

    def _emit_text(self, text: str, out: list[StreamEvent]) -> None:
        if not text:
            return
        text = self._ws + text
        body = text.rstrip(WHITESPACE)
        self._ws = text[len(body) :]
        if body:
            out.append(ContentDelta(body))
            self._bare_ok = False

    def _find_start(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for m in self._fmt.markers:
            p = buf.find(m)
            if p >= 0 and (best is None or p < best[0]):
                best = (p, m)
        if self._bare_ok:
            p = len(buf) - len(buf.lstrip(WHITESPACE))
            if p < len(buf) and buf[p] == self._fmt.bare_start and (best is None or p < best[0]):
                best = (p, "")
        return best

    def _held_from(self, buf: str) -> int:
        """Where a suffix of ``buf`` that could begin a marker starts."""
        n = len(buf)
        held = n
        for m in self._fmt.markers:
            for k in range(min(len(m) - 1, n), 0, -1):
                if buf.endswith(m[:k]):
                    held = min(held, n - k)
                    break
        return held

    def _text_step(self, out: list[StreamEvent], final: bool) -> bool:
        buf = self._buf
        if self._after_call:
            skip = WHITESPACE + self._fmt.separators
            i = 0
            while i < len(buf) and buf[i] in skip:
                i += 1
            buf = self._buf = buf[i:]
            if not buf:
                return False
            self._after_call = False
        if not buf:
            return False
        start = self._find_start(buf)
        if start is not None:
            pos, marker = start
            self._emit_text(buf[:pos], out)
            self._call_ws, self._ws = self._ws, ""
            self._marker = marker
            self._block = self._fmt.open_block(marker, self._tools)
            self._buf = buf[pos + len(marker) :]
            return True
        held = len(buf) if final else self._held_from(buf)
        self._emit_text(buf[:held], out)
        self._buf = buf[held:]
        return False

    def _stream(self, out: list[StreamEvent]) -> BlockProgress:
        """Sends what is new of the open block's calls: a header for each call
        whose arguments opened, the final part of each one's arguments."""
        assert self._block is not None
        progress = self._block.progress(self._buf)
        for k, call in enumerate(progress.calls):
            if call.arguments is None:
                break
            if k == len(self._streams):
                self._streams.append(self._open_call(call.name, call.call_id, out))
            streamed = self._streams[k]
            parts = call.arguments.parts
            if len(parts) > streamed.parts_sent:
                text = "".join(parts[streamed.parts_sent :])
                streamed.parts_sent = len(parts)
                streamed.sent.append(text)
                if streamed.index is not None and text:
                    out.append(ToolCallDelta(index=streamed.index, function=FunctionDelta(arguments=text)))
        return progress

    def _call_step(self, out: list[StreamEvent], final: bool) -> bool:
        assert self._block is not None
        outcome = self._block.advance(self._buf, final)
        progress = self._stream(out)
        if outcome is None:
            return False
        self._block = None
        streams, self._streams = self._streams, []
        if outcome.calls:
            self._buf = self._buf[outcome.end :]
            for k, call in enumerate(outcome.calls):
                if k < len(streams):
                    streamed = streams[k]
                    sent = "".join(streamed.sent)
                    if call.arguments.startswith(sent):
                        self._end_streamed(streamed, call.arguments[len(sent) :], out)
                    else:  # cannot be taken back: the call keeps what it sent
                        log.warning("tool call %s: streamed arguments differ from the whole call", call.name)
                        self._end_streamed(streamed, "", out)
                else:
                    written = progress.calls[k].call_id if k < len(progress.calls) else None
                    self._emit_call(call, written, out)
            self._call_ws = ""
            self._after_call = True
            self._bare_ok = self._fmt.bare_json
        elif streams:
            # A call that went wrong after part of it streamed: it ends with what
            # it sent, and the text that did not fit it is read again as text.
            for streamed in streams:
                self._end_streamed(streamed, "", out)
            log.info("tool call %s went wrong after streaming; the rest is content", streams[-1].name)
            self._buf = self._buf[progress.valid_end :]
            self._call_ws = ""
            self._bare_ok = False
        else:
            # Not a call: the marker and its text are content, with the
            # whitespace before them that was held back.
            body, self._buf = self._buf[: outcome.end], self._buf[outcome.end :]
            self._ws, self._call_ws = self._call_ws, ""
            self._bare_ok = False
            self._emit_text(self._marker + body, out)
        return True

    def _open_call(self, name: str, written_id: str | None, out: list[StreamEvent]) -> _Streamed:
        """A call's header; its index is ``None`` when the call is dropped
        (``parallel_tool_calls: false`` after the first)."""
        if self._count and not self._parallel:
            return _Streamed(None, "", name)
        index = self._count
        self._count += 1
        call_id = written_id or self._new_id()
        out.append(ToolCallDelta(index=index, id=call_id, type="function", function=FunctionDelta(name, "")))
        return _Streamed(index, call_id, name)

    def _end_streamed(self, streamed: _Streamed, rest: str, out: list[StreamEvent]) -> None:
        if streamed.index is None:
            return
        if rest:
            streamed.sent.append(rest)
            out.append(ToolCallDelta(index=streamed.index, function=FunctionDelta(arguments=rest)))
        arguments = "".join(streamed.sent)
        self._calls.append(ToolCall(id=streamed.call_id, function=FunctionCall(streamed.name, arguments)))

    def _emit_call(self, call: FunctionCall, written_id: str | None, out: list[StreamEvent]) -> None:
        streamed = self._open_call(call.name, written_id, out)
        self._end_streamed(streamed, call.arguments, out)


@dataclass(slots=True)
class _Streamed:
    """A call whose header went out: its index (``None``: dropped), id, name,
    and the argument text sent (pieces) out of how many of its ``parts``."""

    index: int | None
    call_id: str
    name: str
    parts_sent: int = 0
    sent: list[str] = field(default_factory=list)


def parse_output(
    fmt: ToolCallFormat,
    config: ToolConfig,
    text: str,
    *,
    new_id: Callable[[], str] | None = None,
    cut: bool = False,
    primer: str = "",
) -> ParsedOutput:
    """A whole (non-stream) output as content and tool calls: the same result a
    ``ToolCallParser`` gives for that text in any split (``cut``: as its
    ``finish``'s; ``primer``: as its own)."""
    parser = ToolCallParser(fmt, config, new_id=new_id, primer=primer)
    events = parser.feed(text)
    events += parser.finish(cut=cut).events
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = parser.tool_calls
    return ParsedOutput(content if content or not calls else None, calls)


def finish_reason(engine_reason: str, tool_calls_made: bool) -> str:
    """The choice's ``finish_reason``: ``tool_calls`` when calls were made and the
    model stopped by itself; ``length`` stays ``length`` (OpenAI reports a
    truncated answer as such, calls or not)."""
    return "tool_calls" if tool_calls_made and engine_reason == "stop" else engine_reason
