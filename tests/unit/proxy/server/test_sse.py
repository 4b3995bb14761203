"""SSE framing: exact bytes, LF only, line separators escaped."""

from __future__ import annotations

import json

import pytest

from proxy.server import sse


def test_event_is_data_json_lf_lf() -> None:
    assert sse.event({"a": "x\ny", "b": None}) == b'data: {"a":"x\\ny","b":null}\n\n'


def test_done_and_ping_frames() -> None:
    assert sse.DONE == b"data: [DONE]\n\n"
    assert sse.PING == b": ping\n\n"


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\u0085"])
def test_line_separators_are_escaped(char: str) -> None:
    text = f"a{char}b{char}"
    frame = sse.event({"t": text})
    assert char.encode() not in frame
    escape = f"\\u{ord(char):04x}".encode()
    assert frame.count(escape) == 2
    payload = frame.removeprefix(b"data: ").removesuffix(b"\n\n")
    assert json.loads(payload) == {"t": text}
    # a splitlines()-based client sees the event line, then the blank separator
    assert frame.decode().splitlines() == [frame.decode()[:-2], ""]


def test_other_characters_sharing_the_utf8_prefix_stay_raw() -> None:
    # U+2014 (em dash) and U+2026 (ellipsis) also start with E2 80.
    frame = sse.event({"t": "a\u2014b\u2026\u2028"})
    assert "\u2014".encode() in frame
    assert "\u2026".encode() in frame
    assert json.loads(frame[6:-2]) == {"t": "a\u2014b\u2026\u2028"}


def test_headers() -> None:
    assert sse.HEADERS == {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    }
