"""The application's shared state and its admission/shutdown state machine.

States: *serving* -> *draining* (SIGINT/SIGTERM: ``/ready`` answers 503 and new
requests get 503 ``ShuttingDown``, requests in flight go on) -> *stopped*
(after ``ProxySettings.shutdown_drain`` the requests still in flight are failed
with ``ShuttingDown``, which ends their streams with an error event and sends
``Abort`` to the worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from aiohttp import web

from proxy.engine.client import EngineClient
from proxy.engine.stream import RequestStream
from proxy.errors import NOT_READY_MESSAGE, EngineNotReady, ShuttingDown, TooManyRequests
from proxy.settings import ProxySettings
from proxy.tools import FormatChoice, choose_format


@dataclass(eq=False)
class ProxyState:
    """Per-application state: settings, engine client, admission counters.

    ``api_keys``: digests (``proxy.server.intake.key_digest``) of the keys ``/v1/*``
    requires, from ``ProxySettings.api_keys`` once at app creation (empty: none
    required); ``started_at``: Unix seconds (the ``created`` of
    ``/v1/models``);
    ``in_flight``: completion requests admitted and not yet ended; ``active``:
    the event streams of those that reached the engine (failed with
    ``ShuttingDown`` at the drain deadline).
    """

    settings: ProxySettings
    engine: EngineClient
    api_keys: frozenset[bytes] = field(default=frozenset(), repr=False)
    started_at: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0
    active: set[RequestStream] = field(default_factory=set)
    _idle: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _tool_format: tuple[tuple[str, str | None], FormatChoice] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._idle.set()

    def tool_format(self) -> FormatChoice:
        """The tool-call format of the served model: ``--tool-call-format``, or
        with ``auto`` what the worker's chat template renders (hermes with the
        generic tools prompt when it renders none)."""
        worker = self.engine.worker
        template = worker.chat_template if worker is not None else None
        key = (self.settings.tool_call_format, template)
        if self._tool_format is None or self._tool_format[0] != key:
            self._tool_format = (key, choose_format(*key))
        return self._tool_format[1]

    def model_name(self) -> str | None:
        """``served_model_name``, else the worker's model id, else ``None``."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        worker = self.engine.worker
        return worker.model_id if worker is not None else None

    def check_admissible(self) -> None:
        """Raise what ``admit`` would raise now, without taking a slot: a request
        that cannot be served is refused before its body is read."""
        if self.draining:
            raise ShuttingDown("The server is shutting down and accepts no new requests")
        if not self.engine.ready:
            raise EngineNotReady(NOT_READY_MESSAGE)
        if self.in_flight >= self.settings.max_in_flight:
            raise TooManyRequests(
                f"Too many requests in flight ({self.in_flight}); the limit is max_in_flight="
                f"{self.settings.max_in_flight}"
            )

    def admit(self) -> None:
        """Count one more request in flight (once its body is read and parsed:
        a slow client sending its body holds no slot). Raises ``ShuttingDown``
        while draining, ``EngineNotReady`` before the handshake and
        ``TooManyRequests`` at ``max_in_flight``."""
        self.check_admissible()
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        """The end of a request counted by ``admit``."""
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout_s: float, grace_s: float = 5.0) -> int:
        """Stop admitting, wait up to ``timeout_s`` seconds for the requests in
        flight, then fail the rest with ``ShuttingDown`` and wait up to
        ``grace_s`` seconds for their handlers to send the error and ``Abort``.
        Returns the number of requests that were failed."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        if self.in_flight == 0:
            return 0
        streams = list(self.active)
        for s in streams:
            s.fail(
                ShuttingDown(
                    f"The server is shutting down; shutdown_drain={self.settings.shutdown_drain:g} "
                    "ran out before this request finished"
                )
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                await self._idle.wait()
        return len(streams)


STATE: web.AppKey[ProxyState] = web.AppKey("proxy_state", ProxyState)
"""Where ``create_app`` stores the ``ProxyState``."""
