"""Claude Code's billing line (``x-anthropic-billing-header: ...``) never reaches
the prompt; everything else the client sent does."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.dialects.messages.claude_code import without_billing_header
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient

HEADER = "x-anthropic-billing-header: cc_version=2.1.332.a1f; cc_entrypoint=cli; cch=3f9c2;"
PROMPT = "You are Claude Code, Anthropic's official CLI for Claude."


@pytest.mark.parametrize(
    ("system", "kept"),
    [
        # Claude Code's shape: the line is the first block, alone.
        (
            [
                {"type": "text", "text": HEADER},
                {"type": "text", "text": PROMPT, "cache_control": {"type": "ephemeral"}},
            ],
            [{"type": "text", "text": PROMPT, "cache_control": {"type": "ephemeral"}}],
        ),
        # The line first in a block with more text: only the line goes.
        ([{"type": "text", "text": HEADER + "\n" + PROMPT}], [{"type": "text", "text": PROMPT}]),
        (HEADER + "\n" + PROMPT, PROMPT),
        (HEADER, ""),
        ([{"type": "text", "text": HEADER}], []),
        # Anywhere else it is the client's text.
        ([{"type": "text", "text": PROMPT}, {"type": "text", "text": HEADER}], None),
        (PROMPT + "\n" + HEADER, None),
        (" " + HEADER, None),
        ("X-Anthropic-Billing-Header: cch=1;", None),
        (None, None),
        ([], None),
    ],
)
def test_only_the_leading_billing_line_is_dropped(system: Any, kept: Any) -> None:
    assert without_billing_header(system) == (system if kept is None else kept)


async def test_the_prompt_is_the_same_whatever_the_stamp(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    for stamp in ("3f9c2", "0aa91"):
        body = {
            "model": "m",
            "max_tokens": 5,
            "system": [
                {"type": "text", "text": HEADER.replace("3f9c2", stamp)},
                {"type": "text", "text": PROMPT},
            ],
            "messages": [{"role": "user", "content": "hi"}],
        }
        resp = await client.post("/v1/messages", json=body)
        assert resp.status == 200, await resp.text()
        counted = await client.post("/v1/messages/count_tokens", json=body)
        assert counted.status == 200
    first, second = fake.submits
    assert first.messages == second.messages
    assert [(m.role, m.content) for m in first.messages] == [("system", PROMPT), ("user", "hi")]
    assert all("x-anthropic" not in lookup.submit.messages[0].content for lookup in fake.lookups)  # type: ignore[union-attr]
