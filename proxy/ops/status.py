"""``GET /v1/status``: what the server is doing now, as one JSON body or an SSE stream.

A snapshot (``proxy.ops.status_types.Status``; the format: ``docs/status.md``) is
built from what the proxy already holds: the worker's handshake and latest
heartbeat (``EngineClient``), the admission counters (``ProxyState``) and the
requests in flight (``proxy.ops.inflight``). It sends nothing to the worker, so a
scrape costs no engine time; building and encoding one at 64 requests in flight
costs about a millisecond of the proxy's loop (``benchmarks/tracing_cost.py``,
``docs/status.md``).

``?stream=true`` answers an SSE stream, one ``data: <snapshot>`` event every
``interval`` seconds (default 1, from ``MIN_INTERVAL_S`` to ``MAX_INTERVAL_S``)
until the client leaves or the proxy starts draining. At most
``MAX_STATUS_STREAMS`` at once; one more is 429 ``too_many_requests``. A
reader that does not keep up holds the next snapshot back, never a growing
backlog, and one that takes nothing for ``stalled_client_timeout`` seconds is
cut (``proxy.server.sse.TransportWriter.take_or_cut``, the rule of every
stream, counting the bytes the kernel holds too: ``STATUS_BACKLOG_BYTES``),
freeing its slot. ``HEAD`` answers the headers alone (RFC 9110
§9.3.2), without a slot.

Behind the API key when keys are configured (not one of
``proxy.server.probes.PROBE_PATHS``): it shows request ids and counts, not
content, and with keys only the asking key's requests (the others counted by
stage, ``Status.others``): their prompt and cached counts, prefill progress and
first-token times would tell one tenant what another's prompts share with its
own, the side channel ``cache_isolation: key`` closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import msgspec
from aiohttp import web

from proxy.errors import InvalidRequest, StalledClient, TooManyRequests, quoted
from proxy.ops.inflight import INFLIGHT, InFlight, Stage, Tracked, View
from proxy.ops.status_types import (
    OthersStatus,
    PrefillStatus,
    ProxyStatus,
    QueueStatus,
    RequestStatus,
    Status,
    TotalsStatus,
    WorkerStatus,
)
from proxy.server import sse
from proxy.server.intake import KEY_DIGEST
from proxy.server.state import STATE, ProxyState

log = logging.getLogger(__name__)

PATH = "/v1/status"

DEFAULT_INTERVAL_S = 1.0
MIN_INTERVAL_S = 0.25
"""The fastest a stream may ask: the worker's queue progress comes at most
every 250 ms (``protocol.messages.QUEUE_PROGRESS_INTERVAL_S``) and heartbeats
slower; faster snapshots would show nothing new."""
MAX_INTERVAL_S = 60.0
STATUS_BACKLOG_BYTES = 64 * 1024
"""Unsent bytes a status stream may have (``sse.TransportWriter.backlog``,
the kernel's queue included) before it waits for its reader: a few dozen
snapshots; a reader that takes none of them within ``stalled_client_timeout``
is cut."""

MAX_STATUS_STREAMS = 8
"""``?stream=true`` readers at once (a terminal or two per operator); beyond it, 429."""

_ORDER = {Stage.DECODE: 0, Stage.PREFILL: 1, Stage.QUEUED: 2, Stage.SUBMITTED: 3, Stage.DONE: 4}

_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class _Streams:
    open: int = 0


_STREAMS: web.AppKey[_Streams] = web.AppKey("status_streams", _Streams)


def add_status_routes(app: web.Application) -> None:
    """Register ``GET /v1/status``. The app must hold ``proxy.server.state.STATE`` and
    ``proxy.ops.inflight.INFLIGHT``."""
    app[_STREAMS] = _Streams()
    app.router.add_get(PATH, status)


def _round(x: float, digits: int = 3) -> float:
    return round(x, digits)


def request_status(t: Tracked, v: View, now: float) -> RequestStatus:
    """The entry of request ``t`` whose ``view()`` is ``v``, at ``now`` (``time.monotonic()``)."""
    gen = t.gen
    queue = prefill = None
    if v.queue is not None:
        q = v.queue
        queue = QueueStatus(
            position=q.position,
            queued=q.queued,
            waited_s=_round(now - t.submitted_at),
            eta_s=q.eta_ms / 1000 if q.eta_ms is not None else None,
        )
    if v.stage is Stage.PREFILL:
        p = v.prefill
        if p is not None:
            computed = p.processed - p.cached
            prefill = PrefillStatus(
                processed=p.processed,
                total=p.total,
                cached=p.cached,
                elapsed_s=p.time_ms / 1000,
                rate_tok_s=_round(computed * 1000 / p.time_ms, 1) if p.time_ms > 0 else None,
            )
        else:  # admitted, no progress event yet: nothing computed
            prefill = PrefillStatus(
                processed=v.cached_tokens,
                total=v.prompt_tokens,
                cached=v.cached_tokens,
                elapsed_s=0.0,
                rate_tok_s=None,
            )
    first = gen.first_token_at
    decode_rate = None
    if first is not None and now > first:
        after_first = v.completion_tokens - sum(1 for c in gen.choices if c.generating)
        decode_rate = _round(max(after_first, 0) / (now - first), 2)
    return RequestStatus(
        id=t.request_id,
        dialect=t.dialect,
        endpoint=t.endpoint,
        stream=t.stream,
        choices=t.choices,
        stage=str(v.stage),
        age_s=_round(now - t.record.arrived),
        queue=queue,
        prefill=prefill,
        prompt_tokens=v.prompt_tokens,
        cached_tokens=v.cached_tokens,
        completion_tokens=v.completion_tokens,
        decode_tok_s=decode_rate,
        ttft_s=_round(first - t.record.arrived) if first is not None else None,
        draft_accepted=v.draft_accepted,
        draft_rejected=v.draft_rejected,
        correlation_id=t.record.correlation_id(),
        phase=("thinking" if v.thinking else "answering") if v.stage is Stage.DECODE else None,
        reasoning_tokens=v.reasoning_tokens,
    )


def worker_status(state: ProxyState, now: float) -> WorkerStatus | None:
    """The worker's entry, ``None`` before its first handshake."""
    engine = state.engine
    ready = engine.worker
    if ready is None:
        return None
    hb = engine.heartbeat if engine.ready else None
    hb_at = engine.heartbeat_at if hb is not None else None
    since = engine.worker_since
    usage = hb.kv_cache_usage if hb is not None else None
    return WorkerStatus(
        up=engine.ready,
        worker_id=ready.worker_id,
        model=state.model_name() or ready.model_id,
        backend=ready.backend,
        drafting=ready.drafting,
        max_context_tokens=ready.max_context_tokens,
        batch_slots=ready.max_batch_size,
        running=hb.active_requests if hb is not None else None,
        kv_cache_tokens=ready.kv_cache_tokens,
        kv_cache_usage=round(usage, 4) if usage is not None else None,
        kv_cache_used_tokens=round(usage * ready.kv_cache_tokens) if usage is not None else None,
        queued=hb.waiting_requests if hb is not None else None,
        max_queue=ready.max_queue,
        step_s=_round(hb.step_s) if hb is not None else None,
        heartbeat_age_s=_round(now - hb_at) if hb_at is not None else None,
        uptime_s=_round(now - since, 1) if since is not None else None,
        kernels=ready.kernels,
    )


def snapshot(state: ProxyState, inflight: InFlight, streams: int = 0, viewer: bytes | None = None) -> Status:
    """The server's state now (module docstring); requests by stage (decode,
    prefill, queued by position, submitted), oldest first within one. With a
    ``viewer`` (the digest of the API key asking), only that key's requests
    are listed, the others' counted by stage (``Status.others``)."""
    now = time.monotonic()
    totals = dataclasses.replace(inflight.totals)  # closed requests, plus those in flight so far
    requests: list[RequestStatus] = []
    others = OthersStatus() if viewer is not None else None
    for t in inflight.requests.values():
        v = t.view()
        totals.add_tokens(v)
        if others is not None and t.key != viewer:
            others.requests += 1
            stage = str(v.stage)
            if stage in ("decode", "prefill", "queued", "submitted"):
                setattr(others, stage, getattr(others, stage) + 1)
            continue
        requests.append(request_status(t, v, now))
    requests.sort(
        key=lambda r: (
            _ORDER[Stage(r.stage)],
            r.queue.position if r.queue is not None else 0,
            -r.age_s,
        )
    )
    return Status(
        time=time.time(),
        proxy=ProxyStatus(
            uptime_s=_round(time.time() - state.started_at, 1),
            in_flight=state.in_flight,
            max_in_flight=state.settings.max_in_flight,
            draining=state.draining,
            status_streams=streams,
        ),
        worker=worker_status(state, now),
        totals=TotalsStatus(**dataclasses.asdict(totals)),
        requests=requests,
        others=others,
    )


def _query(request: web.Request) -> tuple[bool, float]:
    q = request.query
    raw = q.get("stream", "false").lower()
    if raw not in ("true", "1", "false", "0"):
        raise InvalidRequest(f"'stream' must be true or false, not {quoted(raw)}", param="stream")
    stream = raw in ("true", "1")
    interval = DEFAULT_INTERVAL_S
    if "interval" in q:
        try:
            interval = float(q["interval"])
        except ValueError:
            interval = float("nan")
        if not MIN_INTERVAL_S <= interval <= MAX_INTERVAL_S:
            raise InvalidRequest(
                f"'interval' must be a number of seconds from {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g}",
                param="interval",
            )
    return stream, interval


async def status(request: web.Request) -> web.StreamResponse:
    """``GET /v1/status[?stream=true&interval=S]`` (module docstring). Raises
    ``InvalidRequest`` (400) for a bad query, ``TooManyRequests`` (429) beyond
    ``MAX_STATUS_STREAMS`` streams."""
    state = request.app[STATE]
    inflight = request.app[INFLIGHT]
    streams = request.app[_STREAMS]
    stream, interval = _query(request)
    viewer = request.get(KEY_DIGEST)
    if not stream:
        body = _encode(snapshot(state, inflight, streams.open, viewer))
        return web.Response(body=body, content_type="application/json")
    if streams.open >= MAX_STATUS_STREAMS:
        raise TooManyRequests(
            f"{streams.open} status streams are open; this server allows {MAX_STATUS_STREAMS} at once "
            "(GET /v1/status without stream=true is not limited)"
        )
    if request.method == "HEAD":
        # RFC 9110 section 9.3.2: the headers a GET would get, no body; no stream slot.
        return web.Response(headers=sse.HEADERS)
    streams.open += 1
    try:
        resp = web.StreamResponse(headers=sse.HEADERS)
        writer = await resp.prepare(request)
        assert writer is not None
        stalled_s = state.settings.stalled_client_timeout
        try:
            out = sse.TransportWriter(request, resp, writer)
            while True:
                data = sse.escape_line_separators(_encode(snapshot(state, inflight, streams.open, viewer)))
                if not out.write([b"data: " + data + b"\n\n"]):
                    raise ConnectionResetError("the client went away")
                if out.congested or out.backlog() > STATUS_BACKLOG_BYTES:
                    # A follower that reads nothing is cut like any stalled reader.
                    await out.take_or_cut(STATUS_BACKLOG_BYTES, stalled_s)
                if state.draining:
                    break
                await asyncio.sleep(interval)
            await resp.write_eof()
        except StalledClient as e:
            log.warning("cut a status stream: %s", e.message)
            out.abort()
        except ConnectionResetError:
            pass
        return resp
    finally:
        streams.open -= 1
