"""``X-Request-Id``: the client's id (bounded, sanitized) is the request's
correlation id, echoed in the response's header, written to the request log and
shown in ``/v1/status``; without one the response carries the server's id."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import pytest

from protocol.logs import FIELDS
from proxy.server.request_id import MAX_REQUEST_ID_CHARS, SAFE_CHARS, sanitize_request_id
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.ops.test_status import Held, by_stage, chat, until

UUID = "3f2c9a1e-7b4d-4e8a-9c1f-0d2e3b4a5c6d"


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        (UUID, UUID),
        (
            "4bf92f3577b34da6a3ce929d0e0e4736:00f067aa0ba902b7",
            "4bf92f3577b34da6a3ce929d0e0e4736:00f067aa0ba902b7",
        ),
        ("a b\tc\r\nd", "abcd"),
        ('id"; drop=1,x', "iddrop=1x"),
        ("ünï-çødé", "n-d"),
        ("\x1b[2J", "2J"),
        ("   ", None),
        ("", None),
    ],
)
def test_only_safe_characters_are_kept(raw: str, kept: str | None) -> None:
    assert sanitize_request_id(raw) == kept


def test_an_id_is_cut_to_its_bound() -> None:
    long = "ab" * MAX_REQUEST_ID_CHARS
    assert sanitize_request_id(long) == long[:MAX_REQUEST_ID_CHARS]
    # Characters dropped before the cut: the kept ones fill the bound.
    assert sanitize_request_id(" x" * MAX_REQUEST_ID_CHARS) == "x" * MAX_REQUEST_ID_CHARS


def test_the_safe_characters_need_no_escaping() -> None:
    assert all(c.isascii() and c.isprintable() and c not in " \"'\\;," for c in SAFE_CHARS)


def request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [getattr(r, FIELDS) for r in caplog.records if r.name == "proxy.requests"]


async def test_the_clients_id_is_echoed_logged_and_shown_in_status(
    make_client: MakeClient, fake: FakeEngineClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.requests")
    held = Held()
    fake.script = held
    client = await make_client()

    async def post() -> tuple[int, str | None, bytes]:
        resp = await client.post(
            "/v1/chat/completions",
            json=chat("prefill", stream=True),
            headers={"X-Request-Id": f" {UUID}\t"},
        )
        return resp.status, resp.headers.get("X-Request-Id"), await resp.read()

    task = asyncio.create_task(post())
    st = await until(client, lambda s: by_stage(s) == ["prefill"])
    (entry,) = st.requests
    assert entry.correlation_id == UUID and entry.id.startswith("chatcmpl-")
    held.release.set()
    status, echoed, body = await task
    assert status == 200 and echoed == UUID
    assert b"data: [DONE]" in body
    (line,) = [f for f in request_lines(caplog) if f["path"] == "/v1/chat/completions"]
    assert line["correlation_id"] == UUID
    assert line["request_id"] == entry.id  # the response's own id stays as it was


async def test_without_an_id_the_server_sends_its_own(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.requests")
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat("hi"))
    assert resp.status == 200
    body = await resp.json()
    assert resp.headers["X-Request-Id"] == body["id"]
    # Refused before it got a response id: a fresh id, the same in the log line.
    bad = await client.post("/v1/chat/completions", json={"model": "m"})
    assert bad.status == 400
    own = bad.headers["X-Request-Id"]
    assert re.fullmatch("[0-9a-f]{32}", own)
    # An id made only of unsafe characters is no id.
    other = await client.get("/v1/models", headers={"X-Request-Id": "\t \t"})
    assert other.status == 200 and re.fullmatch("[0-9a-f]{32}", other.headers["X-Request-Id"])
    lines = {f["status"]: f for f in request_lines(caplog) if f["path"] == "/v1/chat/completions"}
    assert lines[200]["correlation_id"] == body["id"]
    assert lines[400]["correlation_id"] == own


async def test_probes_carry_no_id(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/health", headers={"X-Request-Id": UUID})
    assert resp.status == 200 and "X-Request-Id" not in resp.headers
