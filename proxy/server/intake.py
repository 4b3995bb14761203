"""What a request must pass before it costs anything: its API key, its media
type, and a body of bounded size that arrives in bounded time.

Each check runs before the next, cheaper ones first, and all of them before a
request takes one of the ``max_in_flight`` slots (``proxy.server.state``) or reaches the
worker: the API key (401) and the headers (415, 413 by ``Content-Length``) before
any byte of the body is read, then the body itself within ``body_read_timeout``
(408) and the size limit (413).

Compressed bodies are refused, never inflated: the app's connections run with
aiohttp's ``auto_decompress=False`` (``proxy.app.create_app``), so a small gzip
body that would inflate to gigabytes costs only its own bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac

from aiohttp import web

from protocol.messages import MODALITY_IMAGE, Ready
from proxy.errors import InvalidApiKey, InvalidRequest, RequestTimeout, RequestTooLarge, UnsupportedMediaType
from proxy.settings import MIB, ProxySettings

JSON = "application/json"


def key_digest(key: str | bytes) -> bytes:
    """What ``check_api_key`` compares: the SHA-256 of a key, so every
    comparison is of equal length and the process keeps no key in the clear."""
    raw = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
    return hashlib.sha256(raw).digest()


KEY_DIGEST: web.RequestKey[bytes] = web.RequestKey("key_digest", bytes)
"""The SHA-256 digest of the API key a request was admitted with (keys configured)."""


def check_api_key(request: web.BaseRequest, digests: frozenset[bytes]) -> bytes:
    """The digest of the key the request carries. Raise ``InvalidApiKey``
    unless ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` holds a key
    whose ``key_digest`` is in ``digests``. Every digest is compared, each with
    ``hmac.compare_digest``, so the time taken tells nothing about which key
    nearly matched. Keys are never logged or echoed."""
    given: list[bytes] = []
    auth = request.headers.get("Authorization")
    if auth is not None:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer":
            given.append(key_digest(token.strip()))
    x_api_key = request.headers.get("x-api-key")
    if x_api_key is not None:
        given.append(key_digest(x_api_key.strip()))
    if not given:
        raise InvalidApiKey("Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    matched: bytes | None = None
    for candidate in given:
        for digest in digests:
            if hmac.compare_digest(candidate, digest):
                matched = candidate
    if matched is None:
        raise InvalidApiKey("Incorrect API key provided")
    return matched


def check_json_body(request: web.BaseRequest) -> None:
    """Raise ``UnsupportedMediaType`` for a body that is not
    ``Content-Type: application/json`` (parameters such as ``charset`` allowed;
    this also refuses the ``text/plain`` and form bodies a cross-site page can
    POST without asking) or that carries a ``Content-Encoding`` other than
    ``identity``."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise UnsupportedMediaType(
            f"Compressed request bodies are not accepted (Content-Encoding: {encoding[:40]!r}); "
            "send the JSON uncompressed"
        )
    if request.content_type != JSON:
        raise UnsupportedMediaType(
            f"The request body must be JSON with 'Content-Type: {JSON}', got {request.content_type[:80]!r}"
        )


def max_prompt_chars(worker: Ready | None) -> int | None:
    """The longest prompt text that can fit the worker's context
    (``max_context_tokens * longest_token_chars``); ``None`` while unknown."""
    if worker is None or worker.longest_token_chars <= 0:
        return None
    return worker.max_context_tokens * worker.longest_token_chars


def body_limit(settings: ProxySettings, worker: Ready | None) -> int:
    """The body limit for requests to ``worker`` (``ProxySettings.body_limit_bytes``,
    with room for images when its model takes them)."""
    images = worker is not None and MODALITY_IMAGE in worker.modalities
    return settings.body_limit_bytes(max_prompt_chars(worker), images)


def too_large(limit: int, settings: ProxySettings) -> RequestTooLarge:
    """The 413 of a body over ``limit`` bytes, naming the setting."""
    how = "max_body_mb" if settings.max_body_mb is not None else "derived from the context; see max_body_mb"
    return RequestTooLarge(f"The request body is larger than {limit / MIB:.1f} MiB ({how})")


async def read_body(request: web.BaseRequest, limit: int, settings: ProxySettings) -> bytes:
    """The whole body, at most ``limit`` bytes, within ``settings.body_read_timeout``
    seconds. Raises ``RequestTooLarge`` (at once when ``Content-Length`` says
    so), ``RequestTimeout``, or ``InvalidRequest`` for a body the HTTP layer
    cannot decode (broken chunked encoding)."""
    length = request.content_length
    if length is not None and length > limit:
        raise too_large(limit, settings)
    chunks: list[bytes] = []
    size = 0
    content = request.content
    try:
        async with asyncio.timeout(settings.body_read_timeout):
            while chunk := await content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit, settings)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {settings.body_read_timeout:g} s (body_read_timeout)"
        ) from None
    except web.RequestPayloadError as e:
        raise InvalidRequest(f"The request body cannot be read: {e}") from None
    return b"".join(chunks)
