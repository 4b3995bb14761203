"""A scripted ``EngineClient`` and helpers to drive the proxy without a worker."""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from protocol import (
    PROTOCOL_VERSION,
    Detokenize,
    Detokenized,
    Event,
    Finished,
    FinishReason,
    Heartbeat,
    PrefillProgress,
    Ready,
    Started,
    Submit,
    TokenDelta,
    Tokenize,
    Tokens,
    choice_ids,
    choice_seed,
)
from proxy.engine.stream import DEFAULT_MAX_MERGED_BYTES, RequestStream
from proxy.errors import EngineDead, EngineNotReady, ProxyError, ShuttingDown
from proxy.settings import ProxySettings

WORKER = Ready(PROTOCOL_VERSION, "worker-1", "fake-model", "fake", 4096, None)


@dataclass(frozen=True)
class Pause:
    """Script step: sleep this many seconds before the next event."""

    seconds: float


@dataclass(frozen=True)
class Gate:
    """Script step: wait until the event is set (never set: hang, e.g. mid-prefill)."""

    event: asyncio.Event


Step = Event | Pause | Gate
Script = Callable[[Submit], Sequence[Step]]
"""Called once per choice with that choice's ``Submit`` (``request_id`` its
choice id, ``n == 1``, its own seed), as the worker fans a request out."""


def make_config(**overrides: object) -> ProxySettings:
    """A config whose ZeroMQ addresses are never used (the fake has no sockets)."""
    kw: dict[str, object] = {"input_addr": "inproc://unused-in", "output_addr": "inproc://unused-out"}
    kw.update(overrides)
    return ProxySettings(**kw)  # type: ignore[arg-type]


def completion_events(
    rid: str,
    texts: Sequence[str],
    *,
    prompt_tokens: int = 10,
    cached_tokens: int = 0,
    chunk: int = 4,
    tokens_per_text: int = 1,
    finish_reason: FinishReason = FinishReason.STOP,
    draft: tuple[int, int] | None = None,
    times: tuple[float, float, float] = (0.01, 0.25, 0.5),
) -> list[Event]:
    """The event sequence a backend emits for one request: ``Started``, progress
    from ``cached_tokens`` to ``prompt_tokens`` in steps of ``chunk`` (time_ms =
    10 per chunk), one ``TokenDelta`` per text, ``Finished`` with
    ``len(texts) * tokens_per_text`` completion tokens."""
    events: list[Event] = [Started(rid, prompt_tokens, cached_tokens)]
    processed = cached_tokens
    events.append(PrefillProgress(rid, prompt_tokens, cached_tokens, processed, 0))
    step = 0
    while processed < prompt_tokens:
        processed = min(prompt_tokens, processed + chunk)
        step += 1
        events.append(PrefillProgress(rid, prompt_tokens, cached_tokens, processed, 10 * step))
    events += [TokenDelta(rid, t, tokens_per_text) for t in texts]
    events.append(
        Finished(
            rid,
            finish_reason,
            prompt_tokens,
            cached_tokens,
            len(texts) * tokens_per_text,
            draft[0] if draft else None,
            draft[1] if draft else None,
            *times,
        )
    )
    return events


def static_script(texts: Sequence[str], **kw: object) -> Script:
    """Every choice gets ``completion_events(submit.request_id, texts, **kw)``."""

    def script(submit: Submit) -> list[Step]:
        return list(completion_events(submit.request_id, texts, **kw))  # type: ignore[arg-type]

    return script


def fake_token_ids(submit: Submit) -> tuple[int, ...]:
    """The fake's tokenization: one id (a checksum) per whitespace-separated
    word of the prompt, or of ``role: content`` for each message."""
    text = (
        submit.prompt
        if submit.prompt is not None
        else " ".join(f"{m.role}: {m.content}" for m in submit.messages)
    )
    return tuple(zlib.crc32(w.encode()) % 50_000 for w in text.split())


def choice_submits(submit: Submit) -> list[Submit]:
    """The per-choice view of ``submit`` the worker runs: one ``Submit`` per
    ``choice_ids`` entry, ``n == 1``, seed ``choice_seed(seed, i)``."""
    seed = submit.params.seed
    return [
        msgspec.structs.replace(
            submit,
            request_id=rid,
            n=1,
            params=submit.params
            if seed is None
            else msgspec.structs.replace(submit.params, seed=choice_seed(seed, i)),
        )
        for i, rid in enumerate(choice_ids(submit.request_id, submit.n))
    ]


@dataclass(eq=False)
class FakeEngineClient:
    """``EngineClient`` that plays ``script(choice)`` for each choice of each
    submitted request on its own task, records submits (``submits``: one per
    HTTP request; ``choices``: one per choice) and aborts, and can be killed
    mid-stream. ``waiting_requests``/``kv_cache_usage``/``running_requests``/
    ``kv_events_dropped`` are what its heartbeat reports; ``heartbeat_at``/``worker_since``
    what the engine client's are."""

    script: Script = field(default_factory=lambda: static_script(["Hello", " world"]))
    is_ready: bool = True
    worker_ready: Ready | None = WORKER
    queue_max: int = 256
    max_merged_bytes: int = DEFAULT_MAX_MERGED_BYTES
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    running_requests: int | None = None
    kv_events_dropped: int = 0
    heartbeat_at: float | None = None
    worker_since: float | None = None
    submits: list[Submit] = field(default_factory=list)
    choices: list[Submit] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    lookups: list[Tokenize | Detokenize] = field(default_factory=list)
    started: bool = False
    closed: bool = False
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _streams: list[RequestStream] = field(default_factory=list)
    _abort_seen: asyncio.Event = field(default_factory=asyncio.Event)
    _submit_seen: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ready(self) -> bool:
        return self.is_ready

    @property
    def worker(self) -> Ready | None:
        return self.worker_ready

    @property
    def worker_active_requests(self) -> int | None:
        return len(self._tasks)

    @property
    def heartbeat(self) -> Heartbeat | None:
        worker_id = self.worker_ready.worker_id if self.worker_ready is not None else "?"
        running, waiting = len(self._tasks), self.waiting_requests
        return Heartbeat(
            worker_id,
            running,
            waiting,
            self.kv_cache_usage,
            0.0,
            self.running_requests,
            self.kv_events_dropped,
        )

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True
        for t in self._tasks.values():
            t.cancel()
        self.kill(ShuttingDown("closed"))

    def submit(self, *submits: Submit) -> RequestStream:
        if not self.is_ready:
            raise EngineNotReady("fake not ready")
        choices = [c for submit in submits for c in choice_submits(submit)]
        stream = RequestStream(
            [c.request_id for c in choices], self.queue_max, max_merged_bytes=self.max_merged_bytes
        )
        self._streams.append(stream)
        self.submits.extend(submits)
        for c in choices:
            self.choices.append(c)
            self._tasks[c.request_id] = asyncio.create_task(self._play(c, stream))
        self._submit_seen.set()
        return stream

    async def _play(self, submit: Submit, stream: RequestStream) -> None:
        for step in self.script(submit):
            if isinstance(step, Pause):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, Gate):
                await step.event.wait()
            else:
                stream.put(step)
                await asyncio.sleep(0)

    def lookup(self, msg: Tokenize | Detokenize) -> RequestStream:
        """Answers at once: ``Tokens`` with one id per whitespace-separated word
        of the prompt (``fake_token_ids``), ``Detokenized`` as ``t<id>`` words."""
        if not self.is_ready:
            raise EngineNotReady("fake not ready")
        self.lookups.append(msg)
        if isinstance(msg, Tokenize):
            rid = msg.submit.request_id
            answer: Event = Tokens(rid, fake_token_ids(msg.submit))
        else:
            rid = msg.request_id
            answer = Detokenized(rid, " ".join(f"t{t}" for t in msg.token_ids))
        stream = RequestStream([rid], self.queue_max)
        stream.put(answer)
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.aborted.append(rid)
            task = self._tasks.get(rid)
            if task is not None:
                task.cancel()
        self._abort_seen.set()

    def kill(self, exc: ProxyError | None = None) -> None:
        """Fail every stream, as the real client does when the worker dies."""
        for s in self._streams:
            s.fail(exc or EngineDead("fake worker died"))

    async def wait_abort(self, timeout_s: float = 10.0) -> list[str]:
        """Wait for the first ``abort`` call (a safety limit, not a speed check)."""
        async with asyncio.timeout(timeout_s):
            await self._abort_seen.wait()
        return self.aborted

    async def wait_submits(self, count: int, timeout_s: float = 10.0) -> None:
        """Wait until ``count`` requests were submitted."""
        async with asyncio.timeout(timeout_s):
            while len(self.submits) < count:
                self._submit_seen.clear()
                await self._submit_seen.wait()

    async def cancel_all(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        for t in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await t
