"""``/v1/responses`` output: the Responses API's stream events and its ``response`` body.

Stream (each event ``event: <type>`` + ``data: {"type": <type>,
"sequence_number": n, ...}``, ``n`` counting from 0)::

    response.created, response.in_progress          # the response, status in_progress
    [response.queue_progress, response.prompt_progress ...]   # with return_progress
    response.output_item.added                      # a reasoning item (a model that thinks)
    response.content_part.added                     # its reasoning_text part
    response.reasoning_text.delta ...               # the thinking
    response.reasoning_text.done, response.content_part.done, response.output_item.done
    response.output_item.added                      # a message item
    response.content_part.added                     # its output_text part
    response.output_text.delta ...                  # the text (logprobs when asked)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.output_item.added                      # a function_call item
    response.function_call_arguments.delta ...
    response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete        # the whole response with its usage

``response.incomplete`` (``incomplete_details.reason: "max_output_tokens"``)
when the output limit cut the answer; a failure after the headers is one
``response.failed`` with ``error: {"code", "message"}``. Shapes:
``proxy.dialects.responses.shapes``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from msgspec import UNSET

from protocol.messages import PrefillProgress, QueueProgress, TokenLogprob
from proxy.core.dialect import Header
from proxy.core.generation import Choice, Generation, Logprobs
from proxy.core.progress import PromptProgress, QueuePosition
from proxy.dialects.openai.shapes import TokenLogprobOut
from proxy.dialects.responses.shapes import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    FunctionCallItem,
    IncompleteDetails,
    ItemEvent,
    ItemStatus,
    LifecycleEvent,
    MessageItem,
    OutputItem,
    OutputText,
    PartEvent,
    PromptProgressEvent,
    QueueProgressEvent,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    Response,
    ResponseError,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from proxy.errors import ProxyError
from proxy.server import sse
from proxy.server.bodies import encode
from proxy.tools import ToolCallDelta

Snapshot = Callable[..., Response]
"""Builds the ``response`` object with the request's echoed parameters:
``snapshot(status=, output=, usage=, error=, incomplete_details=)``."""


def new_item_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _logprobs(entries: Sequence[TokenLogprob] | None) -> list[TokenLogprobOut]:
    return [TokenLogprobOut.of(lp) for lp in entries] if entries else []


class _Message:
    __slots__ = ("id", "index", "logprobs", "texts")

    def __init__(self, index: int, prefix: str = "msg_") -> None:
        self.id = new_item_id(prefix)
        self.index = index
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprobOut] = []


class _Call:
    __slots__ = ("arguments", "call_id", "id", "index", "name", "tool_index")

    def __init__(self, index: int, tool_index: int, call_id: str, name: str) -> None:
        self.id = new_item_id("fc_")
        self.index = index
        self.tool_index = tool_index
        self.call_id = call_id
        self.name = name
        self.arguments: list[str] = []


def _status(reason: str | None) -> ItemStatus:
    return "incomplete" if reason == "length" else "completed"


class ResponsesFrames:
    """The Responses stream encoder of one request (module docstring)."""

    ping = sse.PING

    def __init__(self, gen: Generation, header: Header, snapshot: Snapshot, logprobs: bool) -> None:
        self.gen = gen
        self.header = header
        self._snapshot = snapshot
        self._logprobs = logprobs
        self._seq = 0
        self._opened = False
        self._output: list[OutputItem] = []
        self._message: _Message | None = None
        self._call: _Call | None = None
        self._thought: _Message | None = None  # the reasoning item being streamed
        self._reason: str | None = None

    def _next(self) -> int:
        n = self._seq
        self._seq += 1
        return n

    def open(self, out: list[bytes]) -> None:
        if self._opened:
            return
        self._opened = True
        for name in ("response.created", "response.in_progress"):
            snapshot = self._snapshot(status="in_progress", output=[])
            out.append(sse.named_event(name.encode(), LifecycleEvent(name, self._next(), snapshot)))

    def queue(self, ev: QueueProgress, out: list[bytes]) -> None:
        self.open(out)
        e = QueueProgressEvent("response.queue_progress", self._next(), QueuePosition.of(ev))
        out.append(sse.named_event(b"response.queue_progress", e))

    def progress(self, ev: PrefillProgress, out: list[bytes]) -> None:
        self.open(out)
        e = PromptProgressEvent("response.prompt_progress", self._next(), PromptProgress.of(ev))
        out.append(sse.named_event(b"response.prompt_progress", e))

    def reasoning(self, choice: Choice, text: str, out: list[bytes]) -> None:
        self.open(out)
        t = self._thought
        if t is None:
            t = self._thought = _Message(len(self._output), "rs_")
            added = ReasoningItem(t.id, "in_progress", [])
            out.append(sse.named_event(b"response.output_item.added", self._item("added", t.index, added)))
            part = PartEvent("response.content_part.added", self._next(), t.id, t.index, 0, ReasoningText(""))
            out.append(sse.named_event(b"response.content_part.added", part))
        t.texts.append(text)
        delta = ReasoningDeltaEvent("response.reasoning_text.delta", self._next(), t.id, t.index, 0, text)
        out.append(sse.named_event(b"response.reasoning_text.delta", delta))

    def _close_reasoning(self, out: list[bytes], status: ItemStatus) -> None:
        t = self._thought
        assert t is not None
        self._thought = None
        text = "".join(t.texts)
        done = ReasoningDoneEvent("response.reasoning_text.done", self._next(), t.id, t.index, 0, text)
        out.append(sse.named_event(b"response.reasoning_text.done", done))
        part = ReasoningText(text)
        e = PartEvent("response.content_part.done", self._next(), t.id, t.index, 0, part)
        out.append(sse.named_event(b"response.content_part.done", e))
        item = ReasoningItem(t.id, status, [part])
        self._output.append(item)
        out.append(sse.named_event(b"response.output_item.done", self._item("done", t.index, item)))

    def text(self, choice: Choice, text: str, logprobs: Logprobs, offset: int, out: list[bytes]) -> None:
        self.open(out)
        if self._thought is not None:
            self._close_reasoning(out, "completed")
        if self._call is not None:
            self._close_call(out, "completed")
        m = self._message
        if m is None:
            m = self._message = _Message(len(self._output))
            added = MessageItem(m.id, "in_progress", [])
            out.append(sse.named_event(b"response.output_item.added", self._item("added", m.index, added)))
            part = PartEvent("response.content_part.added", self._next(), m.id, m.index, 0, OutputText(""))
            out.append(sse.named_event(b"response.content_part.added", part))
        entries = _logprobs(logprobs) if self._logprobs else []
        m.texts.append(text)
        m.logprobs += entries
        delta = TextDeltaEvent("response.output_text.delta", self._next(), m.id, m.index, 0, text, entries)
        out.append(sse.named_event(b"response.output_text.delta", delta))

    def tool_call(self, choice: Choice, delta: ToolCallDelta, out: list[bytes]) -> None:
        self.open(out)
        call = self._call
        if self._thought is not None:
            self._close_reasoning(out, "completed")
        if call is None or call.tool_index != delta.index:
            if self._message is not None:
                self._close_message(out, "completed")
            if call is not None:
                self._close_call(out, "completed")
            name = delta.function.name if delta.function.name is not UNSET else ""
            call_id = delta.id if delta.id is not UNSET else new_item_id("call_")
            call = self._call = _Call(len(self._output), delta.index, call_id, name)
            added = FunctionCallItem(call.id, call.call_id, call.name, "", "in_progress")
            out.append(sse.named_event(b"response.output_item.added", self._item("added", call.index, added)))
        args = delta.function.arguments
        if args is not UNSET and args:
            call.arguments.append(args)
            e = ArgumentsDeltaEvent(
                "response.function_call_arguments.delta", self._next(), call.id, call.index, args
            )
            out.append(sse.named_event(b"response.function_call_arguments.delta", e))

    def finish(self, choice: Choice, reason: str, logprobs: Logprobs, out: list[bytes]) -> None:
        self.open(out)
        self._reason = reason
        status = _status(reason)
        if self._thought is not None:
            self._close_reasoning(out, status)
        if self._message is not None:
            self._close_message(out, status)
        if self._call is not None:
            self._close_call(out, status)

    def close(self, out: list[bytes]) -> None:
        self.open(out)
        usage = ResponseUsage.of(self.gen.final_counts())
        if self._reason == "length":
            name = "response.incomplete"
            snapshot = self._snapshot(
                status="incomplete",
                output=self._output,
                usage=usage,
                incomplete_details=IncompleteDetails("max_output_tokens"),
            )
        else:
            name = "response.completed"
            snapshot = self._snapshot(status="completed", output=self._output, usage=usage)
        out.append(sse.named_event(name.encode(), LifecycleEvent(name, self._next(), snapshot)))

    def error(self, exc: ProxyError, out: list[bytes]) -> None:
        self.open(out)
        error = ResponseError(exc.code or exc.type, exc.message)
        snapshot = self._snapshot(status="failed", output=self._output, error=error)
        out.append(
            sse.named_event(b"response.failed", LifecycleEvent("response.failed", self._next(), snapshot))
        )

    def _item(self, what: str, index: int, item: OutputItem) -> ItemEvent:
        return ItemEvent(f"response.output_item.{what}", self._next(), index, item)

    def _close_message(self, out: list[bytes], status: ItemStatus) -> None:
        m = self._message
        assert m is not None
        self._message = None
        text = "".join(m.texts)
        lp = m.logprobs
        done = TextDoneEvent("response.output_text.done", self._next(), m.id, m.index, 0, text, lp)
        out.append(sse.named_event(b"response.output_text.done", done))
        part = OutputText(text, logprobs=lp if self._logprobs else UNSET)
        e = PartEvent("response.content_part.done", self._next(), m.id, m.index, 0, part)
        out.append(sse.named_event(b"response.content_part.done", e))
        item = MessageItem(m.id, status, [part])
        self._output.append(item)
        out.append(sse.named_event(b"response.output_item.done", self._item("done", m.index, item)))

    def _close_call(self, out: list[bytes], status: ItemStatus) -> None:
        c = self._call
        assert c is not None
        self._call = None
        args = "".join(c.arguments)
        e = ArgumentsDoneEvent(
            "response.function_call_arguments.done", self._next(), c.id, c.index, c.name, args
        )
        out.append(sse.named_event(b"response.function_call_arguments.done", e))
        item = FunctionCallItem(c.id, c.call_id, c.name, args, status)
        self._output.append(item)
        out.append(sse.named_event(b"response.output_item.done", self._item("done", c.index, item)))


def responses_body(gen: Generation, snapshot: Snapshot, logprobs: bool) -> bytes:
    """The ``response`` object of a finished ``gen`` (one choice)."""
    r = gen.results()[0]
    status = _status(r.finish_reason)
    output: list[OutputItem] = []
    if r.reasoning is not None:
        output.append(ReasoningItem(new_item_id("rs_"), status, [ReasoningText(r.reasoning)]))
    content = r.content if gen.options.tools is not None else r.text
    if content:
        lp = [TokenLogprobOut.of(t) for t in r.logprobs] if logprobs and r.logprobs is not None else UNSET
        output.append(MessageItem(new_item_id("msg_"), status, [OutputText(content, logprobs=lp)]))
    for call in r.tool_calls:
        item = FunctionCallItem(
            new_item_id("fc_"), call.id, call.function.name, call.function.arguments, status
        )
        output.append(item)
    usage = ResponseUsage.of(gen.final_counts())
    if r.finish_reason == "length":
        body = snapshot(
            status="incomplete",
            output=output,
            usage=usage,
            incomplete_details=IncompleteDetails("max_output_tokens"),
        )
    else:
        body = snapshot(status="completed", output=output, usage=usage)
    return encode(body)
