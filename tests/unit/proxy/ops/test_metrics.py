"""``GET /metrics``: every family present, token counters equal to the usage the
clients were sent, histogram counts equal to the requests, gauges from the
worker's heartbeat, one log line per request (text and JSON)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import msgspec
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol import PROTOCOL_VERSION, FinishReason, Submit
from protocol.logs import JsonFormatter, TextFormatter
from tests.fakes.engine_client import WORKER, FakeEngineClient, Gate, Step, completion_events
from tests.unit.proxy.conftest import MakeClient

COUNTERS = (
    "prompt_tokens", "prompt_tokens_cached", "generation_tokens",
    "draft_tokens_accepted", "draft_tokens_rejected", "kv_events_dropped",
)  # fmt: skip
HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds", "request_duration_seconds",
    "queue_time_seconds", "prefill_time_seconds",
)  # fmt: skip
GAUGES = (
    "requests_running", "sequences_running", "requests_waiting", "kv_cache_usage_ratio", "worker_up", "info",
)  # fmt: skip


def scripted(submit: Submit) -> list[Step]:
    """Counts chosen by the prompt text ``"p=P c=C k=K d=A,R"``: prompt tokens,
    cached tokens, completion tokens (one per text), draft accepted/rejected."""
    text = submit.messages[-1].content if submit.messages else submit.prompt or ""
    spec = dict(part.split("=") for part in text.split())
    draft = tuple(int(x) for x in spec["d"].split(",")) if "d" in spec else None
    return list(
        completion_events(
            submit.request_id,
            [f"t{i} " for i in range(int(spec["k"]))],
            prompt_tokens=int(spec["p"]),
            cached_tokens=int(spec["c"]),
            finish_reason=FinishReason.LENGTH,
            draft=draft,  # type: ignore[arg-type]
        )
    )


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, parsed by prometheus_client's own parser."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snap: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return snap.get(("exl3_sidecar_" + name, tuple(sorted(labels.items()))), 0.0)


async def scrape(client: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return samples(await resp.text())


async def test_every_family_is_exposed(make_client: MakeClient) -> None:
    client = await make_client()
    text = await (await client.get("/metrics")).text()
    names = {f.name for f in text_string_to_metric_families(text)}
    for n in (*COUNTERS, "requests", "request_errors", *HISTOGRAMS, *GAUGES):
        assert "exl3_sidecar_" + n in names, n
    snap = samples(text)
    assert value(snap, "worker_up") == 1
    labels = {"model": "fake-model", "backend": "fake", "drafting": "none"}
    assert value(snap, "info", **labels, protocol_version=str(PROTOCOL_VERSION)) == 1


async def test_token_counters_equal_the_usage_clients_were_sent(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = scripted
    client = await make_client()
    before = await scrape(client)
    rng = random.Random(7)
    sent = dict.fromkeys(("prompt", "cached", "completion", "accepted", "rejected"), 0)
    requests = 0
    chat = 0
    for i in range(24):
        p = rng.randint(5, 40)
        c = rng.choice([0, 0, rng.randint(1, p - 1)])
        k = rng.randint(1, 6)
        spec = f"p={p} c={c} k={k}" + (f" d={rng.randint(0, 5)},{rng.randint(0, 3)}" if i % 3 else "")
        n = rng.choice([1, 1, 2, 3])
        stream = i % 2 == 0
        is_chat = i % 4 != 3
        body: dict[str, Any] = {"model": "m", "max_tokens": 50, "n": n, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if is_chat:
            body["messages"] = [{"role": "user", "content": spec}]
            path = "/v1/chat/completions"
            chat += 1
        else:
            body["prompt"] = spec
            path = "/v1/completions"
        resp = await client.post(path, json=body)
        assert resp.status == 200
        if stream:
            events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
            usage = orjson.loads(events[-2])["usage"]
        else:
            usage = (await resp.json())["usage"]
        requests += 1
        sent["prompt"] += usage["prompt_tokens"]
        sent["cached"] += usage["prompt_tokens_details"]["cached_tokens"]
        sent["completion"] += usage["completion_tokens"]
        details = usage.get("completion_tokens_details") or {}
        sent["accepted"] += details.get("accepted_prediction_tokens", 0)
        sent["rejected"] += details.get("rejected_prediction_tokens", 0)
    after = await scrape(client)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("prompt_tokens_total") == sent["prompt"]
    assert delta("prompt_tokens_cached_total") == sent["cached"]
    assert delta("generation_tokens_total") == sent["completion"]
    assert delta("draft_tokens_accepted_total") == sent["accepted"]
    assert delta("draft_tokens_rejected_total") == sent["rejected"]
    assert sent["cached"] > 0 and sent["accepted"] > 0  # the mix exercised both
    for h in ("time_to_first_token_seconds", "request_duration_seconds", "queue_time_seconds",
              "prefill_time_seconds"):  # fmt: skip
        assert delta(h + "_count") == requests, h
        assert delta(h + "_bucket", le="+Inf") == requests, h
    # completion_events: decode time 0.5 s, so mean ITL = 0.5 / (k - 1) per choice.
    assert delta("inter_token_latency_seconds_count") > 0
    assert delta("requests_total", endpoint="/v1/chat/completions", status="200") == chat
    assert delta("requests_total", endpoint="/v1/completions", status="200") == requests - chat


async def test_errors_are_counted_by_code(make_client: MakeClient, fake: FakeEngineClient) -> None:
    client = await make_client(max_n=2)
    before = await scrape(client)
    resp = await client.post("/v1/chat/completions", json={"model": "m", "messages": [], "n": 3})
    assert resp.status == 400
    resp = await client.get("/v1/nope")
    assert resp.status == 404
    after = await scrape(client)
    code = "invalid_request_error"  # no code of its own: the envelope's type
    assert (
        value(after, "request_errors_total", code=code) - value(before, "request_errors_total", code=code)
        == 1
    )
    assert value(after, "requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert value(after, "requests_total", endpoint="unmatched", status="404") == 1
    # Probes and scrapes are not requests of the API.
    await client.get("/health")
    assert not any("/health" in str(k) or "/metrics" in str(k) for k in (await scrape(client)))


async def test_gauges_follow_the_heartbeat_and_the_worker(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    fake.waiting_requests = 3
    fake.kv_cache_usage = 0.25
    snap = await scrape(client)
    assert value(snap, "requests_waiting") == 3
    assert value(snap, "kv_cache_usage_ratio") == 0.25
    assert value(snap, "worker_up") == 1
    fake.is_ready = False
    snap = await scrape(client)
    assert value(snap, "worker_up") == 0
    assert value(snap, "requests_waiting") == 0


async def test_kv_event_drops_come_from_the_heartbeat(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    assert value(await scrape(client), "kv_events_dropped_total") == 0
    fake.kv_events_dropped = 7
    assert value(await scrape(client), "kv_events_dropped_total") == 7
    fake.is_ready = False  # no worker: nothing dropped that this pod knows of
    assert value(await scrape(client), "kv_events_dropped_total") == 0


async def test_running_counts_requests_and_sequences_apart(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    """The Inference Extension's model-server protocol counts requests running (a
    request of n choices once); the sequences have a gauge of their own."""
    gate = Gate(asyncio.Event())
    fake.script = lambda submit: [gate, *scripted(submit)]
    client = await make_client()
    body = {"model": "m", "messages": [{"role": "user", "content": "p=3 c=0 k=2"}], "n": 3}
    task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    await fake.wait_submits(1)
    snap = await scrape(client)  # a worker that does not count requests: its sequences
    assert value(snap, "requests_running") == value(snap, "sequences_running") == 3
    fake.running_requests = 1
    snap = await scrape(client)
    assert (value(snap, "requests_running"), value(snap, "sequences_running")) == (1, 3)
    gate.event.set()
    assert (await task).status == 200


async def test_cache_config_info_gives_the_kv_geometry(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    client = await make_client()
    assert not [k for k in await scrape(client) if k[0] == "exl3_sidecar_cache_config_info"]  # unknown: none
    fake.worker_ready = msgspec.structs.replace(WORKER, kv_cache_tokens=65536, kv_block_tokens=256)
    snap = await scrape(client)
    assert value(snap, "cache_config_info", block_size="256", num_gpu_blocks="256") == 1


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_one_log_line_per_request(
    make_client: MakeClient, fake: FakeEngineClient, caplog: pytest.LogCaptureFixture, fmt: str
) -> None:
    fake.script = scripted
    client = await make_client()
    caplog.set_level(logging.INFO, logger="proxy.requests")
    body = {"model": "m", "messages": [{"role": "user", "content": "p=12 c=4 k=3 d=2,1"}], "max_tokens": 9}
    resp = await client.post("/v1/chat/completions", json=body)
    payload = await resp.json()
    for path in ("/health", "/ready", "/metrics"):
        await client.get(path)
    records = [r for r in caplog.records if r.name == "proxy.requests" and r.levelno == logging.INFO]
    assert len(records) == 1
    formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    line = formatter.format(records[0])
    assert "\n" not in line
    if fmt == "text":
        assert f"request_id={payload['id']}" in line and "prompt_tokens=12" in line
        return
    doc = orjson.loads(line)
    assert doc["request_id"] == payload["id"]
    assert doc["endpoint"] == "/v1/chat/completions" and doc["status"] == 200
    assert (doc["prompt_tokens"], doc["cached_tokens"], doc["completion_tokens"]) == (12, 4, 3)
    assert (doc["draft_accepted"], doc["draft_rejected"]) == (2, 1)
    assert doc["finish_reason"] == "length"
    assert doc["ttft_s"] >= 0
    # completion_events: 3 tokens, 0.5 s of decode -> (3 - 1) / 0.5 tok/s
    assert doc["decode_tps"] == pytest.approx(4.0)


async def test_a_client_that_leaves_is_counted_499(make_client: MakeClient, fake: FakeEngineClient) -> None:
    gate = asyncio.Event()  # never set: the request hangs in prefill
    fake.script = lambda submit: [*completion_events(submit.request_id, [])[:2], Gate(gate)]
    client = await make_client()
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "return_progress": True,
    }
    resp = await client.post("/v1/chat/completions", json=body)
    await resp.content.readany()
    resp.close()
    await fake.wait_abort()
    for _ in range(100):
        snap = await scrape(client)
        if value(snap, "requests_total", endpoint="/v1/chat/completions", status="499") == 1:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("no 499 counted")
    assert value(snap, "generation_tokens_total") == 0
