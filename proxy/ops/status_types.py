"""The body of ``GET /v1/status``: what the server is doing now (``docs/status.md``).

Definitions only (msgspec alone, no aiohttp): ``proxy.ops.status`` builds and encodes
them, ``launcher.top`` decodes them with ``status_decoder``. Field order is key
order on the wire; evolve by appending fields with defaults. Counts are tokens,
times seconds; ``None`` is ``null`` (not known yet, or not reported).

::

    {"object": "status", "time": unix seconds,
     "proxy": {...ProxyStatus}, "worker": {...WorkerStatus} | null,
     "totals": {...TotalsStatus}, "requests": [{...RequestStatus}, ...]}
"""

from __future__ import annotations

from typing import Literal

import msgspec

STAGES = ("decode", "prefill", "queued", "submitted", "done")
"""``RequestStatus.stage`` values, in the order ``requests`` lists them (the
ones nearest the end first; ``proxy.ops.inflight.Stage``)."""


class ProxyStatus(msgspec.Struct, kw_only=True, gc=False):
    """This proxy: ``uptime_s`` since it started; ``in_flight``: generation
    requests admitted and not ended (``max_in_flight`` its limit);
    ``draining``: shutting down; ``status_streams``: ``?stream=true`` readers."""

    uptime_s: float
    in_flight: int
    max_in_flight: int
    draining: bool
    status_streams: int


class WorkerStatus(msgspec.Struct, kw_only=True, gc=False):
    """The worker, from its handshake (``Ready``) and latest ``Heartbeat``.

    ``up``: handshake done and heartbeats on time. ``model`` is the served name;
    ``backend``, ``drafting`` (``None``: off) and ``max_context_tokens`` its
    handshake's. ``batch_slots``: most sequences running at once (0: unknown),
    ``running``: sequences running now; ``kv_cache_tokens``: KV capacity (0:
    unknown), ``kv_cache_usage`` the fraction reserved (0..1) and
    ``kv_cache_used_tokens`` that many tokens; ``queued``: requests in its queue
    (``max_queue`` its limit); ``step_s``: seconds inside the current engine step;
    ``heartbeat_age_s``: since the latest heartbeat arrived (the heartbeat fields
    are ``None`` before the first); ``uptime_s``: since this worker's handshake;
    ``kernels``: the CPU engine's kernel per product (``Ready.kernels``; ``None``
    for other engines)."""

    up: bool
    worker_id: str
    model: str
    backend: str
    drafting: str | None
    max_context_tokens: int
    batch_slots: int
    running: int | None
    kv_cache_tokens: int
    kv_cache_usage: float | None
    kv_cache_used_tokens: int | None
    queued: int | None
    max_queue: int
    step_s: float | None
    heartbeat_age_s: float | None
    uptime_s: float | None
    kernels: dict[str, str] | None = None


class TotalsStatus(msgspec.Struct, kw_only=True, gc=False):
    """Counters since the proxy started, requests in flight included (what they
    did so far), so they never decrease: rates are differences between two
    snapshots over the difference of their ``time``. ``requests``: generation
    requests ended (``failed`` of them without a whole answer: an error, a
    client gone); ``prefilled_tokens``: prompt tokens computed (cached ones
    excluded); draft counts as the worker reports them at each choice's end."""

    requests: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    completion_tokens: int
    draft_accepted: int
    draft_rejected: int


class QueueStatus(msgspec.Struct, kw_only=True, gc=False):
    """The latest ``queue_progress`` of a queued request: ``position`` (1: next),
    ``queued`` requests waiting, ``waited_s``, ``eta_s`` (``None``: no estimate)."""

    position: int
    queued: int
    waited_s: float
    eta_s: float | None


class PrefillStatus(msgspec.Struct, kw_only=True, gc=False):
    """The latest ``prompt_progress`` of a request in prefill: ``processed`` of
    ``total`` prompt tokens in the KV cache, ``cached`` of them reused,
    ``elapsed_s`` since its prefill started, ``rate_tok_s`` computed tokens per
    second (``None`` before any was timed)."""

    processed: int
    total: int
    cached: int
    elapsed_s: float
    rate_tok_s: float | None


class RequestStatus(msgspec.Struct, kw_only=True, gc=False):
    """One generation request in flight.

    ``id``: the response's id; ``dialect``: ``chat``, ``completions``,
    ``responses`` or ``messages``; ``endpoint``: its path; ``stage``: one of
    ``STAGES``; ``queue`` only while queued, ``prefill`` only in prefill;
    ``prompt_tokens``/``cached_tokens`` once admitted (0 before);
    ``completion_tokens`` so far over its ``choices``; ``decode_tok_s``: tokens
    after each choice's first over the seconds since the first token;
    ``ttft_s``: arrival to first token; ``draft_accepted``/``draft_rejected``:
    summed over finished choices (``None`` until one finished with drafting on);
    ``age_s``: since it arrived; ``correlation_id``: the client's ``X-Request-Id``
    (sanitized: ``proxy.server.request_id``), else ``id``, as the response's
    ``X-Request-Id`` header and the request log carry it (``None`` only from a
    server older than the field)."""

    id: str
    dialect: str
    endpoint: str
    stream: bool
    choices: int
    stage: str
    age_s: float
    queue: QueueStatus | None
    prefill: PrefillStatus | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    decode_tok_s: float | None
    ttft_s: float | None
    draft_accepted: int | None
    draft_rejected: int | None
    correlation_id: str | None = None
    phase: Literal["thinking", "answering"] | None = None
    """In ``decode``: whether a reasoning model is still thinking or answering
    (``None`` in other stages)."""
    reasoning_tokens: int = 0
    """Of ``completion_tokens``, those spent thinking."""


class OthersStatus(msgspec.Struct, kw_only=True, gc=False):
    """Requests in flight of other API keys than the viewer's, counted by
    stage (``STAGES``), nothing else of them: no ids, counts or timings."""

    requests: int = 0
    decode: int = 0
    prefill: int = 0
    queued: int = 0
    submitted: int = 0


class Status(msgspec.Struct, kw_only=True, gc=False):
    """One snapshot (module docstring). ``worker`` is ``None`` before the
    worker's first handshake. With API keys, ``requests`` holds the viewing
    key's own requests and ``others`` counts the rest (``None`` without keys:
    every request is in ``requests``)."""

    object: Literal["status"] = "status"
    time: float
    proxy: ProxyStatus
    worker: WorkerStatus | None
    totals: TotalsStatus
    requests: list[RequestStatus]
    others: OthersStatus | None = None


status_decoder = msgspec.json.Decoder(Status)
"""Decodes one snapshot (raises ``msgspec.ValidationError``/``DecodeError``)."""
