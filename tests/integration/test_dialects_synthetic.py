"""The four dialects and the tokenizer endpoints through a real synthetic worker:
counts the worker tokenizes (``Tokenize``) equal what the same request reports."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.integration.synthetic import served_proxy, synthetic_worker

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one two three four"}]


async def test_counts_agree_across_dialects_and_lookups(tmp_path: Path) -> None:
    with synthetic_worker(tmp_path) as addrs:
        async with served_proxy(addrs) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
            chat = (await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3})).json()
            prompt = chat["usage"]["prompt_tokens"]
            tok = (await c.post("/tokenize", json={"messages": MSGS})).json()
            assert tok["count"] == len(tok["tokens"]) == prompt
            assert tok["max_model_len"] > prompt
            system, user = MSGS
            anthropic = {"system": system["content"], "messages": [user]}
            counted = (await c.post("/v1/messages/count_tokens", json=anthropic)).json()
            assert counted == {"input_tokens": prompt}
            msg = (await c.post("/v1/messages", json={**anthropic, "max_tokens": 3})).json()
            assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == prompt
            resp = (
                await c.post(
                    "/v1/responses",
                    json={
                        "instructions": system["content"],
                        "input": user["content"],
                        "max_output_tokens": 3,
                    },
                )
            ).json()
            assert resp["usage"]["input_tokens"] == prompt
            assert resp["status"] == "incomplete"  # the synthetic engine runs to max_output_tokens
            text = (await c.post("/tokenize", json={"prompt": "a b c"})).json()
            assert text["count"] == 3
            detok = (await c.post("/detokenize", json={"tokens": text["tokens"]})).json()
            assert detok == {"prompt": " ".join(f"t{t}" for t in text["tokens"])}
            bad = await c.post("/detokenize", json={"tokens": [-1]})
            assert bad.status_code == 400
