"""Grammars for constrained decoding: built at the HTTP edge, checked off the event loop.

The worker masks logits with an llguidance grammar (``SamplingParams.grammar``;
the CPU engine applies the matcher's token mask itself, ExLlamaV3 through its
``LLGuidanceFilter``). Building a grammar's text here is cheap and synchronous
and checks nothing (``json_schema_grammar``, ``proxy.tools.grammar``); the
request path then awaits ``validate`` for each grammar, which has llguidance
check it in a child process (``proxy.grammar.child``) under a deadline and an
address-space cap, so that a schema llguidance cannot compile, or one that
would take it too long or too much memory, is a 400 naming the request field
before anything reaches the engine, and never stalls the proxy.

A JSON output (each dialect's: chat's ``response_format``, the Responses
API's ``text.format``, Anthropic's ``output_config.format``; ``proxy.core.task.JsonOutput``)
is JSON valid against its schema, strict JSON when the dialect says ``strict``
(``proxy.tools.grammar.json_rule_schema``).

Bounds of the checks (``GrammarChecker``; why these numbers: a check of a
schema or a tool list as clients send them takes milliseconds, while the
``allOf``-of-patterns bomb of issue 20 takes 1.4 s and 250 MB at 20 patterns
and doubles with each more):

- each request's grammars are checked within ``CHECK_TIMEOUT_S`` in all, in a
  child whose address space is ``CHECK_MEMORY_MB``; past either the child is
  killed (and replaced) and the request refused: 400 naming the field whose
  schema was being checked. Only what the grammar causes is a 400: a child
  killed by another signal than an allocation failure's abort, or one that
  used under 5% of its deadline in CPU time (stopped, starved), is the
  checker's fault: 503 ``grammar_checker_fault`` with ``Retry-After``;
- ``CHECK_PROCESSES`` children check at once; up to ``CHECK_MAX_WAITING``
  more requests wait, each at most ``CHECK_MAX_WAIT_S``; beyond, 503
  ``grammar_checks_busy`` with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

import msgspec

from proxy.errors import InvalidRequest, ServiceUnavailable
from proxy.tools.grammar import json_rule_schema

log = logging.getLogger(__name__)

ANY_JSON_OBJECT: dict[str, object] = {"type": "object"}
"""The schema of ``json_object`` outputs: any JSON object."""

CHECK_TIMEOUT_S = 2.0
CHECK_MEMORY_MB = 512
CHECK_PROCESSES = 2
CHECK_MAX_WAITING = 16
CHECK_MAX_WAIT_S = 5.0
CHILD_START_TIMEOUT_S = 30.0

_encode = msgspec.json.Encoder().encode
_MAX_REASON_CHARS = 400


# ---------------------------------------------------------------- building (sync, cheap)


def json_schema_grammar(schema: dict[str, object] | bool, *, strict: bool = False) -> str:
    """The llguidance grammar of JSON valid against ``schema`` (the JSON text
    ``LLMatcher.grammar_from_json_schema`` makes), with the options of
    ``json_rule_schema``: strict JSON when ``strict``. Not checked."""
    rule = json_rule_schema(schema, strict=strict)
    return _encode({"grammars": [{"json_schema": rule}]}).decode()


# ---------------------------------------------------------------- checking (async, bounded)


class GrammarTooComplex(Exception):
    """Checking a grammar went over the time or memory bound."""


class ChecksBusy(Exception):
    """Every checker was taken and the wait for one ran out (or the queue was full)."""


class CheckerFault(Exception):
    """The checker failed for a reason of its own, not the grammar's: its child
    was killed by someone else (a signal other than the abort an allocation over
    the cap ends in) or did not run while it had the grammar (stopped, or the
    machine gave it no CPU). ``args[0]`` says which."""


_SCHEMA_EXITS = frozenset({-signal.SIGABRT, 1})
"""How a child ends when the grammar itself is at fault: Rust aborts when an
allocation fails under ``RLIMIT_AS`` (``SIGABRT``), and a Rust panic or a
``MemoryError`` surfaces as an uncaught Python exception (status 1)."""

_RAN_FRACTION = 0.05
"""A check that timed out while its child used less than this share of the
deadline in CPU time was not slow: the child was not running (stopped, or
starved by a loaded machine), and the grammar is not to blame."""


def _cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` (``/proc/<pid>/stat``
    fields 14 and 15, proc(5)); ``None`` where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class CheckResult:
    """``error`` is llguidance's message for grammar ``index`` (``None``: all valid)."""

    index: int
    error: str | None


_PIECE = re.compile(r"^// (?P<param>\S+)\n(?P<rule>\w+): %json (?P<schema>.*)$", re.MULTILINE)


def grammar_pieces(grammar: str, param: str) -> list[tuple[str, str]]:
    """``(grammar, param)`` pairs to check for ``grammar`` from ``param``: each
    ``%json`` rule that follows a ``// <field>`` comment (``proxy.tools.grammar``'s
    layout) as a grammar of its own, named by that field, then the whole
    grammar named ``param``. Checking the pieces first names the field at fault
    (``tools[2].function.parameters``) when one is refused or too complex."""
    pieces = [(f"start: {m['rule']}\n{m[0]}\n", m["param"]) for m in _PIECE.finditer(grammar)]
    return [*pieces, (grammar, param)]


def _reason(error: str) -> str:
    text = error.strip()
    line = text.splitlines()[0] if text else "unknown error"
    return line if len(line) <= _MAX_REASON_CHARS else line[:_MAX_REASON_CHARS] + "..."


class _Child:
    """One ``proxy.grammar.child`` process and the bytes it sent not yet read."""

    def __init__(self, memory_mb: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.grammar.child", str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a Rust panic's message is not the proxy's log
            close_fds=True,
        )
        self._buf = b""
        # Wait for the child to load llguidance, so that a check's deadline
        # counts checking only (a loaded machine can take seconds to start it).
        try:
            ready = self.read_line(time.monotonic() + CHILD_START_TIMEOUT_S)
        except TimeoutError:
            ready = None
        if ready is None:
            self.kill()
            raise ChecksBusy(f"the grammar checker did not start in {CHILD_START_TIMEOUT_S:g} s")

    def send(self, grammars: list[str]) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(_encode(grammars) + b"\n")
        stdin.flush()

    def read_line(self, deadline: float) -> bytes | None:
        """The next line, ``None`` at EOF; raises ``TimeoutError`` at ``deadline``."""
        stdout: IO[bytes] | None = self.proc.stdout
        assert stdout is not None
        fd = stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class GrammarChecker:
    """A bounded pool of ``proxy.grammar.child`` children (see the module's
    docstring for the bounds), used from any event loop: each check runs on one
    of ``processes`` threads, each owning one child, started on first use and
    replaced after a kill."""

    def __init__(
        self,
        *,
        processes: int = CHECK_PROCESSES,
        timeout_s: float = CHECK_TIMEOUT_S,
        memory_mb: int = CHECK_MEMORY_MB,
        max_waiting: int = CHECK_MAX_WAITING,
        max_wait_s: float = CHECK_MAX_WAIT_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.max_wait_s = max_wait_s
        self._capacity = processes + max_waiting
        self._executor = ThreadPoolExecutor(max_workers=processes, thread_name_prefix="grammar-check")
        self._local = threading.local()
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False

    async def check(self, grammars: list[str]) -> CheckResult:
        """llguidance's verdict on ``grammars``, checked in order until one is
        refused. Raises ``GrammarTooComplex`` (its ``args[0]`` is the index of
        the grammar being checked, ``args[1]`` what ran out) and ``ChecksBusy``."""
        with self._lock:
            if self._closed:
                raise RuntimeError("GrammarChecker is closed")
            if self._pending >= self._capacity:
                raise ChecksBusy
            self._pending += 1
        try:
            future = self._executor.submit(self._run, grammars, time.monotonic())
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Stop the threads and kill the children (idempotent)."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            children, self._children = self._children, set()
        for child in children:
            child.kill()

    def _release(self, _: Future[CheckResult] | None) -> None:
        with self._lock:
            self._pending -= 1

    def _child(self) -> _Child:
        child: _Child | None = getattr(self._local, "child", None)
        if child is None or child.proc.poll() is not None:
            if child is not None:
                self._drop(child)
            child = self._local.child = _Child(self.memory_mb)
            with self._lock:
                self._children.add(child)
        return child

    def _drop(self, child: _Child) -> None:
        child.kill()
        self._local.child = None
        with self._lock:
            self._children.discard(child)

    def _run(self, grammars: list[str], queued_at: float) -> CheckResult:
        if time.monotonic() - queued_at > self.max_wait_s:
            raise ChecksBusy
        child = self._child()
        try:
            child.send(grammars)
        except OSError:  # the child died while idle: once more with a new one
            self._drop(child)
            child = self._child()
            child.send(grammars)
        deadline = time.monotonic() + self.timeout_s
        cpu_before = _cpu_s(child.proc.pid)
        at = 0
        try:
            while True:
                line = child.read_line(deadline)
                if line is None:
                    status = child.proc.wait()
                    self._drop(child)
                    if status not in _SCHEMA_EXITS:
                        raise CheckerFault(f"the grammar checker ended with status {status}")
                    # Its address-space cap (Rust aborts) or a panic.
                    raise GrammarTooComplex(at, f"needs over {self.memory_mb} MB to check")
                reply = json.loads(line)
                if "at" in reply:
                    at = int(reply["at"])
                elif "ok" in reply:
                    return CheckResult(len(grammars), None)
                else:
                    return CheckResult(int(reply["index"]), str(reply["error"]))
        except TimeoutError:
            cpu_after = _cpu_s(child.proc.pid)
            self._drop(child)
            if cpu_before is not None and cpu_after is not None:
                ran = cpu_after - cpu_before
                if ran < _RAN_FRACTION * self.timeout_s:
                    raise CheckerFault(
                        f"the grammar checker ran {ran:.2f} s of its {self.timeout_s:g} s deadline"
                    ) from None
            raise GrammarTooComplex(at, f"takes over {self.timeout_s:g} s to check") from None


_checker: GrammarChecker | None = None
_checker_lock = threading.Lock()


def checker() -> GrammarChecker:
    """The process's ``GrammarChecker`` (made on first use; its children start
    on first check)."""
    global _checker
    with _checker_lock:
        if _checker is None:
            _checker = GrammarChecker()
        return _checker


def close_checker() -> None:
    """Stop the process's ``GrammarChecker`` and its children, if one was made
    (a later check makes a new one). Blocks until its threads stop: call it off
    the event loop."""
    global _checker
    with _checker_lock:
        current, _checker = _checker, None
    if current is not None:
        current.close()


async def validate(grammar: str, param: str, *, using: GrammarChecker | None = None) -> None:
    """Check ``grammar`` (from request field ``param``) with llguidance, off the
    event loop and bounded (module docstring), each ``%json`` piece of a tools
    grammar first (``grammar_pieces``).

    Raises ``InvalidRequest`` naming the field (``response_format.json_schema``,
    ``tools[i].function.parameters``, or ``param``) when llguidance refuses it
    or it goes over a bound; ``ServiceUnavailable`` (503, ``Retry-After``):
    ``grammar_checks_busy`` when the checkers are all taken,
    ``grammar_checker_fault`` when the checker failed for a reason of its own
    (``CheckerFault``)."""
    pieces = grammar_pieces(grammar, param)
    try:
        result = await (using or checker()).check([g for g, _ in pieces])
    except GrammarTooComplex as e:
        index, what = e.args
        field = pieces[index][1]
        raise InvalidRequest(f"'{field}' is too complex to enforce: it {what}", param=field) from None
    except ChecksBusy:
        raise ServiceUnavailable(
            "Too many grammars are being checked now; retry shortly", code="grammar_checks_busy"
        ) from None
    except CheckerFault as e:
        log.warning("grammar check of '%s' failed for a reason of the checker's: %s", param, e.args[0])
        raise ServiceUnavailable(
            "The grammar checker failed (not because of this request); retry shortly",
            code="grammar_checker_fault",
        ) from None
    if result.error is not None:
        field = pieces[result.index][1]
        raise InvalidRequest(f"'{field}' cannot be enforced: {_reason(result.error)}", param=field)
