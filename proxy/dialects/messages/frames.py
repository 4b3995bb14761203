"""``/v1/messages`` output: Anthropic's message object, stream events and error shape.

Source: Anthropic's API reference ("Messages", "Streaming Messages", "Errors").

Body::

    {"id": "msg_...", "type": "message", "role": "assistant", "model": str,
     "content": [{"type": "text", "text"} | {"type": "tool_use", "id", "name", "input": {...}}],
     "stop_reason": "end_turn" | "max_tokens" | "tool_use", "stop_sequence": null,
     "usage": {"input_tokens", "output_tokens", "cache_creation_input_tokens": 0,
               "cache_read_input_tokens", "accepted_prediction_tokens"?,
               "rejected_prediction_tokens"?}}

``input_tokens`` + ``cache_read_input_tokens`` is the whole prompt (Anthropic's
meaning: ``input_tokens`` are the tokens not read from the cache); the draft
counts have the names chat usage gives them, only when drafting. A stop
sequence and the model's end of turn both end as ``end_turn`` (the worker does
not report which one matched).

Stream (``event: <type>`` + ``data: {"type": <type>, ...}``)::

    message_start                     # the message, empty content, usage so far
    [queue_progress, prompt_progress ...]          # with return_progress (this server's)
    content_block_start {"index": 0, "content_block": {"type": "thinking", "thinking": "",
                         "signature": ""}}                         # a model that thinks
    content_block_delta {"delta": {"type": "thinking_delta", "thinking"}} ...
    content_block_delta {"delta": {"type": "signature_delta", "signature"}}
    content_block_stop
    content_block_start {"index", "content_block": {"type": "text", "text": ""}}
    content_block_delta {"index", "delta": {"type": "text_delta", "text"}} ...
    content_block_stop {"index"}
    content_block_start {"content_block": {"type": "tool_use", "id", "name", "input": {}}}
    content_block_delta {"delta": {"type": "input_json_delta", "partial_json"}} ...
    content_block_stop
    message_delta {"delta": {"stop_reason", "stop_sequence": null}, "usage": {...}}
    message_stop

Keep-alive is ``event: ping`` (``{"type": "ping"}``); a failure after the
headers is ``event: error`` with the error body below.

Error body (``MessagesErrors``)::

    {"type": "error", "error": {"type": str, "message": str}}
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from protocol.messages import PrefillProgress, QueueProgress
from proxy.core.dialect import Header
from proxy.core.generation import Choice, Generation, Logprobs
from proxy.core.progress import PromptProgress, QueuePosition
from proxy.core.usage import Counts
from proxy.errors import ProxyError
from proxy.server import sse
from proxy.server.bodies import encode
from proxy.tools import ToolCallDelta

# ---------------------------------------------------------------- shapes


class OutputTokensDetails(msgspec.Struct, gc=False):
    """Anthropic's ``usage.output_tokens_details``: thinking tokens, delimiters included."""

    thinking_tokens: int


class MessageUsage(msgspec.Struct, gc=False):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    accepted_prediction_tokens: int | UnsetType = UNSET
    rejected_prediction_tokens: int | UnsetType = UNSET
    output_tokens_details: OutputTokensDetails | UnsetType = UNSET

    @classmethod
    def of(cls, c: Counts) -> MessageUsage:
        usage = cls(c.prompt_tokens - c.cached_tokens, c.completion_tokens, 0, c.cached_tokens)
        if c.reasoning_tokens:
            usage.output_tokens_details = OutputTokensDetails(c.reasoning_tokens)
        if c.draft_accepted is not None:
            usage.accepted_prediction_tokens = c.draft_accepted
            usage.rejected_prediction_tokens = c.draft_rejected or 0
        return usage


class TextBlock(msgspec.Struct, gc=False, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(msgspec.Struct, gc=False, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any


class ThinkingBlock(msgspec.Struct, gc=False, tag_field="type", tag="thinking"):
    thinking: str
    signature: str


Block = TextBlock | ToolUseBlock | ThinkingBlock


def signature_of(thinking: str) -> str:
    """A thinking block's ``signature``: opaque and non-empty, as clients require
    (Claude Code sends it back with the block); here a digest of the text, which
    this server does not check when it comes back."""
    return "exl3s1" + base64.urlsafe_b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


class Message(msgspec.Struct, kw_only=True, gc=False):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Block]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class MessageStart(msgspec.Struct, gc=False, tag_field="type", tag="message_start"):
    message: Message


class BlockStart(msgspec.Struct, gc=False, tag_field="type", tag="content_block_start"):
    index: int
    content_block: Block


class TextDelta(msgspec.Struct, gc=False, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(msgspec.Struct, gc=False, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, gc=False, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, gc=False, tag_field="type", tag="signature_delta"):
    signature: str


class BlockDelta(msgspec.Struct, gc=False, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class BlockStop(msgspec.Struct, gc=False, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct, gc=False):
    stop_reason: str
    stop_sequence: str | None = None


class MessageDelta(msgspec.Struct, gc=False, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: MessageUsage


class MessageStop(msgspec.Struct, gc=False, tag_field="type", tag="message_stop"):
    pass


class Ping(msgspec.Struct, gc=False, tag_field="type", tag="ping"):
    pass


class PromptProgressEvent(msgspec.Struct, gc=False, tag_field="type", tag="prompt_progress"):
    prompt_progress: PromptProgress


class QueueProgressEvent(msgspec.Struct, gc=False, tag_field="type", tag="queue_progress"):
    queue_progress: QueuePosition


class ErrorDetail(msgspec.Struct, gc=False):
    type: str
    message: str


class ErrorBody(msgspec.Struct, gc=False, tag_field="type", tag="error"):
    error: ErrorDetail


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(exc: ProxyError) -> ErrorBody:
    """Anthropic's error object for ``exc``: its type from the status
    (``api_error`` for any other 5xx)."""
    kind = _ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return ErrorBody(ErrorDetail(kind, exc.message))


class MessagesErrors:
    """Anthropic's error shape (module docstring)."""

    __slots__ = ()

    def body(self, exc: ProxyError) -> bytes:
        return encode(error_body(exc))


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str) -> str:
    """Anthropic's ``stop_reason`` of an OpenAI-style finish reason."""
    return _STOP_REASONS.get(finish_reason, "end_turn")


def tool_input(arguments: str) -> Any:
    """A call's arguments (JSON text) as the ``input`` object; a call cut short
    (not valid JSON yet) is ``{}``."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------- stream


_PING = sse.named_event(b"ping", Ping())


class MessagesFrames:
    """The Messages stream encoder of one request (module docstring)."""

    ping = _PING

    def __init__(self, gen: Generation, header: Header, show_thinking: bool = True) -> None:
        self.gen = gen
        self.header = header
        self._show_thinking = show_thinking
        self._thought: list[str] = []  # the open thinking block's text, for its signature
        self._opened = False
        self._index = -1  # the open content block, -1: none
        self._kind: str | None = None  # its type
        self._tool_index: int | None = None  # the parser's index of the open tool call
        self._reason: str | None = None

    def open(self, out: list[bytes]) -> None:
        if self._opened:
            return
        self._opened = True
        h = self.header
        c = self.gen.running_counts()
        usage = MessageUsage(c.prompt_tokens - c.cached_tokens, 0, 0, c.cached_tokens)
        message = Message(id=h.id, model=h.model, content=[], usage=usage)
        out.append(sse.named_event(b"message_start", MessageStart(message)))

    def queue(self, ev: QueueProgress, out: list[bytes]) -> None:
        self.open(out)
        out.append(sse.named_event(b"queue_progress", QueueProgressEvent(QueuePosition.of(ev))))

    def progress(self, ev: PrefillProgress, out: list[bytes]) -> None:
        self.open(out)
        out.append(sse.named_event(b"prompt_progress", PromptProgressEvent(PromptProgress.of(ev))))

    def _start(self, block: Block, kind: str, out: list[bytes]) -> None:
        self._stop(out)
        self._index += 1
        self._kind = kind
        out.append(sse.named_event(b"content_block_start", BlockStart(self._index, block)))

    def _stop(self, out: list[bytes]) -> None:
        if self._kind == "thinking":
            # The signature closes a thinking block, before its content_block_stop.
            signature = SignatureDelta(signature_of("".join(self._thought)))
            out.append(sse.named_event(b"content_block_delta", BlockDelta(self._index, signature)))
            self._thought = []
        if self._kind is not None:
            out.append(sse.named_event(b"content_block_stop", BlockStop(self._index)))
            self._kind = None
            self._tool_index = None

    def reasoning(self, choice: Choice, text: str, out: list[bytes]) -> None:
        self.open(out)
        if self._kind != "thinking":
            self._start(ThinkingBlock("", ""), "thinking", out)
        if self._show_thinking:
            self._thought.append(text)
            event = BlockDelta(self._index, ThinkingDelta(text))
            out.append(sse.named_event(b"content_block_delta", event))

    def text(self, choice: Choice, text: str, logprobs: Logprobs, offset: int, out: list[bytes]) -> None:
        self.open(out)
        if self._kind != "text":
            self._start(TextBlock(""), "text", out)
        out.append(sse.named_event(b"content_block_delta", BlockDelta(self._index, TextDelta(text))))

    def tool_call(self, choice: Choice, delta: ToolCallDelta, out: list[bytes]) -> None:
        self.open(out)
        if self._kind != "tool_use" or self._tool_index != delta.index:
            name = delta.function.name if delta.function.name is not UNSET else ""
            call_id = delta.id if delta.id is not UNSET else "toolu_" + uuid.uuid4().hex
            self._start(ToolUseBlock(call_id, name, {}), "tool_use", out)
            self._tool_index = delta.index
        args = delta.function.arguments
        if args is not UNSET and args:
            event = BlockDelta(self._index, InputJsonDelta(args))
            out.append(sse.named_event(b"content_block_delta", event))

    def finish(self, choice: Choice, reason: str, logprobs: Logprobs, out: list[bytes]) -> None:
        self.open(out)
        self._stop(out)
        self._reason = reason

    def close(self, out: list[bytes]) -> None:
        self.open(out)
        usage = MessageUsage.of(self.gen.final_counts())
        delta = MessageDelta(StopDelta(stop_reason(self._reason or "stop")), usage)
        out.append(sse.named_event(b"message_delta", delta))
        out.append(sse.named_event(b"message_stop", MessageStop()))

    def error(self, exc: ProxyError, out: list[bytes]) -> None:
        self.open(out)
        out.append(sse.named_event(b"error", error_body(exc)))


def messages_body(gen: Generation, header: Header, show_thinking: bool = True) -> bytes:
    """The message object of a finished ``gen`` (one choice)."""
    r = gen.results()[0]
    content: list[Block] = []
    if r.reasoning is not None:
        thought = r.reasoning if show_thinking else ""
        content.append(ThinkingBlock(thought, signature_of(thought)))
    text = r.content if gen.options.tools is not None else r.text
    if text:
        content.append(TextBlock(text))
    for call in r.tool_calls:
        content.append(ToolUseBlock(call.id, call.function.name, tool_input(call.function.arguments)))
    message = Message(
        id=header.id,
        model=header.model,
        content=content,
        stop_reason=stop_reason(r.finish_reason),
        usage=MessageUsage.of(gen.final_counts()),
    )
    return encode(message)
