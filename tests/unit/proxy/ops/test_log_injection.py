"""A path that smuggles a log line (``%0A``) or a terminal escape (``%1b``)
stays inside its own record of the default text log."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import pytest
from yarl import URL

from protocol.logs import TextFormatter
from tests.unit.proxy.conftest import MakeClient

FORGED_PATH = "/v1/x%0A2099-01-01%2000:00:00,000%20INFO%20proxy.request_log:%20FORGED%20LINE%1b[2J"
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@pytest.fixture
def text_log() -> Iterator[io.StringIO]:
    """The text log ``setup_logging`` writes, into a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_a_forged_line_and_esc_in_the_path_are_escaped(
    make_client: MakeClient, text_log: io.StringIO
) -> None:
    client = await make_client()
    resp = await client.get(URL(FORGED_PATH, encoded=True))
    assert resp.status == 404
    lines = text_log.getvalue().splitlines()
    records = [line for line in lines if "proxy.requests:" in line]
    assert len(records) == 1
    assert all(RECORD_START.match(line) for line in lines)  # no line that is not a record's own
    assert not any(line.startswith("2099") for line in lines)
    assert "\x1b" not in text_log.getvalue()
    escaped = "/v1/x\\n2099-01-01 00:00:00,000 INFO proxy.request_log: FORGED LINE\\x1b[2J"
    assert records[0].count(escaped) == 2  # in the message and in path=
