"""``exl3-sidecar chat`` against this project's proxy app (``create_app`` on the fake
engine client), in each API: the proxy's own dialect encoders, not a script of them."""

from __future__ import annotations

from typing import Any

import pytest

from launcher.chat.apis import APIS
from protocol import QueueProgress, Submit
from proxy.app import create_app
from tests.fakes.engine_client import FakeEngineClient, Step, completion_events, make_config
from tests.unit.launcher.test_chat import clean_environment, run_cli  # noqa: F401  (autouse fixture)

PROMPT_TOKENS, CACHED, CHUNK = 40, 16, 8
DRAFT = (3, 1)  # accepted, rejected
TEXTS = ["Hel", "lo", "!"]
QUEUE = [(2, 2, 100), (1, 1, 300)]  # position, queued, time_ms


def script(submit: Submit) -> list[Step]:
    rid = submit.request_id
    queue: list[Step] = [QueueProgress(rid, p, n, t) for p, n, t in QUEUE]
    events = completion_events(
        rid, TEXTS, prompt_tokens=PROMPT_TOKENS, cached_tokens=CACHED, chunk=CHUNK, draft=DRAFT
    )
    return [*queue, *events]


@pytest.mark.parametrize("api", list(APIS))
async def test_each_api_of_the_real_proxy(aiohttp_server: Any, api: str) -> None:
    fake = FakeEngineClient()
    fake.script = script
    server = await aiohttp_server(create_app(make_config(), fake))
    base_url = str(server.make_url("/v1"))
    r = await run_cli(["chat", "--base-url", base_url, "--api", api, "--system", "Be brief.", "hi"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "".join(TEXTS) + "\n"
    lines = r.stderr.splitlines()
    assert [line for line in lines if line.startswith("queued:")] == [
        f"queued: position {p} of {n}, waited {t / 1000:.1f} s" for p, n, t in QUEUE
    ]
    prefill = [line for line in lines if line.startswith("prefill:")]
    steps = -(-(PROMPT_TOKENS - CACHED) // CHUNK)
    time_s = 10 * steps / 1000  # the fake's prefill clock: 10 ms per chunk
    rate = (PROMPT_TOKENS - CACHED) / time_s
    assert prefill[0] == f"prefill: {CACHED}/{PROMPT_TOKENS} tokens (cached {CACHED})"
    done = f"prefill: {PROMPT_TOKENS}/{PROMPT_TOKENS} tokens (cached {CACHED})"
    assert prefill[-1] == f"{done}, {rate:.0f} tok/s, in {time_s:.2f} s"
    (usage,) = [line for line in lines if line.startswith("usage:")]
    accepted, verified = DRAFT[0], sum(DRAFT)
    cached_pct, accepted_pct = 100 * CACHED / PROMPT_TOKENS, 100 * accepted / verified
    assert usage.startswith(
        f"usage: prompt {PROMPT_TOKENS} (cached {CACHED}, {cached_pct:.0f}%), completion {len(TEXTS)}, "
        f"drafts accepted {accepted}/{verified} ({accepted_pct:.0f}%), ttft "
    )
    assert "finish" not in usage  # stop, in each API's words
    (submit,) = fake.submits
    assert [(m.role, m.content) for m in submit.messages] == [("system", "Be brief."), ("user", "hi")]
