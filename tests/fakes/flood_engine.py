"""``FloodEngine``: an engine client that floods each request with token deltas, for the
SSE-path benchmark (``benchmarks/sse_path.py``): the proxy's cost per event without a
worker."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from protocol import PROTOCOL_VERSION, Finished, FinishReason, Ready, Started, Submit, TokenDelta
from proxy.engine.stream import RequestStream


class FloodEngine:
    """Engine client that answers each submit with ``tokens`` deltas, yielding to
    the loop every ``batch`` events like a worker's reader task would."""

    def __init__(self, tokens: int, batch: int) -> None:
        self.tokens = tokens
        self.batch = batch
        self.worker = Ready(PROTOCOL_VERSION, "bench", "bench-model", "bench", 1 << 20, None)
        self.ready = True
        self.worker_active_requests: int | None = None
        self.heartbeat = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()

    def submit(self, submit: Submit) -> RequestStream:
        stream = RequestStream([submit.request_id], 256)
        task = asyncio.create_task(self._play(submit.request_id, stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream

    async def _play(self, rid: str, stream: RequestStream) -> None:
        stream.put(Started(rid, 100, 0))
        for i in range(self.tokens):
            stream.put(TokenDelta(rid, " tok", 1))
            if i % self.batch == 0:
                await asyncio.sleep(0)
        stream.put(Finished(rid, FinishReason.LENGTH, 100, 0, self.tokens))

    def abort(self, request_ids: Sequence[str]) -> None:
        return None
