"""The proxy's settings: every option of ``exl3-sidecar proxy`` written once.

``ProxySettings`` is the one source of each option's name, type, default, range,
environment variable and help (``protocol.settings`` derives the CLI from it);
tests build it directly. An error about a limit names the field that controls it.
"""

from __future__ import annotations

import dataclasses
import resource
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from protocol.endpoints import LinkSettings
from protocol.settings import setting

MIB = 1024 * 1024

BODY_BYTES_PER_CHAR = 6
"""Bytes of JSON one prompt character can take at most (a ``\\uXXXX`` escape)."""

BODY_OVERHEAD_BYTES = 1 * MIB
"""Room in a derived body limit for the JSON around the prompt text."""

BODY_BYTES_UNKNOWN = 8 * MIB
"""The derived body limit while the worker has not said how long a prompt can be."""


@dataclasses.dataclass(frozen=True, slots=True)
class ImageLimits:
    """What one request's images may be (``proxy.core.images``): ``count`` images,
    each at most ``bytes`` of file and ``pixels`` of width x height; whether
    http(s) URLs are fetched (``fetch``), from which ``hosts`` (empty: any public
    one), within ``timeout`` seconds (``proxy.core.image_fetch``)."""

    count: int
    bytes: int
    pixels: int
    fetch: bool = False
    hosts: tuple[str, ...] = ()
    timeout: float = 10.0


CONNECTIONS_CEILING = 10_000
"""Most connections ``max_connections`` defaults to, whatever the open-file limit:
an idle connection holds about 6 KiB of proxy memory (5,000 measured: RSS 49 ->
77 MiB), so the ceiling bounds it near 60 MiB."""

CONNECTIONS_SHARE = 0.75
"""Share of the open-file limit (``RLIMIT_NOFILE``, soft) the default
``max_connections`` may take: the rest is for the connections accepted only to
be refused, one burst of accepts (up to the listen backlog), the worker link and
files."""


ToolCallFormatName = Literal["auto", "hermes", "llama3_json", "mistral", "harmony"]
"""``--tool-call-format`` values (``proxy.tools.TOOL_CALL_FORMAT_CHOICES``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxySettings(LinkSettings):
    """Settings of the HTTP proxy and its engine connection (plus ``LinkSettings``:
    the ZeroMQ addresses the worker binds and the log level). Times are seconds;
    counts are requests or events. Raises ``ValueError`` naming the field when a
    value is out of range. ``repr`` never shows the API keys."""

    host: str = setting(
        "127.0.0.1",
        "Address the HTTP server listens on; 0.0.0.0 for every interface (a container, a pod).",
    )
    port: int = setting(5000, "HTTP port.", ge=0, le=65535)
    served_model_name: str | None = setting(
        None, "Model name reported to clients (default: the worker's model id)."
    )
    tool_call_format: ToolCallFormatName = setting(
        "auto",
        "How tool calls are written and parsed: auto (detected from the model's chat template; "
        "hermes when it has no tool support), hermes, llama3_json or mistral.",
    )
    reasoning_field: Literal["reasoning_content", "reasoning", "both"] = setting(
        "reasoning_content",
        "Chat completions: the field a reasoning model's thinking goes in (message and delta): "
        "reasoning_content (llama.cpp, DeepSeek, TabbyAPI, most UIs), reasoning (vLLM since its "
        "rename, Ollama) or both (each chunk and message carries the thinking under both names, "
        "for clients of either family).",
    )
    sse_ping_interval: float = setting(
        15.0,
        "Seconds of stream silence before a ': ping' SSE comment is sent; also how long a stream "
        "waits for the worker's first event before its headers go out.",
        gt=0,
    )
    max_in_flight: int = setting(
        256, "Concurrent completion requests admitted; beyond it, 429 too_many_requests.", ge=1
    )
    stream_interval: int = setting(
        1,
        "Tokens per streamed content event, like vLLM's --stream-interval: each choice's first "
        "token is sent at once, later ones once this many have come (and the rest when the choice "
        "ends). Fewer events cost the proxy and the client less CPU; 1 sends every engine step's "
        "tokens as they come.",
        ge=1,
    )
    request_queue_max: int = setting(
        256,
        "Events pending per request before a slow client's consecutive token deltas are merged.",
        ge=1,
    )
    stalled_client_timeout: float = setting(
        30.0,
        "Seconds a client may take nothing of a response that has bytes waiting for it: then its "
        "connection is cut, its engine work aborted and its slot freed (0 disables).",
        ge=0,
    )
    max_stream_buffer_mb: float = setting(
        4.0,
        "MiB of merged events (text, logprobs) one stream may hold for a client that does not "
        "keep up; beyond it the stream is cut as a stalled one.",
        gt=0,
    )
    cache_isolation: Literal["none", "key"] = setting(
        "none",
        "'key': each API key gets a prefix cache of its own (its digest salts every request, "
        "vLLM's cache_salt meaning), so one tenant cannot learn from cached_tokens or prefill "
        "time what another sent; 'none': the prefix cache is shared (a request's own "
        "cache_salt still keeps it apart).",
    )
    heartbeat_timeout: float = setting(
        30.0, "Seconds without any worker message before the worker is declared dead.", gt=0
    )
    handshake_interval: float = setting(0.5, "Seconds between Hello messages while not ready.", gt=0)
    shutdown_drain: float = setting(
        20.0,
        "Seconds in-flight requests may finish after SIGTERM before they are aborted; keep it "
        "below Kubernetes' terminationGracePeriodSeconds.",
        ge=0,
    )
    max_body_mb: float | None = setting(
        None,
        "Largest request body, MiB; beyond it, 413. Default: sized to the longest prompt the "
        "model can take (6 bytes per character plus 1 MiB), 8 MiB while that is unknown.",
        gt=0,
    )
    max_images: int = setting(
        8,
        "Images one request may carry (every turn counted); beyond it, 400 naming the first image "
        "over the limit. Only a model that takes images is sent any.",
        ge=0,
    )
    max_image_mb: float = setting(
        5.0,
        "Largest image, MiB of the decoded file (Anthropic's limit); beyond it, 400 naming the "
        "part. The derived body limit makes room for max_images images this large (base64).",
        gt=0,
    )
    max_image_pixels: int = setting(
        25_000_000,
        "Most pixels (width x height, read from the file's header before any decoding) of one "
        "image; beyond it, 400 naming the part: a decompression bomb is refused, not decoded.",
        ge=1,
    )
    allow_image_urls: bool = setting(
        False,
        "Fetch http(s) image URLs of image parts (off: only data URLs and base64 are taken, a URL "
        "is a 400 naming the part). A fetched file is held to max_image_mb and image_url_timeout; "
        "a host that resolves to a private, loopback or link-local address is refused unless "
        "image_url_hosts lists it.",
    )
    image_url_hosts: str | None = setting(
        None,
        "With allow_image_urls: the hosts that may be fetched, comma-separated (a leading dot: a "
        "domain and its subdomains, '.example.com'); default any host with a public address.",
    )
    image_url_timeout: float = setting(
        10.0, "With allow_image_urls: seconds one image URL may take to fetch in full.", gt=0
    )
    body_read_timeout: float = setting(
        30.0, "Seconds a request body may take to arrive in full; beyond it, 408.", gt=0
    )
    request_idle_timeout: float = setting(
        600.0,
        "Seconds a request may wait for its next event from the worker before it fails with "
        "'timeout' (504, or an error event once streaming) and is aborted; 0 disables.",
        ge=0,
    )
    max_n: int = setting(8, "Most choices ('n') one request may ask for; beyond it, 400.", ge=1)
    api_key: str | None = setting(
        None,
        "API keys, comma-separated: /v1/* then requires 'Authorization: Bearer <key>' or "
        "'x-api-key: <key>' (prefer the environment variable or --api-key-file to a flag).",
    )
    api_key_file: Path | None = setting(
        None, "File of API keys, one per line (blank lines and lines starting with # skipped)."
    )
    allowed_hosts: str | None = setting(
        None,
        "Host names (comma-separated, '*' for any) accepted in the Host and Origin headers when no "
        "API key is set, besides loopback names (localhost, 127.0.0.0/8, ::1): a guard against DNS "
        "rebinding. Default: loopback names only while --host is a loopback address; no check when "
        "listening on other interfaces (a container, a pod reached by Service names).",
    )
    allowed_origins: str | None = setting(
        None,
        "Origins (comma-separated scheme://host[:port], '*' for any) whose web pages may call this server "
        "(CORS, vLLM's --allowed-origins): preflight OPTIONS answered, Access-Control-Allow-Origin on "
        "their responses, and their Origin accepted by the Host/Origin check. Default: none (no CORS).",
    )
    max_connections: int | None = setting(
        None,
        "Client connections open at once; a connection beyond it may ask /health or /ready, "
        "anything else gets 503 too_many_connections, and it is closed. Default: 3/4 of the "
        "open-file limit (ulimit -n), at most 10000.",
        ge=1,
    )
    keepalive_timeout: float = setting(
        75.0, "Seconds an idle keep-alive connection waits for its next request before it is closed.", gt=0
    )
    header_read_timeout: float = setting(
        10.0,
        "Seconds a request line and headers may take to arrive (from the connection's start for its "
        "first request, from the first byte for later ones); beyond it the connection is closed "
        "(with 408 when part of a request came).",
        gt=0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.api_key is not None and not _split_keys(self.api_key.split(",")):
            raise ValueError("api_key: no key given (an empty value would leave /v1/* open)")

    def __repr__(self) -> str:
        def shown(name: str) -> str:
            value = getattr(self, name)
            return "'<redacted>'" if name == "api_key" and value is not None else repr(value)

        fields = ", ".join(f"{f.name}={shown(f.name)}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"

    def body_limit_bytes(self, max_prompt_chars: int | None, images: bool = False) -> int:
        """The request body limit: ``max_body_mb`` when set, else derived from
        ``max_prompt_chars`` (the longest prompt text that can fit the context;
        ``None`` while unknown: ``BODY_BYTES_UNKNOWN``), plus, when the model takes
        ``images``, ``max_images`` images of ``max_image_mb`` in base64 (4 bytes per 3)."""
        if self.max_body_mb is not None:
            return int(self.max_body_mb * MIB)
        room = self.max_images * int(self.max_image_mb * MIB) * 4 // 3 if images else 0
        if max_prompt_chars is None:
            return BODY_BYTES_UNKNOWN + room
        return BODY_BYTES_PER_CHAR * max_prompt_chars + BODY_OVERHEAD_BYTES + room

    def image_limits(self) -> ImageLimits:
        """``max_images``, ``max_image_mb`` (as bytes), ``max_image_pixels`` and the
        URL fetching settings."""
        hosts = tuple(h.strip().lower() for h in (self.image_url_hosts or "").split(",") if h.strip())
        return ImageLimits(
            self.max_images,
            int(self.max_image_mb * MIB),
            self.max_image_pixels,
            fetch=self.allow_image_urls,
            hosts=hosts,
            timeout=self.image_url_timeout,
        )

    def connection_cap(self) -> int:
        """``max_connections``, or its default from this process's open-file limit
        (``CONNECTIONS_SHARE`` of ``RLIMIT_NOFILE``'s soft value, at most
        ``CONNECTIONS_CEILING``, at least 1)."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return CONNECTIONS_CEILING
        return max(1, min(CONNECTIONS_CEILING, int(soft * CONNECTIONS_SHARE)))

    def api_keys(self) -> frozenset[str]:
        """Every key of ``api_key`` and ``api_key_file`` (empty: no key required).
        Reads the file. Raises ``ValueError`` naming ``api_key_file`` when it
        cannot be read or holds no key."""
        keys = _split_keys(self.api_key.split(",")) if self.api_key is not None else set()
        if self.api_key_file is not None:
            try:
                lines = self.api_key_file.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"api_key_file={self.api_key_file}: cannot be read ({e})") from None
            from_file = _split_keys(line for line in lines if not line.lstrip().startswith("#"))
            if not from_file:
                raise ValueError(
                    f"api_key_file={self.api_key_file}: holds no key (an empty file would leave /v1/* open)"
                )
            keys |= from_file
        return frozenset(keys)


def _split_keys(parts: Iterable[str]) -> set[str]:
    return {p.strip() for p in parts if p.strip()}
