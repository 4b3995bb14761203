"""The worker loop on real ZeroMQ sockets with a scripted backend."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine_worker.backend import ModelInfo
from engine_worker.loop import EngineLoop
from engine_worker.sockets import WorkerSockets
from engine_worker.waiting import QueueRate
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    ChatMessage,
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    Heartbeat,
    Hello,
    QueueProgress,
    Ready,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
    WorkerMessage,
)
from protocol.liveness import check, read_beat
from tests.fakes.scripted_worker import Peer, ScriptedBackend

Running = tuple[ScriptedBackend, Peer, EngineLoop]


@contextlib.contextmanager
def serve_loop(
    tmp_path: Path,
    info: ModelInfo | None = None,
    stop: threading.Event | None = None,
    backend: Any = None,
    **loop_kw: Any,
) -> Iterator[Running]:
    """A loop on its own thread over ``backend`` (default: a ``ScriptedBackend`` with
    ``info``), and a peer whose Hello has been answered; ``stop`` stops the loop early."""
    addrs = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    backend = backend or ScriptedBackend(info or ModelInfo("scripted", 1000, None))
    sockets = WorkerSockets(*addrs)
    kw: dict[str, Any] = {"heartbeat_interval": 0.05, "max_queue": 16} | loop_kw
    loop = EngineLoop(backend, sockets, **kw)
    stop = stop or threading.Event()
    peer = Peer(*addrs)
    t = threading.Thread(target=loop.run, args=(stop,), name="engine-loop")
    t.start()
    try:
        # As the proxy does: repeat Hello until a Ready proves both pipes are up
        # (a Ready sent before the output pipe is attached is dropped).
        for _ in range(50):
            peer.send(Hello(PROTOCOL_VERSION, "fixture"))
            try:
                _first(peer, Ready, timeout_s=0.1)
                break
            except TimeoutError:
                continue
        drain_until = time.monotonic() + 0.2  # answers to the other Hellos
        while time.monotonic() < drain_until:
            if peer.pull.poll(10):
                peer.recv()
        yield backend, peer, loop
    finally:
        stop.set()
        t.join(5)
        sockets.close()
        peer.close()
        assert not t.is_alive()
        if isinstance(backend, ScriptedBackend):
            assert backend.thread_ids <= {t.ident}, "engine state touched from another thread"
            assert t.ident not in backend.prepare_thread_ids, "prepare ran on the loop thread"


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    with serve_loop(tmp_path) as r:
        yield r


def _submit(rid: str, prompt: str = "p", max_tokens: int = 3) -> Submit:
    return Submit(rid, SamplingParams(max_tokens), prompt=prompt)


def _first(peer: Peer, kind: type, timeout_s: float = 5.0) -> WorkerMessage:
    deadline = time.monotonic() + timeout_s
    while True:
        msg = peer.recv(max(0.0, deadline - time.monotonic()))
        if isinstance(msg, kind):
            return msg


def test_handshake_answers_hello_with_ready(running: tuple[ScriptedBackend, Peer, EngineLoop]) -> None:
    _, peer, loop = running
    peer.send(Hello(PROTOCOL_VERSION, "p"))
    ready = _first(peer, Ready)
    assert isinstance(ready, Ready)
    assert ready.protocol_version == PROTOCOL_VERSION
    assert ready.worker_id == loop.worker_id
    assert (ready.model_id, ready.max_context_tokens, ready.backend) == ("scripted", 1000, "ScriptedBackend")


def test_requests_interleave_and_finish(running: tuple[ScriptedBackend, Peer, EngineLoop]) -> None:
    _, peer, _ = running
    peer.send(_submit("a", max_tokens=3))
    peer.send(_submit("b", max_tokens=2))
    events = peer.events_until_terminal({"a", "b"})
    for rid, n in (("a", 3), ("b", 2)):
        mine = [e for e in events if getattr(e, "request_id", None) == rid]
        assert isinstance(mine[-1], Finished) and mine[-1].completion_tokens == n
        assert [type(e).__name__ for e in mine] == ["Started", "PrefillProgress", "PrefillProgress"] + [
            "TokenDelta"
        ] * n + ["Finished"]


def test_rejected_request_becomes_error_event(running: tuple[ScriptedBackend, Peer, EngineLoop]) -> None:
    _, peer, _ = running
    peer.send(_submit("bad", prompt="reject"))
    peer.send(_submit("good", max_tokens=1))
    events = peer.events_until_terminal({"bad", "good"})
    errors = [e for e in events if isinstance(e, RequestError)]
    assert errors == [RequestError("bad", ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")]
    assert any(isinstance(e, Finished) and e.request_id == "good" for e in events)


def test_unexpected_admission_failure_fails_only_that_request(
    running: tuple[ScriptedBackend, Peer, EngineLoop],
) -> None:
    _, peer, _ = running
    peer.send(_submit("bad", prompt="buggy"))
    peer.send(_submit("good", max_tokens=1))
    events = peer.events_until_terminal({"bad", "good"})
    (err,) = [e for e in events if isinstance(e, RequestError)]
    assert err.request_id == "bad" and err.code == ErrorCode.INTERNAL and "tokenizer bug" in err.message
    assert any(isinstance(e, Finished) and e.request_id == "good" for e in events)


def test_duplicate_request_id_is_refused(running: tuple[ScriptedBackend, Peer, EngineLoop]) -> None:
    _, peer, _ = running
    # Long enough to still be active whenever the second Submit arrives.
    peer.send(_submit("dup", max_tokens=10**9))
    peer.send(_submit("dup", max_tokens=1))
    msg = _first(peer, EventBatch)
    events = list(msg.events)  # type: ignore[attr-defined]
    while not any(isinstance(e, RequestError) for e in events):
        events += _first(peer, EventBatch).events  # type: ignore[attr-defined]
    err = next(e for e in events if isinstance(e, RequestError))
    assert err.code == ErrorCode.INVALID_REQUEST and err.request_id == "dup"
    peer.send(Abort(("dup",)))


def test_abort_stops_events_with_one_terminal_error(running: Running) -> None:
    backend, peer, _ = running
    peer.send(_submit("long", max_tokens=10**9))
    _first(peer, EventBatch)
    peer.send(Abort(("long", "unknown")))
    events = peer.events_until_terminal({"long"})
    assert backend.aborted == ["long"]  # unknown ids never reach the backend
    end = events[-1]
    assert isinstance(end, RequestError) and end.request_id == "long" and end.code is ErrorCode.ABORTED
    assert "aborted" in end.message
    # After it, no event for the request arrives any more.
    peer.send(_submit("after", max_tokens=1))
    later = peer.events_until_terminal({"after"})
    assert not [e for e in later if getattr(e, "request_id", None) in ("long", "unknown")]


def test_aborting_one_choice_of_a_queued_request_ends_all_its_choices(tmp_path: Path) -> None:
    """A queued request leaves whole: the choice the Abort did not name must not be
    left waiting for an event that never comes."""
    info = ModelInfo("scripted", 1000, None, max_batch_size=2)
    with serve_loop(tmp_path, info) as (backend, peer, _):
        peer.send(_submit("a", max_tokens=10**6))
        _wait(lambda: "a" in backend.remaining, "a started")
        peer.send(Submit("b", SamplingParams(3), prompt="p", n=2))  # needs both slots: waits
        _wait(lambda: backend.prepared[-1:] == ["b"], "b prepared")
        time.sleep(0.2)
        peer.send(Abort(("b-0",)))
        events = peer.events_until_terminal({"b-0", "b-1"})
        peer.send(Abort(("a",)))
        peer.events_until_terminal({"a"})
    ends = {e.request_id: e for e in events if isinstance(e, RequestError)}
    assert set(ends) == {"b-0", "b-1"} and all(e.code is ErrorCode.ABORTED for e in ends.values())
    assert [rid for rid, _ in backend.started] == ["a"]


def test_step_failure_fails_active_requests_and_keeps_serving(
    running: tuple[ScriptedBackend, Peer, EngineLoop],
) -> None:
    backend, peer, _ = running
    peer.send(_submit("victim", max_tokens=10**9))
    _first(peer, EventBatch)
    peer.send(_submit("trigger", prompt="explode"))
    events = peer.events_until_terminal({"victim", "trigger"})
    errs = {e.request_id: e for e in events if isinstance(e, RequestError)}
    assert set(errs) == {"victim", "trigger"}
    assert all(e.code == ErrorCode.INTERNAL and "kaboom" in e.message for e in errs.values())
    assert set(backend.aborted) == {"victim", "trigger"}
    peer.send(_submit("next", max_tokens=1))
    assert any(isinstance(e, Finished) for e in peer.events_until_terminal({"next"}))


def test_failing_aborts_after_a_failed_step_do_not_kill_the_loop(
    running: tuple[ScriptedBackend, Peer, EngineLoop],
) -> None:
    backend, peer, _ = running
    backend.broken_cancel = True
    peer.send(_submit("victim", max_tokens=10**9))
    _first(peer, EventBatch)
    peer.send(_submit("trigger", prompt="explode"))
    events = peer.events_until_terminal({"victim", "trigger"})
    assert {e.request_id for e in events if isinstance(e, RequestError)} == {"victim", "trigger"}
    backend.broken_cancel = False
    peer.send(_submit("next", max_tokens=1))
    assert any(isinstance(e, Finished) for e in peer.events_until_terminal({"next"}))


def test_heartbeat_reports_active_requests(running: tuple[ScriptedBackend, Peer, EngineLoop]) -> None:
    _, peer, loop = running
    beat = _first(peer, Heartbeat)
    assert isinstance(beat, Heartbeat)
    assert (beat.worker_id, beat.active_requests) == (loop.worker_id, 0)
    peer.send(_submit("busy", max_tokens=1_000_000))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        beat = _first(peer, Heartbeat)
        if beat.active_requests == 1:  # type: ignore[attr-defined]
            break
    assert beat.active_requests == 1  # type: ignore[attr-defined]
    peer.send(Abort(("busy",)))


def test_hello_of_other_version_gets_no_ready(running: tuple[ScriptedBackend, Peer, EngineLoop]) -> None:
    _, peer, _ = running
    peer.send(Hello(PROTOCOL_VERSION + 1, "future-proxy"))
    peer.send(Hello(PROTOCOL_VERSION, "current-proxy"))
    # Exactly one Ready comes back: for the proxy that speaks our version.
    readies = 0
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        try:
            msg = peer.recv(0.1)
        except TimeoutError:
            continue
        readies += isinstance(msg, Ready)
    assert readies == 1


def test_hellos_queued_while_the_model_loaded_get_one_ready(tmp_path: Path) -> None:
    # The sockets are bound before the model loads; a proxy sends Hello every
    # handshake_interval meanwhile, and the loop finds them all queued when it starts.
    addrs = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    sockets = WorkerSockets(*addrs)
    peer = Peer(*addrs)
    loop = EngineLoop(
        ScriptedBackend(ModelInfo("scripted", 1000, None)), sockets, heartbeat_interval=0.05, max_queue=4
    )
    stop = threading.Event()
    t = threading.Thread(target=loop.run, args=(stop,), name="engine-loop")
    try:
        time.sleep(0.2)  # both pipes attached before the Hellos and the Ready
        for _ in range(20):
            peer.send(Hello(PROTOCOL_VERSION, "p"))
        time.sleep(0.2)  # all queued, as after a load
        t.start()
        readies = 0
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                readies += isinstance(peer.recv(0.1), Ready)
            except TimeoutError:
                continue
        assert readies == 1
    finally:
        stop.set()
        if t.is_alive():
            t.join(5)
        sockets.close()
        peer.close()


# ---------------------------------------------------------------- admission, queue, liveness


def _events_of(events: list[Event], rid: str) -> list[Event]:
    return [e for e in events if getattr(e, "request_id", None) == rid]


def _wait(cond: Any, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_n_choices_are_prepared_once_and_seeded_apart(running: Running) -> None:
    backend, peer, _ = running
    params = SamplingParams(2, seed=2**63 - 1)
    peer.send(Submit("r", params, prompt="p", n=3))
    events = peer.events_until_terminal({"r-0", "r-1", "r-2"})
    assert backend.prepared == ["r"]  # tokenized once for the three choices
    assert backend.started == [("r-0", 2**63 - 1), ("r-1", -(2**63)), ("r-2", -(2**63) + 1)]
    for rid in ("r-0", "r-1", "r-2"):
        mine = _events_of(events, rid)
        assert isinstance(mine[0], Started) and isinstance(mine[-1], Finished)


def test_requests_wait_for_batch_slots_and_start_in_order(tmp_path: Path) -> None:
    info = ModelInfo("scripted", 1000, None, max_batch_size=2)
    with serve_loop(tmp_path, info) as (backend, peer, _):
        peer.send(_submit("a", max_tokens=10**6))
        peer.send(Submit("b", SamplingParams(1), prompt="p", n=2))  # needs both slots
        peer.send(_submit("c", max_tokens=1))  # fits beside a, but waits behind b (FIFO)
        _wait(lambda: "a" in backend.remaining, "a started")
        beat = _first(peer, Heartbeat)
        while beat.waiting_requests != 2:  # type: ignore[attr-defined]
            beat = _first(peer, Heartbeat)
        assert beat.active_requests == 1  # type: ignore[attr-defined]
        assert [rid for rid, _ in backend.started] == ["a"]
        peer.send(Abort(("a",)))
        events = peer.events_until_terminal({"b-0", "b-1", "c"})
        assert [rid for rid, _ in backend.started] == ["a", "b-0", "b-1", "c"]
        assert all(isinstance(_events_of(events, r)[-1], Finished) for r in ("b-0", "b-1", "c"))


def test_queued_requests_get_queue_progress_until_they_start(tmp_path: Path) -> None:
    info = ModelInfo("scripted", 1000, None, max_batch_size=2)
    with serve_loop(tmp_path, info) as (backend, peer, _):
        # a takes one slot; b needs both; c and d would fit beside a but wait
        # behind b (FIFO).
        peer.send(_submit("a", max_tokens=10**6))
        _wait(lambda: "a" in backend.remaining, "a started")
        peer.send(Submit("b", SamplingParams(3), prompt="p", n=2))  # waits as one, for choice b-0
        peer.send(_submit("c", max_tokens=3))
        peer.send(_submit("d", max_tokens=3))
        _wait(lambda: backend.prepared[-1:] == ["d"], "d prepared")
        time.sleep(0.3)
        peer.send(Abort(("c",)))  # a queued request leaves: d moves up, c never starts
        time.sleep(0.3)
        peer.send(Abort(("a",)))
        events = peer.events_until_terminal({"b-0", "b-1", "d"}, timeout_s=10)
    queue = [e for e in events if isinstance(e, QueueProgress)]
    assert {e.request_id for e in queue} == {"b-0", "c", "d"}  # choice 0 only; a started at once
    for rid, first in (("b-0", 1), ("c", 2), ("d", 3)):
        mine = [e for e in queue if e.request_id == rid]
        assert mine[0].position == first
        assert [e.position for e in mine] == sorted((e.position for e in mine), reverse=True)
        assert [e.time_ms for e in mine] == sorted(e.time_ms for e in mine)
        started = [i for i, e in enumerate(events) if isinstance(e, Started) and e.request_id == rid]
        if started:  # none after the request started
            assert all(events.index(e) < started[0] for e in mine)
    d_positions = [e.position for e in queue if e.request_id == "d"]
    assert 2 in d_positions and d_positions[-1] == 1  # moved up past the aborted c, then past b
    assert "c" not in [rid for rid, _ in backend.started]
    assert [rid for rid, _ in backend.started] == ["a", "b-0", "b-1", "d"]
    # time_queued counts the wait in the worker's queue, not only the backend's.
    (d_done,) = [e for e in events if isinstance(e, Finished) and e.request_id == "d"]
    assert d_done.time_queued >= 0.6  # queued before the two 0.3 s sleeps above


def test_queue_rate_estimates_only_from_a_steady_rate() -> None:
    rate = QueueRate()
    assert rate.eta(1, 0.0) is None
    for t in (10.0, 11.0, 12.0):
        rate.departed(t)
    assert rate.eta(1, 12.0) == pytest.approx(1.0)
    assert rate.eta(3, 12.5) == pytest.approx(2.5)  # 12 + 3 * 1.0 - 12.5
    assert rate.eta(1, 15.5) is None  # 3.5 s since the last departure: the rate is stale


def test_kv_budget_admits_what_fits_and_refuses_what_never_fits(tmp_path: Path) -> None:
    info = ModelInfo("scripted", 1000, None, kv_cache_tokens=100, max_batch_size=8)
    with serve_loop(tmp_path, info) as (backend, peer, _):
        peer.send(_submit("x", max_tokens=10**2 - 40))  # reserves 64 of 100
        peer.send(_submit("y", max_tokens=50))  # 54: waits for x
        peer.send(_submit("huge", max_tokens=97))  # 101 > 100: can never fit
        peer.send(Submit("many", SamplingParams(30), prompt="p", n=9))  # n over max_batch_size
        events = peer.events_until_terminal({"huge", "many-0", "x", "y"})
        huge = _events_of(events, "huge")[-1]
        assert isinstance(huge, RequestError) and huge.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED
        assert "101 tokens of KV cache" in huge.message and huge.param == "prompt"
        many = [e for e in events if isinstance(e, RequestError) and e.request_id.startswith("many")]
        assert len(many) == 9 and all(e.code == ErrorCode.INVALID_REQUEST and e.param == "n" for e in many)
        # y started only once x had finished and released its reservation.
        assert [rid for rid, _ in backend.started] == ["x", "y"]
        x_done = events.index(_events_of(events, "x")[-1])
        y_started = events.index(next(e for e in _events_of(events, "y") if isinstance(e, Started)))
        assert x_done < y_started


def test_a_full_queue_refuses_at_once_with_queue_full(tmp_path: Path) -> None:
    info = ModelInfo("scripted", 1000, None, max_batch_size=1)
    with serve_loop(tmp_path, info, max_queue=1) as (_, peer, _):
        peer.send(_submit("run", max_tokens=10**6))
        peer.send(_submit("wait", max_tokens=1))
        peer.send(_submit("over", max_tokens=1))
        (err,) = [e for e in peer.events_until_terminal({"over"}) if isinstance(e, RequestError)]
        assert err.request_id == "over" and err.code == ErrorCode.QUEUE_FULL and "max_queue" in err.message
        peer.send(Abort(("run",)))
        assert isinstance(_events_of(peer.events_until_terminal({"wait"}), "wait")[-1], Finished)


def test_an_aborted_queued_request_never_starts_and_the_next_moves_up(tmp_path: Path) -> None:
    info = ModelInfo("scripted", 1000, None, max_batch_size=1)
    with serve_loop(tmp_path, info) as (backend, peer, _):
        peer.send(_submit("run", max_tokens=10**6))
        peer.send(_submit("gone", max_tokens=1))
        peer.send(_submit("next", max_tokens=1))
        _wait(lambda: "run" in backend.remaining, "run started")
        peer.send(Abort(("gone",)))
        peer.send(Abort(("run",)))
        events = peer.events_until_terminal({"next"})
        assert "gone" not in [rid for rid, _ in backend.started]
        # Only its place in the queue was ever reported, then its end.
        gone = _events_of(events, "gone")
        assert all(isinstance(e, QueueProgress) for e in gone[:-1])
        assert isinstance(gone[-1], RequestError) and gone[-1].code is ErrorCode.ABORTED


def test_heartbeats_keep_flowing_during_a_long_step(tmp_path: Path) -> None:
    with serve_loop(tmp_path) as (backend, peer, loop):
        backend.slow_step_s = 1.0
        peer.send(_submit("slow", prompt="slow", max_tokens=2))
        beats: list[Heartbeat] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(b.step_s > 0.5 for b in beats):
            msg = peer.recv()
            if isinstance(msg, Heartbeat):
                beats.append(msg)
        # Sent from the heartbeat thread while the loop thread sat in one step.
        long_step = [b for b in beats if b.step_s > 0]
        assert len(long_step) >= 5 and max(b.step_s for b in long_step) > 0.5
        assert all(b.worker_id == loop.worker_id and b.active_requests == 1 for b in long_step)


def test_stopping_fails_running_and_queued_requests(tmp_path: Path) -> None:
    info = ModelInfo("scripted", 1000, None, max_batch_size=1)
    stop = threading.Event()
    with serve_loop(tmp_path, info, stop=stop) as (backend, peer, loop):
        peer.send(_submit("run", max_tokens=10**6))
        peer.send(_submit("queued", max_tokens=1))
        _wait(lambda: "run" in backend.remaining and loop._stats.waiting == 1, "one running, one queued")
        stop.set()
        events = peer.events_until_terminal({"run", "queued"})
        errors = {e.request_id: e.code for e in events if isinstance(e, RequestError)}
        assert errors == {"run": ErrorCode.OVERLOADED, "queued": ErrorCode.OVERLOADED}
        assert backend.aborted == ["run"] and [rid for rid, _ in backend.started] == ["run"]


def test_the_loop_stops_when_its_parent_is_gone(tmp_path: Path) -> None:
    addrs = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    backend = ScriptedBackend(ModelInfo("scripted", 1000, None))
    sockets = WorkerSockets(*addrs)
    not_our_parent = os.getppid() + 1_000_000
    loop = EngineLoop(backend, sockets, heartbeat_interval=0.05, max_queue=1, parent_pid=not_our_parent)
    stop = threading.Event()
    t = threading.Thread(target=loop.run, args=(stop,))
    t.start()
    t.join(5)
    sockets.close()
    assert stop.is_set() and not t.is_alive()


def test_a_slow_prepare_does_not_stall_running_sequences(running: Running) -> None:
    _, peer, _ = running
    peer.send(_submit("run", max_tokens=10**6))
    _first(peer, EventBatch)
    t0 = time.monotonic()
    peer.send(_submit("big", prompt="slowprep", max_tokens=1))
    during: list[float] = []
    while True:
        msg = peer.recv()
        if not isinstance(msg, EventBatch):
            continue
        now = time.monotonic() - t0
        if any(isinstance(e, Started) and e.request_id == "big" for e in msg.events):
            break
        during += [now for e in msg.events if isinstance(e, TokenDelta) and e.request_id == "run"]
    # "big" took a second to prepare; "run" kept streaming through it.
    assert len(during) >= 20 and max(during) > 0.8
    peer.send(Abort(("run",)))


def test_features_the_backend_lacks_are_refused_not_ignored(tmp_path: Path) -> None:
    with serve_loop(tmp_path) as (backend, peer, _):
        peer.send(Submit("g", SamplingParams(3, grammar='start: "a"', grammar_param="tools"), prompt="p"))
        peer.send(Submit("l", SamplingParams(3, logprobs=2), prompt="p"))
        events = peer.events_until_terminal({"g", "l"})
    by_id = {e.request_id: e for e in events if isinstance(e, RequestError)}
    assert by_id["g"].code == ErrorCode.INVALID_REQUEST and by_id["g"].param == "tools"
    assert by_id["l"].param == "logprobs"
    assert backend.prepared == []  # refused before any work


def test_heartbeats_count_requests_and_sequences_and_reach_the_heartbeat_file(tmp_path: Path) -> None:
    """A request of 3 choices is 3 running sequences but 1 running request, in the
    message and in the file a probe reads (written by this process, fresh)."""
    beats = tmp_path / "worker.heartbeat"
    info = ModelInfo("scripted", 1000, None, kv_block_tokens=16)
    with serve_loop(tmp_path, info, heartbeat_file=beats) as (_, peer, loop):
        peer.send(Submit("three", SamplingParams(1_000_000), prompt="p", n=3))
        peer.send(_submit("one", max_tokens=1_000_000))
        deadline = time.monotonic() + 5
        beat = _first(peer, Heartbeat)
        while time.monotonic() < deadline and beat.active_requests != 4:  # type: ignore[attr-defined]
            beat = _first(peer, Heartbeat)
        assert isinstance(beat, Heartbeat)
        assert (beat.active_requests, beat.running_requests) == (4, 2)
        written = read_beat(beats)
        assert written is not None and (written.pid, written.worker_id) == (os.getpid(), loop.worker_id)
        assert check(beats, max_age=1.0) is None
        assert check(beats, max_age=1.0, now=written.at + 1.5) is not None  # an old beat is not live
        peer.send(Abort(("three-0", "three-1", "three-2", "one")))


def test_short_requests_pass_a_head_that_does_not_fit_until_it_waited_too_long(tmp_path: Path) -> None:
    """Issue 20's starvation: long reservations fill the KV budget, a long request
    waits at the head, and a short one behind it starts at once (backfilling);
    once the head has waited ``backfill_max_wait``, nothing passes it."""
    info = ModelInfo("scripted", 1000, None, kv_cache_tokens=100, max_batch_size=8)
    with serve_loop(tmp_path, info, backfill_max_wait=0.5) as (backend, peer, _):
        backend.slow_step_s = 0.03  # "slow": 76 steps of the long one take about 2.3 s
        peer.send(_submit("long", "slow", max_tokens=76))  # reserves 80 of 100
        _wait(lambda: "long" in dict(backend.started), "long started")
        peer.send(_submit("head", max_tokens=56))  # 60: waits for long
        peer.send(_submit("short", max_tokens=6))  # 10: fits beside long
        events = peer.events_until_terminal({"short"})
        assert [rid for rid, _ in backend.started] == ["long", "short"]
        assert any(isinstance(e, Started) for e in _events_of(events, "short"))
        time.sleep(0.6)  # the head has now waited past backfill_max_wait
        peer.send(_submit("late", max_tokens=6))  # would fit, but may not pass the head now
        peer.events_until_terminal({"long", "head", "late"}, timeout_s=30)
        assert [rid for rid, _ in backend.started] == ["long", "short", "head", "late"]


def test_strict_fifo_without_backfilling(tmp_path: Path) -> None:
    info = ModelInfo("scripted", 1000, None, kv_cache_tokens=100, max_batch_size=8)
    with serve_loop(tmp_path, info, backfill_max_wait=0.0) as (backend, peer, _):
        backend.slow_step_s = 0.03
        peer.send(_submit("long", "slow", max_tokens=26))
        _wait(lambda: "long" in dict(backend.started), "long started")
        peer.send(_submit("head", max_tokens=76))
        peer.send(_submit("short", max_tokens=6))
        peer.events_until_terminal({"long", "head", "short"}, timeout_s=30)
        assert [rid for rid, _ in backend.started] == ["long", "head", "short"]


def test_the_first_queue_progress_comes_with_the_step_that_prepared_it(tmp_path: Path) -> None:
    # One slot, held by a sequence whose every step takes slow_step_s. A request
    # that arrives during step k is received after it, prepared during step k+1,
    # and must be reported queued with the events of step k+1, not one step later;
    # its time_ms counts from its receipt (before step k+1), not from when it was queued.
    info = ModelInfo("scripted", 1000, None, max_batch_size=1)
    with serve_loop(tmp_path, info) as (backend, peer, _):
        backend.slow_step_s = 0.5
        peer.send(_submit("run", prompt="slow", max_tokens=10**6))
        _wait(lambda: "run" in backend.remaining, "run started")
        _first(peer, EventBatch)  # a step just ended and the next one began
        time.sleep(backend.slow_step_s / 2)  # mid-step k
        t0 = time.monotonic()
        peer.send(_submit("b", max_tokens=1))
        batches = 0
        while True:
            msg = peer.recv()
            if not isinstance(msg, EventBatch):
                continue
            batches += 1
            mine = [e for e in msg.events if isinstance(e, QueueProgress) and e.request_id == "b"]
            if mine:
                waited_s = time.monotonic() - t0
                break
        peer.send(Abort(("run", "b")))
    assert batches == 2, f"first queue_progress in the batch of step k+{batches}, want k+1"
    (first,) = mine
    assert first.position == 1 and first.queued == 1
    # Received after step k ended, reported after step k+1: one step of waiting in the worker.
    assert 0.8 * backend.slow_step_s * 1000 <= first.time_ms <= waited_s * 1000


def test_a_salted_request_is_refused_by_an_engine_that_cannot_keep_salts_apart(tmp_path: Path) -> None:
    with serve_loop(tmp_path) as (backend, peer, _):  # ScriptedBackend: ModelInfo.cache_salt False
        peer.send(msgspec.structs.replace(_submit("s"), cache_salt="tenant"))
        (error,) = _events_of(peer.events_until_terminal({"s"}), "s")
        assert isinstance(error, RequestError) and error.param == "cache_salt"
        assert backend.prepared == []  # refused before any work


def _synthetic() -> Any:
    from engine_worker.settings import WorkerSettings
    from engine_worker.synthetic.backend import SyntheticBackend

    return SyntheticBackend(WorkerSettings(backend="synthetic", max_batch_size=1, synthetic_step_ms=5))


def _exllamav3() -> Any:
    from tests.fakes.exllamav3_driver import make_backend

    return make_backend(max_batch_size=1)[0]


def _cpu() -> Any:
    pytest.importorskip("torch")
    from engine_worker.cpu.backend import CpuBackend
    from engine_worker.settings import WorkerSettings
    from tests.fakes.cpu import load_tokenizer_embedded, tiny_random_llama

    loaded = tiny_random_llama(load_tokenizer_embedded())
    return CpuBackend.from_loaded(loaded, WorkerSettings(max_batch_size=1))


@pytest.mark.parametrize("make", [_synthetic, _exllamav3, _cpu], ids=["synthetic", "exllamav3", "cpu"])
def test_invalid_sampling_is_refused_before_the_queue_on_every_backend(tmp_path: Path, make: Any) -> None:
    """Sampling is validated once, by the loop, when the Submit arrives: a request that
    would fail gets its error with no QueueProgress first, whatever the backend (before,
    ExLlamaV3 checked in ``start``, after the queue, and the synthetic engine never)."""
    backend = make()
    with serve_loop(tmp_path, backend=backend) as (_, peer, _loop):
        peer.send(Submit("run", SamplingParams(10**6, ignore_eos=True), prompt="one two three"))
        _wait(lambda: "run" in backend.active_ids(), "run started")
        bad = SamplingParams(5, temperature=-1.0)
        peer.send(Submit("bad", bad, messages=(ChatMessage("user", "hello there"),)))
        peer.send(Submit("waits", SamplingParams(5), prompt="one two three"))  # queues: one slot
        events = peer.events_until_terminal({"bad"})
        later: list[Event] = []
        deadline = time.monotonic() + 5
        while not any(isinstance(e, QueueProgress) and e.request_id == "waits" for e in events + later):
            msg = peer.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, EventBatch):
                later += msg.events
        peer.send(Abort(("run", "waits")))
    mine = _events_of(events + later, "bad")
    assert len(mine) == 1 and isinstance(mine[0], RequestError)
    assert (mine[0].code, mine[0].param) == (ErrorCode.INVALID_REQUEST, "temperature")


def test_a_slow_lookup_does_not_delay_a_generation_requests_preparation(running: Running) -> None:
    """Lookups have a thread of their own: a request sent after a slow
    ``Tokenize`` starts before its answer comes."""
    from protocol import Tokenize, Tokens

    _, peer, _ = running
    peer.send(Tokenize(_submit("tok", prompt="slowprep")))
    peer.send(_submit("gen", max_tokens=1))
    order: list[str] = []
    deadline = time.monotonic() + 10
    while len(order) < 2 and time.monotonic() < deadline:
        msg = peer.recv(max(0.0, deadline - time.monotonic()))
        if isinstance(msg, EventBatch):
            for e in msg.events:
                if isinstance(e, Started) and e.request_id.startswith("gen"):
                    order.append("gen started")
                if isinstance(e, Tokens):
                    order.append("tokens")
    assert order == ["gen started", "tokens"]


def test_a_lookup_that_cannot_fit_is_refused_untokenized(tmp_path: Path) -> None:
    from protocol import Tokenize

    with serve_loop(tmp_path, ModelInfo("scripted", 10, None, longest_token_chars=2)) as (backend, peer, _):
        peer.send(Tokenize(_submit("tok", prompt="x" * 21)))
        err = _first(peer, EventBatch)
        assert isinstance(err, EventBatch)
        (e,) = err.events
        assert isinstance(e, RequestError) and e.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
        assert "tok" not in backend.prepared
