"""The three APIs ``exl3-sidecar chat`` speaks (``--api``), over one session.

Each ``Api`` makes the request (path, headers, JSON body) and reads its stream:
a ``Reader`` per stream turns each SSE event into an ``Update`` in one
vocabulary (queue and prefill progress, answer text, a finish reason in chat's
words, the usage as ``stats.Counts``, a server error), so the views never ask
which API they show.

``chat``: ``POST chat/completions`` with a Bearer key; ``queue_progress`` /
``prompt_progress`` keys on chunks; the stream ends with ``data: [DONE]``; usage
``prompt_tokens`` with ``prompt_tokens_details.cached_tokens``.

``responses``: ``POST responses`` with a Bearer key; ``response.queue_progress`` /
``response.prompt_progress`` events; it ends with ``response.completed`` or
``response.incomplete`` (the output limit); usage ``input_tokens`` (the whole
prompt) with ``input_tokens_details.cached_tokens``.

``messages``: ``POST messages`` with ``x-api-key`` and ``anthropic-version``,
``max_tokens`` required; ``queue_progress`` / ``prompt_progress`` events after
``message_start``; it ends with ``message_stop``; usage in ``message_start``,
updated by ``message_delta``: the prompt is ``input_tokens +
cache_creation_input_tokens + cache_read_input_tokens``, the cached part
``cache_read_input_tokens``.

All three ask for progress with ``"return_progress": true`` (this project's
extension; other servers ignore it or, strict ones, refuse the key).
Readers raise ``msgspec.MsgspecError`` for an event they cannot decode; the
client turns that into ``StreamBroken``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from launcher.chat.stats import Counts
from launcher.chat.wire import (
    ErrorBody,
    MessagesUsage,
    PromptProgress,
    QueueProgress,
    ResponsesUsage,
    Usage,
    chunk_decoder,
    error_decoder,
    messages_event_decoder,
    responses_event_decoder,
)

ANTHROPIC_VERSION = "2023-06-01"
"""The ``anthropic-version`` header Anthropic's API requires: the version of the Messages API in use."""

MESSAGES_DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` sent to the Messages API when ``--max-tokens`` is not given:
Anthropic requires the field, and 4096 is within every Claude model's output
limit. This project's server takes it as a cap (clamped to the context left)."""


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One turn to stream: ``prompt`` as the user's message after the optional
    ``system`` one; ``max_tokens`` and ``temperature`` left to the server when
    ``None`` (the Messages API: ``MESSAGES_DEFAULT_MAX_TOKENS``)."""

    model: str
    prompt: str
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Update:
    """What one stream event says, in one vocabulary; most fields ``None``.

    ``finish_reason`` uses chat's words (``stop``, ``length``, ``tool_calls``,
    or the server's own word for anything else); ``counts`` is the usage so far
    (the last one wins); ``error`` is a server error reported inside the stream.
    """

    queue: QueueProgress | None = None
    prompt: PromptProgress | None = None
    text: str | None = None
    thinking: str | None = None  # a reasoning model's thinking, apart from the answer text
    finish_reason: str | None = None
    counts: Counts | None = None
    error: ErrorBody | None = None


class Reader(Protocol):
    """The events of one stream. ``done``: the API's own end of stream was read
    (stop reading); ``finished``: the answer is complete (a stream that closes
    without its end is accepted once this is true)."""

    done: bool
    finished: bool

    def read(self, event: str, data: str) -> Update | None:
        """One SSE event (``event`` its name, ``message`` when unnamed): its update,
        ``None`` for one that says nothing to show (pings, block boundaries)."""
        ...


class Api(Protocol):
    name: str
    path: str
    """Relative to the base URL (which ends in ``/v1``)."""

    def headers(self, api_key: str | None) -> dict[str, str]: ...
    def body(self, request: ChatRequest) -> dict[str, Any]: ...
    def reader(self) -> Reader: ...

    def error(self, content: bytes) -> ErrorBody:
        """The error body of an HTTP error response; raises ``msgspec.MsgspecError``
        when it is not this API's error shape."""
        ...


def bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def openai_error(content: bytes) -> ErrorBody:
    return error_decoder.decode(content).error


def chat_counts(u: Usage) -> Counts:
    details = u.completion_tokens_details
    return Counts(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else None,
        drafts_accepted=details.accepted_prediction_tokens if details else None,
        drafts_rejected=details.rejected_prediction_tokens if details else None,
    )


def responses_counts(u: ResponsesUsage) -> Counts:
    """``input_tokens`` is the whole prompt (OpenAI's meaning)."""
    details = u.output_tokens_details
    return Counts(
        prompt_tokens=u.input_tokens,
        completion_tokens=u.output_tokens,
        cached_tokens=u.input_tokens_details.cached_tokens if u.input_tokens_details else None,
        drafts_accepted=details.accepted_prediction_tokens if details else None,
        drafts_rejected=details.rejected_prediction_tokens if details else None,
    )


def messages_counts(u: MessagesUsage) -> Counts:
    """Anthropic's ``input_tokens`` are the prompt tokens neither read from nor
    written to the cache: the whole prompt is their sum with both cache counts."""
    read = u.cache_read_input_tokens
    return Counts(
        prompt_tokens=(u.input_tokens or 0) + (u.cache_creation_input_tokens or 0) + (read or 0),
        completion_tokens=u.output_tokens or 0,
        cached_tokens=read,
        drafts_accepted=u.accepted_prediction_tokens,
        drafts_rejected=u.rejected_prediction_tokens,
    )


# ---------------------------------------------------------------- chat completions


class ChatReader:
    __slots__ = ("done", "finished")

    def __init__(self) -> None:
        self.done = False
        self.finished = False

    def read(self, event: str, data: str) -> Update | None:
        if data == "[DONE]":
            self.done = True
            return None
        chunk = chunk_decoder.decode(data)
        if chunk.error is not None:
            return Update(error=chunk.error)
        text = finish = thinking = None
        for choice in chunk.choices:
            if choice.index != 0:  # n is never asked for; keep a server's extra choices out of the text
                continue
            text = choice.delta.content or text
            thinking = choice.delta.reasoning_content or choice.delta.reasoning or thinking
            finish = choice.finish_reason or finish
        self.finished = self.finished or any(c.finish_reason is not None for c in chunk.choices)
        return Update(
            queue=chunk.queue_progress,
            prompt=chunk.prompt_progress,
            text=text,
            thinking=thinking,
            finish_reason=finish,
            counts=chat_counts(chunk.usage) if chunk.usage is not None else None,
        )


class ChatApi:
    """``POST chat/completions`` (OpenAI's chat completions, llama.cpp's and vLLM's servers)."""

    name = "chat"
    path = "chat/completions"

    def headers(self, api_key: str | None) -> dict[str, str]:
        return bearer(api_key)

    def body(self, request: ChatRequest) -> dict[str, Any]:
        """Always a stream, with progress and a final usage chunk asked for."""
        messages = [{"role": "system", "content": request.system}] if request.system else []
        messages.append({"role": "user", "content": request.prompt})
        body: dict[str, Any] = {
            "model": request.model,
            "messages": messages,
            "stream": True,
            "return_progress": True,
            "stream_options": {"include_usage": True},
        }
        if request.max_tokens is not None:
            body["max_tokens"] = request.max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        return body

    def reader(self) -> Reader:
        return ChatReader()

    def error(self, content: bytes) -> ErrorBody:
        return openai_error(content)


# ---------------------------------------------------------------- Responses API


class ResponsesReader:
    __slots__ = ("done", "finished")

    def __init__(self) -> None:
        self.done = False
        self.finished = False

    def read(self, event: str, data: str) -> Update | None:
        ev = responses_event_decoder.decode(data)
        kind = ev.type
        if kind == "response.output_text.delta":
            return Update(text=ev.delta) if isinstance(ev.delta, str) and ev.delta else None
        if kind == "response.reasoning_text.delta":
            return Update(thinking=ev.delta) if isinstance(ev.delta, str) and ev.delta else None
        if kind == "response.prompt_progress" or kind == "response.queue_progress":
            return Update(queue=ev.queue_progress, prompt=ev.prompt_progress)
        if kind in ("response.completed", "response.incomplete"):
            self.done = self.finished = True
            r = ev.response
            usage = r.usage if r is not None else None
            reason = "stop"
            if kind == "response.incomplete":
                why = r.incomplete_details.reason if r is not None and r.incomplete_details else None
                reason = "length" if why in (None, "max_output_tokens") else why
            return Update(finish_reason=reason, counts=responses_counts(usage) if usage else None)
        if kind == "response.failed":
            error = ev.response.error if ev.response is not None else None
            if error is None:
                return Update(error=ErrorBody(message="the response failed without an error"))
            return Update(error=ErrorBody(message=error.message, code=error.code))
        if kind == "error":
            return Update(error=ErrorBody(message=ev.message or "", code=ev.code, param=ev.param))
        return None


class ResponsesApi:
    """``POST responses`` (OpenAI's Responses API, stateless: ``store`` false)."""

    name = "responses"
    path = "responses"

    def headers(self, api_key: str | None) -> dict[str, str]:
        return bearer(api_key)

    def body(self, request: ChatRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.model,
            "input": request.prompt,
            "stream": True,
            "store": False,
            "return_progress": True,
        }
        if request.system:
            body["instructions"] = request.system
        if request.max_tokens is not None:
            body["max_output_tokens"] = request.max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        return body

    def reader(self) -> Reader:
        return ResponsesReader()

    def error(self, content: bytes) -> ErrorBody:
        return openai_error(content)


# ---------------------------------------------------------------- Anthropic Messages

_STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
}


def anthropic_error(error: ErrorBody) -> ErrorBody:
    """Anthropic's ``{"type", "message"}``: its type is what names the error (as ``code`` does OpenAI's)."""
    return ErrorBody(message=error.message, type=error.type, code=error.type)


class MessagesReader:
    __slots__ = ("_usage", "done", "finished")

    def __init__(self) -> None:
        self.done = False
        self.finished = False
        self._usage = MessagesUsage()

    def read(self, event: str, data: str) -> Update | None:
        ev = messages_event_decoder.decode(data)
        kind = ev.type
        if kind == "content_block_delta":
            d = ev.delta
            if d is not None and d.type == "thinking_delta" and d.thinking:
                return Update(thinking=d.thinking)
            return Update(text=d.text) if d is not None and d.type == "text_delta" and d.text else None
        if kind == "queue_progress" or kind == "prompt_progress":
            return Update(queue=ev.queue_progress, prompt=ev.prompt_progress)
        if kind == "message_start":
            if ev.message is not None and ev.message.usage is not None:
                self._usage = ev.message.usage
            return None  # its usage counts no output yet: the usage line waits for message_delta
        if kind == "message_delta":
            if ev.usage is not None:
                self._usage = _merge(self._usage, ev.usage)
            stop = ev.delta.stop_reason if ev.delta is not None else None
            if stop is not None:
                self.finished = True
            reason = _STOP_REASONS.get(stop, stop) if stop is not None else None
            return Update(finish_reason=reason, counts=messages_counts(self._usage))
        if kind == "message_stop":
            self.done = True
            return None
        if kind == "error":
            error = ev.error or ErrorBody(message="the server reported an error without a message")
            return Update(error=anthropic_error(error))
        return None


def _merge(first: MessagesUsage, later: MessagesUsage) -> MessagesUsage:
    """``message_delta``'s usage is cumulative; a field it leaves out keeps ``message_start``'s value."""
    return MessagesUsage(
        **{
            f: getattr(later, f) if getattr(later, f) is not None else getattr(first, f)
            for f in MessagesUsage.__struct_fields__
        }
    )


class MessagesApi:
    """``POST messages`` (Anthropic's Messages API)."""

    name = "messages"
    path = "messages"

    def headers(self, api_key: str | None) -> dict[str, str]:
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        return headers

    def body(self, request: ChatRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens or MESSAGES_DEFAULT_MAX_TOKENS,
            "messages": [{"role": "user", "content": request.prompt}],
            "stream": True,
            "return_progress": True,
        }
        if request.system:
            body["system"] = request.system
        if request.temperature is not None:
            body["temperature"] = request.temperature
        return body

    def reader(self) -> Reader:
        return MessagesReader()

    def error(self, content: bytes) -> ErrorBody:
        return anthropic_error(error_decoder.decode(content).error)


APIS: dict[str, Api] = {api.name: api for api in (ChatApi(), ResponsesApi(), MessagesApi())}
"""By ``--api`` name; the first is the default."""
