"""``ScriptedServer``: a chat server (chat completions, Responses, Messages) that plays a
script, for the ``exl3-sidecar chat`` tests (``tests/unit/launcher/test_chat.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

MODEL = "scripted-model"

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
"""Where each API of ``exl3-sidecar chat --api`` posts."""

Step = dict[str, Any] | tuple[str, dict[str, Any]] | str | float
"""A chunk (sent as JSON), an ``(event name, data)`` pair, a raw ``data:`` payload such as
``[DONE]``, or a pause in seconds."""


class ScriptedServer:
    """``GET /v1/models`` lists ``models`` (404 when ``None``); ``POST`` on each API's path
    answers ``reply`` (status, body sent as application/json) if set, else streams ``script``.
    Records each request's path, body and headers; ``disconnected`` is set when a client goes
    away mid-stream (the test server cancels the handler, as the proxy's runner does)."""

    def __init__(self, script: list[Step], models: list[str] | None = None) -> None:
        self.script = script
        self.models = [MODEL, "another-model"] if models is None else models
        self.models_route = True
        self.reply: tuple[int, str] | None = None
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.auth: list[str | None] = []
        self.headers: list[dict[str, str]] = []
        self.models_calls = 0
        self.disconnected = asyncio.Event()
        self.base_url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        for path in PATHS.values():
            app.router.add_post(path, self._chat)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        self.models_calls += 1
        if not self.models_route:
            raise web.HTTPNotFound()
        return web.json_response(
            {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.paths.append(request.path)
        self.auth.append(request.headers.get("Authorization"))
        self.headers.append(dict(request.headers))
        if self.reply is not None:
            status, body = self.reply
            return web.Response(status=status, text=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            for step in self.script:
                if isinstance(step, float):
                    await asyncio.sleep(step)
                    continue
                if isinstance(step, tuple):
                    name, payload = step
                    await resp.write(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode())
                    continue
                data = step if isinstance(step, str) else json.dumps(step)
                await resp.write(f"data: {data}\n\n".encode())
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise
        return resp
