"""Prefix-cache isolation: vLLM's ``cache_salt`` on every dialect, and a salt per
API key with ``cache_isolation: key`` (issue 20's side channel between tenants)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"model": "m", "prompt": "hi"}),
        ("/v1/responses", {"model": "m", "input": "hi"}),
        ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_a_request_salt_reaches_the_worker_on_every_dialect(
    make_client: MakeClient, fake: FakeEngineClient, path: str, body: dict[str, Any]
) -> None:
    client = await make_client()
    assert (await client.post(path, json={**body, "cache_salt": "tenant-a"})).status == 200
    assert (await client.post(path, json=body)).status == 200
    assert [s.cache_salt for s in fake.submits] == ["tenant-a", None]


async def test_each_key_gets_a_cache_of_its_own(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client(api_key="key-a,key-b", cache_isolation="key")
    for key in ("key-a", "key-a", "key-b"):
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert r.status == 200
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "cache_salt": "x"}, headers={"x-api-key": "key-a"}
    )
    assert r.status == 200
    a1, a2, b, a_salted = (s.cache_salt for s in fake.submits)
    assert a1 is not None and a1 == a2  # one key: one cache
    assert b is not None and b != a1  # another key: another cache
    assert a_salted not in (None, a1, b)  # the request's own salt splits its key's cache further
    assert all("key-" not in (s or "") for s in (a1, b))  # the key itself never travels


async def test_without_isolation_keys_share_the_cache(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client(api_key="key-a,key-b")
    for key in ("key-a", "key-b"):
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert r.status == 200
    assert [s.cache_salt for s in fake.submits] == [None, None]


async def test_a_bad_salt_is_a_400_naming_it(make_client: MakeClient) -> None:
    client = await make_client()
    r = await client.post("/v1/chat/completions", json={**CHAT, "cache_salt": ""})
    assert r.status == 400 and (await r.json())["error"]["param"] == "cache_salt"
