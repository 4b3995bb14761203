"""Where each dialect is mounted (``proxy.app`` registers these routes)."""

from __future__ import annotations

from proxy.core.dialect import Dialect
from proxy.dialects.chat import CHAT
from proxy.dialects.completions import COMPLETIONS
from proxy.dialects.messages import MESSAGES
from proxy.dialects.responses import RESPONSES

ROUTES: tuple[tuple[str, Dialect], ...] = (
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", COMPLETIONS),
    ("/v1/responses", RESPONSES),
    ("/v1/messages", MESSAGES),
)
"""Each dialect's generation route."""
