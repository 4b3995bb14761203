"""Shared helpers for the ExLlamaV3 backend tests: drive a backend, record the raw
engine results, and check the per-request event contract of ``protocol.messages``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from engine_worker.admission import checked_prepare
from engine_worker.exllamav3.backend import ExLlamaV3Backend
from engine_worker.settings import WorkerSettings
from protocol.messages import (
    ChatMessage,
    Event,
    Finished,
    PrefillProgress,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
)
from tests.fakes import exllamav3 as fx


class RecordingGenerator:
    """Passes calls to a generator and keeps every ``iterate()`` result list. A rebuild
    (``EngineHandle.rebuild_generator``) swaps ``inner`` and keeps recording."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.batches: list[list[dict[str, Any]]] = []

    def enqueue(self, job: Any) -> int:
        return int(self.inner.enqueue(job))

    def cancel(self, job: Any) -> None:
        self.inner.cancel(job)

    def iterate(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.inner.iterate()
        self.batches.append(out)
        return out

    def num_remaining_jobs(self) -> int:
        return int(self.inner.num_remaining_jobs())

    @property
    def pending_jobs(self) -> list[Any]:
        return list(self.inner.pending_jobs)

    @property
    def pagetable(self) -> Any:
        return self.inner.pagetable

    @property
    def results(self) -> list[dict[str, Any]]:
        return [r for b in self.batches for r in b]


def add(backend: ExLlamaV3Backend, submit: Submit) -> None:
    """Validate, ``prepare`` and ``start`` one request under its own id, as the
    worker loop does with a request it admits at once (``checked_prepare``)."""
    backend.start(submit.request_id, checked_prepare(backend, submit), submit.params)


def make_backend(
    config: WorkerSettings | None = None, **handle_kwargs: Any
) -> tuple[ExLlamaV3Backend, RecordingGenerator]:
    """A backend over ``fx.make_handle(**handle_kwargs)`` whose generator records its results."""
    handle = fx.make_handle(**handle_kwargs)
    rec = RecordingGenerator(handle.generator)
    rebuild = handle.rebuild_generator

    def rebuild_recorded() -> RecordingGenerator:
        rec.inner = rebuild()
        return rec

    handle = dataclasses.replace(handle, generator=rec, rebuild_generator=rebuild_recorded)
    cfg = config or WorkerSettings(backend="exllamav3", model_dir=Path("/models/fake-exl3"))
    return ExLlamaV3Backend(handle, cfg), rec


def run(backend: ExLlamaV3Backend, max_steps: int = 5000) -> list[Event]:
    """Step until no request is active; fails instead of looping forever."""
    events: list[Event] = []
    for _ in range(max_steps):
        if not len(backend.active_ids()):
            return events
        events += backend.step()
    raise AssertionError(f"requests still active after {max_steps} steps")


def chat(rid: str, text: str, **params: Any) -> Submit:
    params.setdefault("max_tokens", 64)
    return Submit(rid, SamplingParams(**params), messages=(ChatMessage("user", text),))


def raw(rid: str, prompt: str, **params: Any) -> Submit:
    params.setdefault("max_tokens", 64)
    return Submit(rid, SamplingParams(**params), prompt=prompt)


def of(events: list[Event], rid: str) -> list[Event]:
    return [e for e in events if e.request_id == rid]


def text_of(events: list[Event], rid: str) -> str:
    return "".join(e.text for e in of(events, rid) if isinstance(e, TokenDelta))


def finished(events: list[Event], rid: str) -> Finished:
    fins = [e for e in of(events, rid) if isinstance(e, Finished)]
    assert len(fins) == 1, of(events, rid)
    return fins[0]


def progress(events: list[Event], rid: str) -> list[int]:
    return [e.processed for e in of(events, rid) if isinstance(e, PrefillProgress)]


def check_lifecycle(events: list[Event], rid: str) -> None:
    """The order ``protocol.messages`` promises for one request that ran to the end:
    ``Started``; progress from ``processed == cached`` strictly rising to ``total``,
    non-decreasing ``time_ms``; non-empty ``TokenDelta``s; one terminal event, last."""
    evs = of(events, rid)
    assert evs, f"no events for {rid}"
    *body, last = evs
    assert isinstance(last, Finished | RequestError), evs
    assert not any(isinstance(e, Finished | RequestError) for e in body), evs
    if isinstance(last, RequestError) and not body:
        return
    first = body[0]
    assert isinstance(first, Started), evs
    prog = [e for e in body if isinstance(e, PrefillProgress)]
    assert not any(isinstance(e, Started) for e in body[1:]), evs
    assert prog and prog[0].processed == first.cached_tokens == prog[0].cached, evs
    assert all(p.total == first.prompt_tokens and p.cached == first.cached_tokens for p in prog)
    assert [p.processed for p in prog] == sorted({p.processed for p in prog}), "processed must rise"
    assert [p.time_ms for p in prog] == sorted(p.time_ms for p in prog)
    deltas = [i for i, e in enumerate(body) if isinstance(e, TokenDelta)]
    last_prog = max(i for i, e in enumerate(body) if isinstance(e, PrefillProgress))
    if deltas or isinstance(last, Finished):
        assert prog[-1].processed == first.prompt_tokens, evs
        assert not deltas or last_prog < deltas[0], "progress after the first token"
    assert all(body[i].text for i in deltas), "empty TokenDelta"  # type: ignore[union-attr]
