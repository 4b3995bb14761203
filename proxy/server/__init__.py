"""The HTTP server and its guards, below every route.

| module | what |
|---|---|
| ``runner`` | the aiohttp server under the app: the event loop, connection handling, header/body limits |
| ``connections`` | what one client's connections may cost (per-IP connection and request caps) |
| ``host_check`` | the Host/Origin guard against DNS rebinding |
| ``intake`` | what a request must pass before its body is parsed (media type, size, read time) |
| ``probes`` | the probe paths (``/health``, ``/ready``, ``/metrics``) every guard treats alike |
| ``cors`` | cross-origin calls from web pages, opt-in with ``--allowed-origins`` |
| ``request_id`` | the client's ``X-Request-Id``, bounded and sanitized, or one of ours |
| ``sse`` | Server-Sent Events framing and the transport writer |
| ``bodies`` | the JSON bodies of the routes outside any dialect, and ``encode`` |
| ``state`` | the application's shared state (settings, engine client, admission) |
"""
