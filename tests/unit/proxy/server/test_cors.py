"""CORS, opt-in with ``--allowed-origins`` (``proxy.server.cors``): off by default;
with it, preflights answered for the listed origins, their responses (errors and
streams too) carry ``Access-Control-Allow-Origin``, and the Host/Origin check
lets their ``Origin`` through while it still refuses a foreign ``Host``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.proxy.conftest import MakeClient

PAGE = "http://localhost:3000"
OTHER = "https://ui.example.com"
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_without_the_option_there_is_no_cors(make_client: MakeClient) -> None:
    client = await make_client()
    r = await client.options("/v1/chat/completions", headers={"Origin": PAGE, **PREFLIGHT})
    assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers
    r = await client.get("/v1/models", headers={"Origin": PAGE})
    assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    # a foreign page is refused by the Host/Origin check, as before
    r = await client.get("/v1/models", headers={"Origin": OTHER})
    assert r.status == 403 and (await r.json())["error"]["code"] == "host_not_allowed"


async def test_a_preflight_from_a_listed_origin_is_answered(make_client: MakeClient) -> None:
    client = await make_client(allowed_origins=f"{OTHER}/, {PAGE}")
    r = await client.options("/v1/chat/completions", headers={"Origin": OTHER, **PREFLIGHT})
    assert r.status == 204
    assert r.headers["Access-Control-Allow-Origin"] == OTHER
    assert r.headers["Access-Control-Allow-Methods"] == "GET, POST, OPTIONS"
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert r.headers["Access-Control-Max-Age"] == "600" and "Origin" in r.headers["Vary"]


async def test_a_preflight_from_another_origin_is_403_naming_it(make_client: MakeClient) -> None:
    client = await make_client(allowed_origins=PAGE)
    r = await client.options("/v1/chat/completions", headers={"Origin": OTHER, **PREFLIGHT})
    body = await r.json()
    assert r.status == 403 and body["error"]["code"] == "origin_not_allowed"
    assert OTHER in body["error"]["message"] and "Access-Control-Allow-Origin" not in r.headers


async def test_a_listed_origin_passes_the_origin_check_and_reads_answers_and_errors(
    make_client: MakeClient,
) -> None:
    client = await make_client(allowed_origins=OTHER)
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": OTHER})
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == OTHER
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"Origin": OTHER})
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == OTHER
    assert "data: [DONE]" in await r.text()
    r = await client.post("/v1/chat/completions", json={"model": "m"}, headers={"Origin": OTHER})
    assert r.status == 400 and r.headers["Access-Control-Allow-Origin"] == OTHER
    assert r.headers["Access-Control-Expose-Headers"] == "Retry-After"


async def test_a_listed_origin_does_not_open_a_foreign_host(make_client: MakeClient) -> None:
    # DNS rebinding: the page's own name resolved to this server; its Host says so.
    client = await make_client(allowed_origins=OTHER)
    r = await client.get("/v1/models", headers={"Origin": OTHER, "Host": "ui.example.com"})
    assert r.status == 403 and "Host 'ui.example.com'" in (await r.json())["error"]["message"]


async def test_any_origin(make_client: MakeClient) -> None:
    client = await make_client(allowed_origins="*")
    r = await client.options("/v1/messages", headers={"Origin": OTHER, **PREFLIGHT})
    assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
    r = await client.get("/v1/models", headers={"Origin": "http://anything.example:8080"})
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"


async def test_a_preflight_needs_no_api_key_but_the_call_does(make_client: MakeClient) -> None:
    client = await make_client(allowed_origins=OTHER, api_key="k1")
    r = await client.options("/v1/chat/completions", headers={"Origin": OTHER, **PREFLIGHT})
    assert r.status == 204
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": OTHER})
    assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == OTHER  # the page can read why


@pytest.mark.parametrize("path", ["/v1/nope", "/"])
async def test_a_preflight_for_no_route_is_the_404(make_client: MakeClient, path: str) -> None:
    client = await make_client(allowed_origins=OTHER)
    r = await client.options(path, headers={"Origin": OTHER, **PREFLIGHT})
    body: dict[str, Any] = await r.json()
    assert r.status == 404 and "the routes are" in body["error"]["message"]


async def test_a_404_lists_the_routes_and_a_405_the_methods(make_client: MakeClient) -> None:
    client = await make_client()
    r = await client.get("/v1/chat/completion")
    message = (await r.json())["error"]["message"]
    assert r.status == 404 and message.startswith("Not Found: no route for GET '/v1/chat/completion'")
    for route in ("POST /v1/chat/completions", "POST /v1/messages", "GET /v1/models", "GET /ready"):
        assert route in message, route
    r = await client.get("/v1/chat/completions")
    error = (await r.json())["error"]
    assert r.status == 405 and error["code"] == "method_not_allowed"
    assert error["message"] == "Method Not Allowed: GET '/v1/chat/completions'; it takes POST"
