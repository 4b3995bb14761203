"""The wire dialects the proxy speaks, one package each, over one core.

| package | route | |
|---|---|---|
| ``chat`` | ``POST /v1/chat/completions`` | OpenAI chat completions |
| ``completions`` | ``POST /v1/completions`` | OpenAI (legacy) text completions |
| ``responses`` | ``POST /v1/responses`` | OpenAI Responses API (stateless) |

``base`` says what a dialect provides (``Dialect``, ``Job``) and gets
(``Context``, ``Header``); ``openai_common`` holds what the OpenAI dialects
share. Adding a dialect: a package exporting a ``Dialect`` and one line in
``ROUTES``.
"""

from __future__ import annotations

from proxy.dialects.base import Dialect
from proxy.dialects.chat import CHAT
from proxy.dialects.completions import COMPLETIONS
from proxy.dialects.responses import RESPONSES

ROUTES: tuple[tuple[str, Dialect], ...] = (
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", COMPLETIONS),
    ("/v1/responses", RESPONSES),
)
"""Each dialect's generation route."""
