"""OpenAI- and Anthropic-compatible HTTP proxy (aiohttp) in front of an engine worker.

Never imports torch. The folders are its layers, top to bottom; a module imports
only from the layers below its own (the import-linter contract "the proxy's
layers" in ``pyproject.toml``):

- ``cli``, ``app``: ``python -m proxy`` and the app factory
  ``create_app(settings, engine)``;
- ``dialects/``: the wire dialects, one package each (``chat``, ``completions``,
  ``responses``, ``messages``; ``openai/`` what chat and completions share),
  mounted by ``dialects/registry.py``;
- ``serving/``: the request path every dialect's route runs through, delivery
  to the socket, tokenizer lookups, the side routes' shared steps;
- ``ops/``: the operator's views: probes and ``/v1/models``, metrics, the
  request log, ``/v1/status``, traces;
- ``core/``: what every dialect shares: the dialect contract, field decoding
  and the one sampling builder, the neutral task, one response's state, usage;
- ``server/``: the HTTP server and its guards: runner, connection limits, Host
  check, intake, SSE framing, probe paths, the app's state;
- ``engine/``: the engine client (ZeroMQ) and its per-request streams;
- ``grammar/``: grammar checks in bounded child processes;
- ``tools/``: tool calling: request types, call formats, the output parser;
- ``errors``, ``settings``: the exception tree and its translations;
  ``ProxySettings``.

A new dialect is a package under ``dialects/`` and one line in ``dialects/registry.py``.
"""
