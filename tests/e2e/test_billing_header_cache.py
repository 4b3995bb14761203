"""Claude Code's billing line and the prefix cache, on the real embedded model
through ``exl3-sidecar serve``: two turns whose first system block differs only
in its per-request ``cch=`` stamp share their prompt, so the second is served
from the CPU engine's prefix cache; the same change in any other first block
misses it, which is what the stamp did before the line was dropped."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

# About 730 prompt tokens: more than two 256-token chunks of the CPU engine's
# prefix cache (and many 16-token blocks, should it reuse those).
RULES = " ".join(f"Rule {i}: keep every test green and every document true." for i in range(60))


def turn(server: Server, first_block: str) -> dict[str, Any]:
    body = {
        "model": "any",
        "max_tokens": 1,
        "temperature": 0,
        "system": [{"type": "text", "text": first_block}, {"type": "text", "text": RULES}],
        "messages": [{"role": "user", "content": "Which rule comes first?"}],
    }
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    usage: dict[str, Any] = r.json()["usage"]
    return usage


def stamped(stamp: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.332.a1f; cc_entrypoint=cli; cch={stamp};"


def test_a_changing_cch_stamp_keeps_the_prefix_cache(server: Server) -> None:
    run = uuid.uuid4().hex[:5]  # this run's own prompt: no entry of an earlier test helps
    first = turn(server, stamped(run))
    second = turn(server, stamped(run[::-1]))
    total = first["input_tokens"] + first["cache_read_input_tokens"]
    assert total > 600
    assert second["input_tokens"] + second["cache_read_input_tokens"] == total
    assert second["cache_read_input_tokens"] >= 512


def test_a_changing_first_block_that_is_not_the_billing_line_misses(server: Server) -> None:
    run = uuid.uuid4().hex[:5]
    turn(server, f"x-session-note: cch={run};")
    second = turn(server, f"x-session-note: cch={run[::-1]};")
    assert second["cache_read_input_tokens"] == 0
