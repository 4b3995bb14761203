"""The worker loop on real ZeroMQ sockets with a scripted backend."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
import zmq

from engine_worker.backend import ModelInfo, RequestRejected
from engine_worker.loop import EngineLoop
from engine_worker.sockets import WorkerSockets
from protocol import (
    PROTOCOL_VERSION,
    Abort,
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    FinishReason,
    Heartbeat,
    Hello,
    PrefillProgress,
    Ready,
    RequestError,
    SamplingParams,
    Started,
    Submit,
    TokenDelta,
    WorkerMessage,
    decode_worker_message,
    encode,
)


class ScriptedBackend:
    """Each request emits Started+progress, then one token per step for
    ``max_tokens`` steps, then Finished. A prompt of "reject" is refused and a
    prompt of "explode" makes the next step raise."""

    def __init__(self) -> None:
        self.remaining: dict[str, int] = {}
        self.max_tokens: dict[str, int] = {}
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self._explode = False
        self.broken_cancel = False

    @property
    def info(self) -> ModelInfo:
        return ModelInfo("scripted", 1000, None)

    def add(self, submit: Submit) -> None:
        self.thread_ids.add(threading.get_ident())
        if submit.prompt == "reject":
            raise RequestRejected(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")
        if submit.prompt == "explode":
            self._explode = True
        if submit.prompt == "buggy":
            raise KeyError("tokenizer bug")
        self.remaining[submit.request_id] = -submit.params.max_tokens
        self.max_tokens[submit.request_id] = submit.params.max_tokens

    def abort(self, request_id: str) -> None:
        self.thread_ids.add(threading.get_ident())
        self.aborted.append(request_id)
        if self.broken_cancel:
            raise RuntimeError("cannot cancel in this state")
        self.remaining.pop(request_id, None)

    def active_ids(self) -> Collection[str]:
        return self.remaining.keys()

    def step(self) -> list[Event]:
        self.thread_ids.add(threading.get_ident())
        if self._explode:
            self._explode = False
            raise RuntimeError("kaboom")
        events: list[Event] = []
        for rid, left in list(self.remaining.items()):
            if left < 0:  # not started yet: -max_tokens
                events += [
                    Started(rid, 4, 0),
                    PrefillProgress(rid, 4, 0, 0, 0),
                    PrefillProgress(rid, 4, 0, 4, 1),
                ]
                self.remaining[rid] = -left
            elif left > 0:
                events.append(TokenDelta(rid, "x", 1))
                self.remaining[rid] = left - 1
            else:
                events.append(Finished(rid, FinishReason.LENGTH, 4, 0, self.max_tokens[rid]))
                del self.remaining[rid]
        return events

    def close(self) -> None:
        pass


class Peer:
    """The proxy's side of the sockets, synchronous."""

    def __init__(self, input_addr: str, output_addr: str) -> None:
        ctx = zmq.Context.instance()
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(input_addr)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.connect(output_addr)

    def send(self, msg: Hello | Submit | Abort) -> None:
        self.push.send_multipart(encode(msg))

    def recv(self, timeout_s: float = 5.0) -> WorkerMessage:
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError
        return decode_worker_message(self.pull.recv_multipart())

    def events_until_terminal(self, ids: set[str], timeout_s: float = 5.0) -> list[Event]:
        out: list[Event] = []
        pending = set(ids)
        deadline = time.monotonic() + timeout_s
        while pending:
            msg = self.recv(deadline - time.monotonic())
            if isinstance(msg, EventBatch):
                out += msg.events
                pending -= {e.request_id for e in msg.events if isinstance(e, Finished | RequestError)}
        return out

    def close(self) -> None:
        self.push.close(0)
        self.pull.close(0)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[ScriptedBackend, Peer, EngineLoop]]:
    addrs = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    backend = ScriptedBackend()
    sockets = WorkerSockets(*addrs)
    loop = EngineLoop(backend, sockets, heartbeat_interval=0.05)
    stop = threading.Event()
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
        assert backend.thread_ids <= {t.ident}, "backend called from another thread"


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


def test_abort_stops_events(running: tuple[ScriptedBackend, Peer, EngineLoop]) -> None:
    backend, peer, _ = running
    peer.send(_submit("long", max_tokens=10**9))
    _first(peer, EventBatch)
    peer.send(Abort(("long", "unknown")))
    deadline = time.monotonic() + 5
    while "long" not in backend.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.aborted == ["long"]  # unknown ids never reach the backend
    # After the abort is handled, no event for the request arrives any more.
    peer.send(_submit("after", max_tokens=1))
    events = peer.events_until_terminal({"after"})
    late = [e for e in events if getattr(e, "request_id", None) == "long"]
    # Events already in flight before the abort may still arrive, but never a
    # terminal one: the request was dropped, not finished.
    assert not any(isinstance(e, Finished | RequestError) for e in late)


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
