"""Text logs keep one line per record whatever a client sent (``protocol.logs``):
control characters in messages and field values are escaped, traceback lines
are indented so that only a record's first line starts at column 0."""

from __future__ import annotations

import logging
import re
import sys

from protocol.logs import FIELDS, TRACEBACK_INDENT, JsonFormatter, TextFormatter, escape_controls

FORGED = "/v1/x\n2099-01-01 00:00:00,000 INFO proxy.ops.request_log: FORGED LINE"
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def record(
    msg: str, *args: object, fields: dict[str, object] | None = None, exc: bool = False
) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError(f"bad model {FORGED!s}\x1b[2J")
        except ValueError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("proxy.requests", logging.INFO, __file__, 1, msg, args, exc_info)
    if fields is not None:
        setattr(rec, FIELDS, fields)
    return rec


def test_escape_controls() -> None:
    assert escape_controls("plain /v1/chat ünïcödé") == "plain /v1/chat ünïcödé"
    assert escape_controls("a\nb\rc\td") == "a\\nb\\rc\\td"
    assert escape_controls("\x1b[31mred\x00\x7f") == "\\x1b[31mred\\x00\\x7f"
    assert escape_controls("\x85\x9b\u2028\u2029") == "\\x85\\x9b\\u2028\\u2029"


def test_a_forged_record_in_the_message_and_fields_stays_on_its_line() -> None:
    line = TextFormatter().format(
        record("%s %s %d", "GET", FORGED + "\x1b[31m", 404, fields={"path": FORGED})
    )
    assert line.count("\n") == 0
    assert "\x1b" not in line
    escaped = "/v1/x\\n2099-01-01 00:00:00,000 INFO proxy.ops.request_log: FORGED LINE"
    assert f"GET {escaped}\\x1b[31m 404 path={escaped}" in line
    assert RECORD_START.match(line)


def test_traceback_lines_are_indented_and_escaped() -> None:
    text = TextFormatter().format(record("unhandled error in %s", FORGED, exc=True))
    first, *rest = text.split("\n")
    assert RECORD_START.match(first) and "\\n2099" in first
    assert rest and all(line.startswith(TRACEBACK_INDENT) for line in rest)
    assert not any(RECORD_START.match(line) for line in rest)
    assert "Traceback (most recent call last):" in rest[0]
    assert any("FORGED LINE\\x1b[2J" in line for line in rest)
    assert "\x1b" not in text


def test_json_lines_need_no_escaping_of_their_own() -> None:
    line = JsonFormatter().format(record("%s", FORGED, fields={"path": FORGED}))
    assert "\n" not in line
    assert '"path":"/v1/x\\n2099' in line
