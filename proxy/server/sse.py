"""Server-Sent Events framing (WHATWG HTML, "Server-sent events"), as our clients need it.

- An event is exactly ``data: <json>\\n\\n``: LF only, one space after the colon,
  the JSON on one line (msgspec escapes every control character, so it never
  contains a raw LF or CR).
- U+2028, U+2029 and U+0085 are escaped as ``\\u2028``/``\\u2029``/``\\u0085``:
  msgspec writes them raw, and line splitters that treat them as line breaks
  (older openai-python, any ``str.splitlines`` client) would cut the event.
- Chat and text completions end with ``data: [DONE]\\n\\n`` (OpenAI's
  terminator); the Responses API and Anthropic's Messages name each event
  (``event: <type>``) and end with their own last event (``named_event``).
- Keep-alive is the comment frame ``: ping\\n\\n``, never an ``event:`` with data.

See ``docs/http-contract.md`` ("Streaming framing") for the clients
that break when one of these rules is not kept.

``TransportWriter`` writes whole events of a prepared response to its
connection synchronously (see its docstring for why and what it relies on).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import socket
import struct
import termios
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from proxy.errors import StalledClient

HEADERS: dict[str, str] = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # nginx (and ingress-nginx) buffers proxied responses unless told not to.
    "X-Accel-Buffering": "no",
}
"""Response headers of every SSE stream, sent as soon as the stream starts."""

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"

# UTF-8 is self-synchronising, so these byte sequences can only be the code
# points themselves; both 3-byte ones start with E2 80, the other is C2 85.
_LS = "\u2028".encode()
_PS = "\u2029".encode()
_NEL = "\u0085".encode()


def escape_line_separators(data: bytes) -> bytes:
    """``data`` (UTF-8 JSON) with U+2028, U+2029 and U+0085 written as JSON
    escapes; the JSON value is unchanged."""
    # Most chunks are pure ASCII; isascii is one fast pass where each substring
    # search below costs several times more.
    if data.isascii():
        return data
    if b"\xe2\x80" in data:
        data = data.replace(_LS, b"\\u2028").replace(_PS, b"\\u2029")
    if _NEL in data:
        data = data.replace(_NEL, b"\\u0085")
    return data


_encode = msgspec.json.Encoder().encode


def dumps(obj: Any) -> bytes:
    """``obj`` (a ``proxy.server.bodies`` struct, or any msgspec-encodable value) as
    one line of JSON, line separators escaped."""
    return escape_line_separators(_encode(obj))


def event(obj: Any) -> bytes:
    """One complete SSE event ``data: <json>\\n\\n`` carrying ``obj``."""
    return b"data: " + escape_line_separators(_encode(obj)) + b"\n\n"


def named_event(name: bytes, obj: Any) -> bytes:
    """One complete SSE event with an ``event:`` name (the Responses API's and
    Anthropic's framing): ``event: <name>\\ndata: <json>\\n\\n``."""
    return b"event: " + name + b"\ndata: " + escape_line_separators(_encode(obj)) + b"\n\n"


def abort(transport: asyncio.Transport) -> None:
    """Close ``transport`` at once with a reset: ``SO_LINGER`` 0 makes the kernel
    drop what it still holds for a client that reads nothing (a plain close
    would keep those bytes in an orphaned socket until the client goes)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class TransportWriter:
    """Writes the events of a prepared SSE response straight to its transport,
    without an ``await``.

    Why: the engine client's reader delivers one engine step to every stream in
    one pass (``proxy.engine.stream.RequestStream.attach``); an ``await
    resp.write()`` per stream would need a task per stream to wake up for it.
    ``write`` frames the bytes as aiohttp's ``StreamWriter`` would (one HTTP/1.1
    chunk, ``<size hex>\\r\\n<data>\\r\\n``, when the response is chunked;
    as they are otherwise) and hands them to the transport in one call, which
    sends them at once when its buffer is empty. The response's headers are
    already out (``StreamResponse.prepare`` sends them) and its end still goes
    through ``write_eof``, so aiohttp frames the rest as usual. Responses
    with compression are refused: their bytes must pass aiohttp's compressor.

    Backpressure is the transport's: ``congested`` is true while it holds more
    than its high-water mark (aiohttp's protocol paused writing); then the
    caller stops writing here and ``await drain()``s, and what piles up meanwhile
    is merged upstream (``RequestStream``).
    """

    __slots__ = ("_chunked", "_protocol", "_transport", "_writer")

    def __init__(
        self, request: web.BaseRequest, resp: web.StreamResponse, writer: AbstractStreamWriter
    ) -> None:
        if resp.compression:
            raise ValueError("TransportWriter cannot write a compressed response")
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        self._transport: asyncio.Transport = transport
        self._protocol = request.protocol
        self._writer = writer
        self._chunked = resp.headers.get("Transfer-Encoding") == "chunked"

    @property
    def congested(self) -> bool:
        """The transport holds more than its high-water mark of unsent bytes."""
        return self._protocol.writing_paused

    def write(self, events: list[bytes]) -> bool:
        """Send ``events`` (whole SSE events) as one write. False, and nothing
        written, when the connection is closing."""
        t = self._transport
        if t.is_closing():
            return False
        if self._chunked:
            data = b"".join((b"%x\r\n" % sum(map(len, events)), *events, b"\r\n"))
        else:
            data = b"".join(events)
        self._writer.output_size += len(data)
        t.write(data)
        return True

    def abort(self) -> None:
        """Close the connection at once, dropping what it still holds (``abort``)."""
        abort(self._transport)

    async def drain(self) -> None:
        """Wait until the transport is below its low-water mark again. Raises
        ``ConnectionResetError`` when the connection is lost meanwhile."""
        await self._writer.drain()

    async def drain_or_cut(self, stalled_s: float, check: Callable[[], object] | None = None) -> None:
        """The ``stalled_client_timeout`` rule, for every stream this server
        sends (generation and ``/v1/status``): wait until the client took enough
        to be below the low-water mark. Raises ``StalledClient`` when it took
        nothing for ``stalled_s`` seconds (0: no limit); ``check`` is called
        about every second meanwhile and may raise to end the wait (a
        generation stream's backlog over its limit). The caller cuts the
        connection (``abort``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (stalled_s or math.inf)
        # One drain, waited on in slices: cancelling a drain (wait_for's timeout)
        # cancels aiohttp's shared drain waiter (base_protocol, 3.14: ``await
        # waiter``, unshielded), and every later drain of the connection would then
        # raise CancelledError at once, ending the handler as if cancelled.
        drained = asyncio.ensure_future(self.drain())
        try:
            while True:
                if check is not None:
                    check()
                slice_s = min(STALL_CHECK_S, deadline - loop.time())
                if slice_s <= 0:
                    raise _stalled(stalled_s)
                done, _ = await asyncio.wait((drained,), timeout=slice_s)
                if done:
                    drained.result()
                    return
        finally:
            drained.cancel()  # only while still waiting: then the connection is cut

    def backlog(self) -> int:
        """Bytes written that the client has not taken: the transport's buffer
        plus the kernel's send queue (``SIOCOUTQ``, tcp(7): unsent and unacked
        bytes; not counted where it cannot be read)."""
        n = self._transport.get_write_buffer_size()
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                n += struct.unpack("i", raw)[0]
        return n

    async def take_or_cut(self, below: int, stalled_s: float) -> None:
        """``drain_or_cut``'s rule for a stream that writes little at a time
        (``/v1/status``), whose bytes the kernel's buffers (megabytes on
        loopback) would hold for minutes before the transport ever looked
        congested: wait until ``backlog`` is at most ``below`` bytes. Raises
        ``StalledClient`` when it is not within ``stalled_s`` seconds (0: no
        limit)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (stalled_s or math.inf)
        if self.congested:
            await self.drain_or_cut(stalled_s)
        while self.backlog() > below:
            left = deadline - loop.time()
            if left <= 0:
                raise _stalled(stalled_s)
            await asyncio.sleep(min(BACKLOG_POLL_S, left))


def _stalled(stalled_s: float) -> StalledClient:
    return StalledClient(f"The client took nothing for {stalled_s:g} s (stalled_client_timeout)")


STALL_CHECK_S = 1.0
"""How often a wait for a stalled client calls its ``check``."""

BACKLOG_POLL_S = 0.25
"""How often ``take_or_cut`` looks at the backlog."""
