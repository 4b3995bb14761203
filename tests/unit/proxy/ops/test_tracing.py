"""Request traces: one SERVER span per generation request with queue, prefill and
decode children placed by the worker's timings, the usage as attributes, the
incoming ``traceparent`` continued; off, with one warning, when the SDK is missing.

Spans go to the SDK's in-memory exporter; expected values are computed here from
the fake worker's ``Finished`` events."""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from protocol.messages import PrefillProgress, Started
from proxy.app import create_app
from proxy.ops.inflight import INFLIGHT
from proxy.ops.tracing import TRACER, install_tracer, setup_tracing, tracing_requested
from tests.fakes.engine_client import FakeEngineClient, Gate, make_config, static_script

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TIMES = (0.25, 0.5, 1.0)  # queued, prefill, decode (s)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
async def traced(aiohttp_client: Any, fake: FakeEngineClient, exporter: InMemorySpanExporter) -> Any:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(make_config(served_model_name="served"), fake)
    install_tracer(app, provider)
    return await aiohttp_client(app)


async def eventually(ok: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait until ``ok()`` (a safety limit, not a speed check)."""
    async with asyncio.timeout(timeout_s):
        while True:
            if ok():
                return
            await asyncio.sleep(0.01)


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    out = {s.name: s for s in spans}
    assert len(out) == len(spans), [s.name for s in spans]
    return out


async def test_one_request_is_one_span_with_three_children(
    traced: Any, fake: FakeEngineClient, exporter: InMemorySpanExporter
) -> None:
    fake.script = static_script(
        ["Hi", " there"], prompt_tokens=40, cached_tokens=16, draft=(6, 3), tokens_per_text=2, times=TIMES
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}
    resp = await traced.post(
        "/v1/chat/completions",
        json=body,
        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "gw-42"},
    )
    assert resp.status == 200
    answer = await resp.json()
    spans = spans_by_name(exporter)
    assert set(spans) == {"chat served", "queue", "prefill", "decode"}
    root = spans["chat served"]
    assert root.kind is SpanKind.SERVER
    ctx, parent = root.get_span_context(), root.parent
    assert ctx is not None and parent is not None
    assert format(ctx.trace_id, "032x") == TRACE_ID and format(parent.span_id, "016x") == PARENT_ID
    attrs = dict(root.attributes or {})
    usage = answer["usage"]
    assert attrs["gen_ai.response.id"] == answer["id"]
    assert attrs["exl3_sidecar.correlation_id"] == resp.headers["X-Request-Id"] == "gw-42"
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.response.model"] == "served"
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] == 40
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 16
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 2 * 4
    assert attrs["gen_ai.response.finish_reasons"] == ("stop", "stop")
    assert (attrs["exl3_sidecar.draft.accepted"], attrs["exl3_sidecar.draft.rejected"]) == (2 * 6, 2 * 3)
    assert attrs["http.route"] == "/v1/chat/completions" and attrs["exl3_sidecar.choices"] == 2
    assert "error.type" not in attrs and root.status.status_code is StatusCode.UNSET

    # The worker's timings, end to end from the submit, clipped to the request's end.
    assert root.start_time is not None and root.end_time is not None
    at = spans["queue"].start_time
    assert at is not None and root.start_time <= at
    for name, seconds in zip(("queue", "prefill", "decode"), TIMES, strict=True):
        s = spans[name]
        assert s.parent is not None and s.parent.span_id == ctx.span_id
        assert s.context is not None and s.context.trace_id == ctx.trace_id
        assert s.start_time == at
        assert s.end_time == min(at + round(seconds * 1e9), root.end_time)
        at = s.end_time
    assert spans["prefill"].attributes == {
        "gen_ai.usage.input_tokens": 40,
        "gen_ai.usage.cache_read.input_tokens": 16,
    }


async def test_a_request_without_a_traceparent_starts_a_trace(
    traced: Any, exporter: InMemorySpanExporter
) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 3}
    assert (await traced.post("/v1/completions", json=body)).status == 200
    root = spans_by_name(exporter)["text_completion served"]
    assert root.parent is None
    # No X-Request-Id: the trace is tied to the response's id.
    assert (
        dict(root.attributes or {})["exl3_sidecar.correlation_id"]
        == dict(root.attributes or {})["gen_ai.response.id"]
    )
    assert dict(root.attributes or {})["exl3_sidecar.dialect"] == "completions"


async def test_a_client_gone_mid_prefill_is_an_error_span_without_children(
    traced: Any, fake: FakeEngineClient, exporter: InMemorySpanExporter
) -> None:
    hold = asyncio.Event()

    def script(submit: Any) -> list[Any]:
        rid = submit.request_id
        return [Started(rid, 50, 0), PrefillProgress(rid, 50, 0, 10, 5), Gate(hold)]

    fake.script = script
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}

    async def read() -> bytes:
        resp = await traced.post("/v1/chat/completions", json=body)
        return await resp.read()

    task = asyncio.create_task(read())
    await eventually(lambda: any(t.gen.prefill is not None for t in traced.app[INFLIGHT].requests.values()))
    task.cancel()
    await fake.wait_abort()
    await eventually(lambda: bool(exporter.get_finished_spans()))
    (root,) = exporter.get_finished_spans()
    assert root.status.status_code is StatusCode.ERROR
    attrs = dict(root.attributes or {})
    assert attrs["error.type"] == "client_gone"
    assert attrs["gen_ai.usage.input_tokens"] == 50 and attrs["gen_ai.usage.output_tokens"] == 0


@pytest.mark.parametrize(
    ("env", "wanted"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "console,otlp"}, True),
    ],
)
def test_which_environments_ask_for_traces(env: dict[str, str], wanted: bool) -> None:
    assert tracing_requested(env) is wanted


def test_an_otlp_endpoint_installs_a_tracer(fake: FakeEngineClient) -> None:
    app = create_app(make_config(), fake)
    tracer = setup_tracing(app, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    assert tracer is not None and app[TRACER] is tracer and tracer in app[INFLIGHT].listeners
    resource = tracer.provider.resource.attributes
    assert resource["service.name"] == "exl3-sidecar"
    tracer.provider.shutdown()


def test_without_the_sdk_tracing_is_off_with_one_warning(
    fake: FakeEngineClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_import = builtins.__import__

    def no_sdk(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("opentelemetry.sdk") or name.startswith("opentelemetry.exporter"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    app = create_app(make_config(), fake)
    with caplog.at_level(logging.WARNING, logger="proxy.ops.tracing"):
        assert setup_tracing(app, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}) is None
    (record,) = [r for r in caplog.records if r.name == "proxy.ops.tracing"]
    assert "exl3-sidecar[tracing]" in record.getMessage()
    assert TRACER not in app and app[INFLIGHT].listeners == []
