"""``benchmarks/tool_call_stream.py`` on a short call: its measurement holds together
(the arguments rebuilt from the fragments are the call's, one fragment per piece of
argument text in every dialect, the first one long before the call's end)."""

from __future__ import annotations

import json

import pytest

from benchmarks.tool_call_stream import call_text, run


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
async def test_fragments_arrive_one_per_piece_long_before_the_end(dialect: str) -> None:
    arguments = {"path": "a.py", "content": "x = 1\n" * 20}
    text = call_text("hermes", arguments)
    pieces = [text[k : k + 4] for k in range(0, len(text), 4)]
    first = text.index('{"path"') // 4
    streamed = await run("hermes", dialect, pieces, first, 0.002)
    assert json.loads(streamed.arguments) == arguments
    # Every piece from the arguments' "{" up to their closing "}" adds a fragment.
    closing = (text.index("}\n</tool_call>") - 1) // 4
    assert streamed.fragments >= closing - first
    # Far less than the ~100 steps of 2 ms the rest of the call takes.
    assert streamed.first_ms < 0.5 * (len(pieces) - first) * 2
    whole = await run("hermes", dialect, [text], 0, 0.002)
    assert whole.fragments == 1 and json.loads(whole.arguments) == arguments
    assert whole.bytes < streamed.bytes
