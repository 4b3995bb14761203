"""Server-Sent Events framing (WHATWG HTML, "Server-sent events"), as our clients need it.

- An event is exactly ``data: <json>\\n\\n``: LF only, one space after the colon,
  the JSON on one line (msgspec escapes every control character, so it never
  contains a raw LF or CR).
- U+2028, U+2029 and U+0085 are escaped as ``\\u2028``/``\\u2029``/``\\u0085``:
  msgspec writes them raw, and line splitters that treat them as line breaks
  (older openai-python, any ``str.splitlines`` client) would cut the event.
- The stream ends with ``data: [DONE]\\n\\n`` (OpenAI's terminator).
- Keep-alive is the comment frame ``: ping\\n\\n``, never an ``event:`` with data.

See ``docs/http-contract.md`` ("Streaming framing") for the clients
that break when one of these rules is not kept.
"""

from __future__ import annotations

from typing import Any

import msgspec

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
    """``obj`` (a ``proxy.responses`` struct, or any msgspec-encodable value) as
    one line of JSON, line separators escaped."""
    return escape_line_separators(_encode(obj))


def event(obj: Any) -> bytes:
    """One complete SSE event ``data: <json>\\n\\n`` carrying ``obj``."""
    return b"data: " + escape_line_separators(_encode(obj)) + b"\n\n"
