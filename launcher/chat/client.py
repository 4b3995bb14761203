"""The HTTP side of ``exl3-sidecar chat``: one streamed turn over httpx + httpx-sse,
in the API ``apis`` describes (chat completions, Responses, Messages).

Errors, all raised as one type whose ``str()`` is the line to show the user::

    ChatError                 the chat did not complete
    ├── ConnectFailed         no connection to the server (refused, unknown host, connect timeout)
    ├── ServerError           the server answered with an error: an HTTP status with
    │                         the API's error body, or an error event inside the stream
    └── StreamBroken          the stream stopped making sense: not SSE, an event that does
                              not decode, a read timeout, or a close before it finished

httpx's and msgspec's exceptions are translated here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Generator

import httpx
import msgspec
from httpx_sse import SSEError, connect_sse

from launcher.chat.apis import Api, ChatRequest, Update
from launcher.chat.wire import ErrorBody, models_decoder

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


def open_client(base_url: str, headers: dict[str, str], read_timeout_s: float) -> httpx.Client:
    """An httpx client for ``base_url`` (ending in ``/v1``) sending ``headers`` (the
    API's key and version headers: ``Api.headers``). ``read_timeout_s`` is how long
    the server may stay silent: long, since a prefill without progress events is
    silent (this project's server sends pings every 15 s meanwhile)."""
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
        raise transport_error(client, e) from e
    if response.status_code != 200:
        return FALLBACK_MODEL
    try:
        models = models_decoder.decode(response.content)
    except msgspec.MsgspecError:
        return FALLBACK_MODEL
    return models.data[0].id if models.data else FALLBACK_MODEL


def stream_updates(client: httpx.Client, api: Api, request: ChatRequest) -> Generator[Update, None, None]:
    """POST ``request`` in ``api``'s shape and yield the update of each stream event
    until the API's end of stream (``apis``).

    The connection is closed when the generator is closed or an exception passes
    through it (Ctrl-C included), which is how the server learns to stop the
    engine work. A stream that ends without its end event is accepted once the
    answer has finished (older llama.cpp servers omit ``[DONE]``), else it is
    ``StreamBroken``. An error event raises ``ServerError``.
    """
    reader = api.reader()
    try:
        with connect_sse(client, "POST", api.path, json=api.body(request)) as source:
            response = source.response
            if response.status_code >= 400:
                response.read()
                raise _http_error(api, response)
            for event in source.iter_sse():
                if not event.data:
                    continue
                try:
                    update = reader.read(event.event, event.data)
                except msgspec.MsgspecError as e:
                    raise StreamBroken(f"the server sent an event this client cannot read: {e}") from e
                if update is not None:
                    if update.error is not None:
                        raise ServerError(None, update.error)
                    yield update
                if reader.done:
                    return
    except SSEError as e:
        raise StreamBroken(f"the server did not answer with a stream: {e}") from e
    except httpx.TransportError as e:
        raise transport_error(client, e) from e
    if not reader.finished:
        raise StreamBroken("the server closed the stream before the answer finished")


def _http_error(api: Api, response: httpx.Response) -> ServerError:
    try:
        body = api.error(response.content)
    except msgspec.MsgspecError:
        # Not the API's error body (a reverse proxy's page, a bare string): show its start.
        text = " ".join(response.text.split())[:200] or response.reason_phrase
        body = ErrorBody(message=text)
    return ServerError(response.status_code, body)


def transport_error(client: httpx.Client, e: httpx.TransportError) -> ChatError:
    """One line for the user about a broken or refused connection."""
    where = str(client.base_url).rstrip("/")
    if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
        return ConnectFailed(f"cannot connect to {where}: {e or type(e).__name__}")
    if isinstance(e, httpx.TimeoutException):
        return StreamBroken(f"{where} sent nothing for too long ({type(e).__name__}); see --timeout")
    return StreamBroken(f"the connection to {where} broke: {e or type(e).__name__}")
