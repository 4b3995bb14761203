"""The shared steps of the routes beside generation that ask the worker a
question (vLLM's ``/tokenize`` and ``/detokenize``, Anthropic's
``count_tokens``): intake, the dialect's parser, the worker's handshake and
what a conversion needs from it, in the order the generation path takes them
(``proxy.serving.serve``), so a side route refuses what generation refuses, in
the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from aiohttp import web

from protocol.messages import Ready
from proxy.core.dialect import Context
from proxy.server.state import STATE
from proxy.serving.serve import context_of, parsed, read_request, ready_worker

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class SideRequest(Generic[_T]):
    """A side route's parsed body, the worker's handshake and the ``Context``
    a conversion into a ``Submit`` needs."""

    req: _T
    worker: Ready
    context: Context


async def side_request(request: web.Request, parse: Callable[[bytes], _T]) -> SideRequest[_T]:
    """Read ``request``'s body within the limits (``read_request``), parse it
    (``parse`` raises ``InvalidRequest`` naming the field), then require a
    ready worker (``EngineNotReady``)."""
    body = await read_request(request)
    req = await parsed(parse, body)
    state = request.app[STATE]
    worker = ready_worker(state)
    return SideRequest(req, worker, context_of(state, worker))
