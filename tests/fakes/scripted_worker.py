"""The worker loop's test doubles (``tests/integration/test_worker_loop.py``):
``ScriptedBackend``, a backend whose events are scripted by its prompt, and ``Peer``,
the proxy's side of the worker's sockets, synchronous."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection

import zmq

from engine_worker.backend import ModelInfo, Prepared, RequestRejected
from protocol import (
    ErrorCode,
    Event,
    EventBatch,
    Finished,
    FinishReason,
    PrefillProgress,
    ProxyMessage,
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
    """Each sequence emits Started+progress, then one token per step for
    ``max_tokens`` steps, then Finished. A prompt of "reject" is refused, "buggy"
    raises, "explode" makes the next step raise, "slow" makes every step of it
    take ``slow_step_s``. Prompts are 4 tokens; a sequence reserves 4 +
    ``max_tokens`` KV tokens."""

    def __init__(self, info: ModelInfo) -> None:
        self._info = info
        self.remaining: dict[str, int] = {}
        self.max_tokens: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.prepared: list[str] = []
        self.started: list[tuple[str, int | None]] = []
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()  # engine-state calls: the loop thread only
        self.prepare_thread_ids: set[int] = set()
        self._explode = False
        self.slow: set[str] = set()
        self.slow_step_s = 0.6
        self.broken_cancel = False

    @property
    def info(self) -> ModelInfo:
        return self._info

    def prepare(self, submit: Submit) -> Prepared:
        self.prepare_thread_ids.add(threading.get_ident())
        self.prepared.append(submit.request_id)
        if submit.prompt == "slowprep":
            time.sleep(1.0)
        if submit.prompt == "reject":
            raise RequestRejected(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages")
        if submit.prompt == "buggy":
            raise KeyError("tokenizer bug")
        return Prepared(submit, submit.prompt, 4, "prompt")

    def prompt_ids(self, prepared: Prepared) -> list[int]:
        """As many ids as ``prepare`` counts prompt tokens."""
        return [0] * prepared.prompt_tokens

    def reservation(self, prepared: Prepared) -> int:
        return 4 + prepared.submit.params.max_tokens

    def kv_reserved(self) -> int:
        return sum(self.reserved[rid] for rid in self.remaining)

    def start(self, request_id: str, prepared: Prepared, params: SamplingParams) -> None:
        self.thread_ids.add(threading.get_ident())
        if prepared.prompt == "explode":
            self._explode = True
        if prepared.prompt == "slow":
            self.slow.add(request_id)
        self.started.append((request_id, params.seed))
        self.remaining[request_id] = -params.max_tokens
        self.max_tokens[request_id] = params.max_tokens
        self.reserved[request_id] = self.reservation(prepared)

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
        if self.slow & self.remaining.keys():
            time.sleep(self.slow_step_s)
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

    def send(self, msg: ProxyMessage) -> None:
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
