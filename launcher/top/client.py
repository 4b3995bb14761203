"""The HTTP side of ``exl3-sidecar top``: ``GET /v1/status``, once or as an SSE stream.

Errors are ``launcher.chat.client``'s tree (``ChatError``: ``ConnectFailed``,
``ServerError``, ``StreamBroken``), each ``str()`` one line for the user;
httpx's, httpx-sse's and msgspec's exceptions are translated here.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
from httpx_sse import SSEError, connect_sse

from launcher.chat.client import ServerError, StreamBroken, transport_error
from launcher.chat.wire import ErrorBody, error_decoder
from proxy.ops.status_types import Status, status_decoder

PATH = "status"
"""Relative to the base URL, which ends in ``/v1``."""


def fetch_status(client: httpx.Client) -> Status:
    """One snapshot. Raises ``ChatError``."""
    try:
        response = client.get(PATH)
    except httpx.TransportError as e:
        raise transport_error(client, e) from e
    if response.status_code >= 400:
        raise _http_error(response)
    return _decode(response.content)


def stream_status(client: httpx.Client, interval_s: float) -> Iterator[Status]:
    """A snapshot every ``interval_s`` seconds until the server ends the stream
    (it drains) or the generator is closed. Raises ``ChatError``."""
    params = {"stream": "true", "interval": f"{interval_s:g}"}
    try:
        with connect_sse(client, "GET", PATH, params=params) as source:
            response = source.response
            if response.status_code >= 400:
                response.read()
                raise _http_error(response)
            for event in source.iter_sse():
                if event.data:
                    yield _decode(event.data.encode())
    except SSEError as e:
        raise StreamBroken(f"the server did not answer with a stream: {e}") from e
    except httpx.TransportError as e:
        raise transport_error(client, e) from e


def _decode(data: bytes) -> Status:
    try:
        return status_decoder.decode(data)
    except msgspec.MsgspecError as e:
        raise StreamBroken(f"the server sent a status this client cannot read: {e}") from e


def _http_error(response: httpx.Response) -> ServerError:
    if response.status_code == 404:
        body = ErrorBody(message="this server has no GET /v1/status (is it exl3-sidecar?)")
        return ServerError(404, body)
    try:
        body = error_decoder.decode(response.content).error
    except msgspec.MsgspecError:
        text = " ".join(response.text.split())[:200] or response.reason_phrase
        body = ErrorBody(message=text)
    return ServerError(response.status_code, body)
