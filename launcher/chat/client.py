"""The HTTP side of ``exl3-sidecar chat``: one streamed chat completion over httpx + httpx-sse.

Errors, all raised as one type whose ``str()`` is the line to show the user::

    ChatError                 the chat did not complete
    ├── ConnectFailed         no connection to the server (refused, unknown host, connect timeout)
    ├── ServerError           the server answered with an error: an HTTP status with
    │                         OpenAI's envelope, or an error event inside the stream
    └── StreamBroken          the stream stopped making sense: not SSE, a chunk that does
                              not decode, a read timeout, or a close before it finished

httpx's and msgspec's exceptions are translated here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Any

import httpx
import msgspec
from httpx_sse import SSEError, connect_sse

from launcher.chat.wire import Chunk, ErrorBody, chunk_decoder, error_decoder, models_decoder

FALLBACK_MODEL = "default"
"""Sent when ``GET /models`` names none: single-model servers (llama.cpp's, this one) accept any name."""

CONNECT_TIMEOUT_S = 10.0


class ChatError(Exception):
    """The chat did not complete; ``str(error)`` is one line for the user."""


class ConnectFailed(ChatError):
    pass


class ServerError(ChatError):
    """The server refused or failed the request: ``status`` is the HTTP status, ``None``
    for an error event after the stream started; ``error`` is the envelope's body."""

    def __init__(self, status: int | None, error: ErrorBody) -> None:
        self.status = status
        self.error = error
        tags = [f"HTTP {status}"] if status is not None else []
        if error.code is not None and str(error.code) != str(status):
            tags.append(str(error.code))
        message = error.message or "the server reported an error without a message"
        super().__init__(f"{message} ({', '.join(tags)})" if tags else message)


class StreamBroken(ChatError):
    pass


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One chat completion to stream. ``messages`` are OpenAI's ``{"role", "content"}``
    dicts; ``max_tokens`` and ``temperature`` are left to the server when ``None``."""

    model: str
    messages: tuple[dict[str, str], ...]
    max_tokens: int | None = None
    temperature: float | None = None

    def body(self) -> dict[str, Any]:
        """The JSON body: always a stream, with progress and a final usage chunk asked for.
        Servers without the extensions ignore ``return_progress``."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(self.messages),
            "stream": True,
            "return_progress": True,
            "stream_options": {"include_usage": True},
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body


def open_client(base_url: str, api_key: str | None, read_timeout_s: float) -> httpx.Client:
    """An httpx client for ``base_url`` (ending in ``/v1``). ``read_timeout_s`` is how long
    the server may stay silent: long, since a prefill without progress chunks is silent
    (this project's server sends ``: ping`` comments every 15 s meanwhile)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(
        base_url=base_url.rstrip("/") + "/",
        headers=headers,
        timeout=httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S),
    )


def first_model_id(client: httpx.Client) -> str:
    """The first id from ``GET models``, or ``FALLBACK_MODEL`` when the server lists none
    or does not have the route. Raises ``ConnectFailed`` when the server is unreachable."""
    try:
        response = client.get("models")
    except httpx.TransportError as e:
        raise _transport_error(client, e) from e
    if response.status_code != 200:
        return FALLBACK_MODEL
    try:
        models = models_decoder.decode(response.content)
    except msgspec.MsgspecError:
        return FALLBACK_MODEL
    return models.data[0].id if models.data else FALLBACK_MODEL


def stream_chunks(client: httpx.Client, request: ChatRequest) -> Generator[Chunk, None, None]:
    """POST ``chat/completions`` and yield each decoded chunk until ``[DONE]``.

    The connection is closed when the generator is closed or an exception passes
    through it (Ctrl-C included), which is how the server learns to stop the
    engine work. A stream that ends without ``[DONE]`` is accepted once a choice
    has finished (older llama.cpp servers omit it), else it is ``StreamBroken``.
    """
    finished = False
    try:
        with connect_sse(client, "POST", "chat/completions", json=request.body()) as source:
            response = source.response
            if response.status_code >= 400:
                response.read()
                raise _http_error(response)
            for event in source.iter_sse():
                if event.data == "[DONE]":
                    return
                if not event.data:
                    continue
                try:
                    chunk = chunk_decoder.decode(event.data)
                except msgspec.MsgspecError as e:
                    raise StreamBroken(f"the server sent a chunk this client cannot read: {e}") from e
                if chunk.error is not None:
                    raise ServerError(None, chunk.error)
                finished = finished or any(c.finish_reason is not None for c in chunk.choices)
                yield chunk
    except SSEError as e:
        raise StreamBroken(f"the server did not answer with a stream: {e}") from e
    except httpx.TransportError as e:
        raise _transport_error(client, e) from e
    if not finished:
        raise StreamBroken("the server closed the stream before the answer finished")


def _http_error(response: httpx.Response) -> ServerError:
    try:
        body = error_decoder.decode(response.content).error
    except msgspec.MsgspecError:
        # Not OpenAI's envelope (a reverse proxy's page, a bare string): show its start.
        text = " ".join(response.text.split())[:200] or response.reason_phrase
        body = ErrorBody(message=text)
    return ServerError(response.status_code, body)


def _transport_error(client: httpx.Client, e: httpx.TransportError) -> ChatError:
    where = str(client.base_url).rstrip("/")
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        return ConnectFailed(f"cannot connect to {where}: {e or type(e).__name__}")
    if isinstance(e, httpx.TimeoutException):
        return StreamBroken(f"{where} sent nothing for too long ({type(e).__name__}); see --timeout")
    return StreamBroken(f"the connection to {where} broke: {e or type(e).__name__}")
