"""The client's request id: ``X-Request-Id``, bounded and sanitized.

Gateways and proxies in front of this server (Envoy, the Gateway API Inference
Extension's gateway, nginx's ``$request_id``) set ``X-Request-Id`` so that one
request can be followed through every hop's logs. ``client_request_id`` is the
one place that reads the header; ``proxy.ops.request_log`` keeps the result as
the request's correlation id (its log line, ``/v1/status``, traces) and echoes
it back in the response's ``X-Request-Id`` (the server's own id there when the
client sent none).

The value is client text that ends up in log lines and in a response header,
so it is cut to a safe shape rather than refused (a request is never failed for
its id): only ``SAFE_CHARS`` are kept (UUIDs, hex, ULIDs, Envoy's and nginx's
ids, ``trace-id:span-id`` forms all survive unchanged), the rest dropped, then
at most ``MAX_REQUEST_ID_CHARS`` characters; nothing left is no id. Several
``X-Request-Id`` headers: the first one.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping

REQUEST_ID_HEADER = "X-Request-Id"

MAX_REQUEST_ID_CHARS = 128
"""Most characters kept: a UUID is 36, nginx's id 32, a W3C trace id and span
id joined 49; 128 leaves room for a gateway's prefix without letting a client
grow every log line by kilobytes."""

SAFE_CHARS = frozenset(string.ascii_letters + string.digits + "-_.:/+=@")
"""Characters kept: no whitespace, quotes, ``;``/``,`` (header syntax), control
or non-ASCII characters, so the id needs no escaping in a log line, a header or
a JSON string."""

_UNSAFE = re.compile("[^" + re.escape("".join(sorted(SAFE_CHARS))) + "]+")


def sanitize_request_id(raw: str) -> str | None:
    """``raw`` with the characters outside ``SAFE_CHARS`` dropped, cut to
    ``MAX_REQUEST_ID_CHARS``; ``None`` when nothing is left."""
    kept = _UNSAFE.sub("", raw[: MAX_REQUEST_ID_CHARS * 8])[:MAX_REQUEST_ID_CHARS]
    return kept or None


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The request's sanitized ``X-Request-Id`` (module docstring), ``None``
    without one. ``headers`` is case-insensitive (aiohttp's ``CIMultiDict``)."""
    raw = headers.get(REQUEST_ID_HEADER)
    return sanitize_request_id(raw) if raw is not None else None
