"""OpenAI- and Anthropic-compatible HTTP proxy (aiohttp) in front of an engine worker.

Never imports torch. The folders are its layers, top to bottom; a module imports
only from the layers below its own (the import-linter contract "the proxy's
layers" in ``pyproject.toml``):

| module | what |
|---|---|
| ``__main__`` | ``python -m proxy``: the CLI |
| ``cli`` | ``exl3-sidecar proxy``: the command line, from ``settings.ProxySettings`` |
| ``app`` | the app factory ``create_app(settings, engine)`` and the server's run loop |
| ``dialects`` | the wire dialects, one package each, mounted by ``dialects/registry.py`` |
| ``serving`` | the request path every dialect's route runs through, delivery to the socket |
| ``ops`` | the operator's views: probes and ``/v1/models``, metrics, request log, ``/v1/status``, traces |
| ``core`` | what every dialect shares: the dialect contract, fields, the neutral task, usage |
| ``server`` | the HTTP server and its guards: runner, connection limits, Host check, intake, SSE |
| ``engine`` | the engine client (ZeroMQ) and its per-request streams |
| ``grammar`` | grammar checks in bounded child processes |
| ``tools`` | tool calling: request types, call formats, the output parser |
| ``errors`` | the exception tree and its one translation into each error envelope |
| ``settings`` | every option of the proxy, written once (``ProxySettings``) |

A new dialect is a package under ``dialects/`` and one line in ``dialects/registry.py``.
"""
