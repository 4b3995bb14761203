"""``proxy.serving.serve.parsed``: a large body is parsed off the event loop."""

from __future__ import annotations

import threading

from proxy.serving.serve import PARSE_INLINE_BYTES, parsed


async def test_large_bodies_are_parsed_in_a_thread() -> None:
    def where(body: bytes) -> tuple[int, str]:
        return len(body), threading.current_thread().name

    loop_thread = threading.current_thread().name
    assert await parsed(where, b"x" * PARSE_INLINE_BYTES) == (PARSE_INLINE_BYTES, loop_thread)
    size, thread = await parsed(where, b"x" * (PARSE_INLINE_BYTES + 1))
    assert size == PARSE_INLINE_BYTES + 1 and thread != loop_thread
