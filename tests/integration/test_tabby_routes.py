"""TabbyAPI's read routes and llama.cpp's ``/props`` through a real synthetic
worker, in the shapes of TabbyAPI's ``endpoints/core/types/`` (``ModelCard``,
``TokenEncodeResponse``, ``TokenDecodeResponse``, ``AuthPermissionResponse``) and
llama.cpp's ``/props``; counts equal what generation reports."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.synthetic import served_proxy, synthetic_worker

MSGS = [{"role": "user", "content": "one two three four"}]


async def test_tabby_routes(tmp_path: Path) -> None:
    with synthetic_worker(tmp_path) as addrs:
        async with served_proxy(addrs) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            card = (await c.get("/v1/model")).json()
            assert set(card) == {"id", "object", "created", "owned_by", "parameters"}
            assert card["object"] == "model" and isinstance(card["created"], int)
            params = card["parameters"]
            assert params["max_seq_len"] > 0 and params["max_batch_size"] >= 1 and params["cache_size"] > 0
            listed = (await c.get("/v1/model/list")).json()
            assert listed == {"object": "list", "data": [card]}
            models = (await c.get("/v1/models")).json()
            assert models["data"][0]["id"] == card["id"]

            completion = (await c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 2})).json()
            enc = (await c.post("/v1/token/encode", json={"text": "a b c"})).json()
            assert set(enc) == {"tokens", "length"}
            assert enc["length"] == len(enc["tokens"]) == completion["usage"]["prompt_tokens"]
            chat = (await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})).json()
            enc_chat = (await c.post("/v1/token/encode", json={"text": MSGS})).json()
            assert enc_chat["length"] == chat["usage"]["prompt_tokens"]
            dec = (await c.post("/v1/token/decode", json={"tokens": enc["tokens"]})).json()
            assert dec == {"text": " ".join(f"t{t}" for t in enc["tokens"])}

            bad = await c.post("/v1/token/encode", json={"text": "a", "encode_special_tokens": False})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "encode_special_tokens"
            bad = await c.post("/v1/token/encode", json={"text": MSGS, "add_bos_token": True})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_bos_token"

            assert (await c.get("/v1/auth/permission")).json() == {"permission": "api"}
            props = (await c.get("/props")).json()
            assert props["default_generation_settings"] == {"n_ctx": params["max_seq_len"]}
            assert props["total_slots"] == params["max_batch_size"]
            assert isinstance(props["chat_template"], str)
            assert props["kernels"] is None  # the CPU engine's alone

            for method, path in (
                ("POST", "/v1/model/load"),
                ("POST", "/v1/download"),
                ("GET", "/v1/lora/list"),
            ):
                r = await c.request(method, path, json={})
                assert r.status_code == 404
                assert "one model per worker" in r.json()["error"]["message"]
