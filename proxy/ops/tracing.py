"""Request traces, exported over OTLP with the OpenTelemetry SDK when ``OTEL_*`` asks.

Off unless the environment names an OTLP endpoint
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``),
``OTEL_TRACES_EXPORTER`` is unset or ``otlp``, and ``OTEL_SDK_DISABLED`` is not
``true`` (the SDK's environment variables: opentelemetry.io, "Environment
Variable Specification"). The SDK is the optional extra ``tracing``
(``pip install 'exl3-sidecar[tracing]'``); without it a request for traces logs
one warning and the proxy runs without them.

One trace per generation request, built once the request ends
(``proxy.ops.inflight`` calls ``RequestTracer`` from the request's ``finally``), with
explicit start and end times, so that nothing runs per event and no span is
open while the request is:

- ``<operation> <model>`` (kind SERVER; ``chat``, or ``text_completion`` for
  ``/v1/completions``, as the GenAI semantic conventions name operations): from
  the request's arrival to its end, a child of the incoming ``traceparent``
  (the propagators of ``OTEL_PROPAGATORS``, W3C trace context by default).
  Attributes: ``gen_ai.operation.name``, ``gen_ai.response.id``,
  ``gen_ai.response.model``, ``gen_ai.usage.input_tokens`` (prompt),
  ``gen_ai.usage.cache_read.input_tokens`` (cached),
  ``gen_ai.usage.output_tokens`` (completion), ``gen_ai.response.finish_reasons``,
  ``gen_ai.response.time_to_first_chunk`` (s), ``exl3_sidecar.draft.accepted`` /
  ``.rejected`` (with drafting on), ``exl3_sidecar.dialect``, ``http.route``,
  ``exl3_sidecar.stream``, ``exl3_sidecar.choices``, ``exl3_sidecar.correlation_id``
  (the client's ``X-Request-Id``, else the response id:
  ``proxy.ops.request_log.RequestRecord.correlation_id``); a request without a whole
  answer has status ERROR and ``error.type`` (its error code, ``client_gone``).
- ``queue``, ``prefill``, ``decode``: the worker's timings of the request
  (``Finished.time_queued``/``time_prefill``/``time_decode`` of choice 0, the
  longest decode over choices), laid end to end from the moment its ``Submit``
  was sent; each clipped to the request's end. Only for a request whose choices
  all finished: the worker reports timings with ``Finished``.

The spans go to a ``BatchSpanProcessor`` (a thread of the SDK's own encodes and
sends them), never written on the event loop. Sampling is the SDK's
(``OTEL_TRACES_SAMPLER``; by default a sampled parent is followed, a request
without one is sampled). Cost: ``benchmarks/tracing_cost.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiohttp import web

from proxy.ops.inflight import INFLIGHT, Tracked

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

TRACER_NAME = "exl3-sidecar"
DEFAULT_SERVICE_NAME = "exl3-sidecar"
"""``service.name`` unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` say otherwise."""

_OPERATION = {"completions": "text_completion"}  # every other dialect is a chat


def tracing_requested(env: Mapping[str, str]) -> bool:
    """Whether ``env`` asks for OTLP traces (module docstring)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class RequestTracer:
    """Turns each closed ``Tracked`` into its spans on ``provider`` (an
    ``InFlight`` listener). ``provider`` is an SDK ``TracerProvider``."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import propagate, trace

        self.provider = provider
        self._tracer = provider.get_tracer(TRACER_NAME)
        self._trace = trace
        self._extract = propagate.extract

    def __call__(self, t: Tracked) -> None:
        trace = self._trace
        gen = t.gen
        closed = t.closed_at if t.closed_at is not None else t.submitted_at

        def ns(monotonic: float) -> int:
            return t.submitted_ns + round((monotonic - t.submitted_at) * 1e9)

        start, end = ns(t.record.arrived), ns(closed)
        v = t.view()
        operation = _OPERATION.get(t.dialect, "chat")
        attrs: dict[str, str | bool | int | float | tuple[str, ...]] = {
            "gen_ai.operation.name": operation,
            "gen_ai.response.id": t.request_id,
            "gen_ai.response.model": t.model,
            "gen_ai.usage.input_tokens": v.prompt_tokens,
            "gen_ai.usage.cache_read.input_tokens": v.cached_tokens,
            "gen_ai.usage.output_tokens": v.completion_tokens,
            "exl3_sidecar.dialect": t.dialect,
            "http.route": t.endpoint,
            "exl3_sidecar.stream": t.stream,
            "exl3_sidecar.choices": t.choices,
            "exl3_sidecar.correlation_id": t.record.correlation_id(),
        }
        reasons = tuple(c.finish_reason for c in gen.choices if c.finish_reason is not None)
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = reasons
        if gen.first_token_at is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = round(gen.first_token_at - t.record.arrived, 6)
        if v.draft_accepted is not None:
            attrs["exl3_sidecar.draft.accepted"] = v.draft_accepted
            attrs["exl3_sidecar.draft.rejected"] = v.draft_rejected or 0
        if t.error is not None:
            attrs["error.type"] = t.error
        parent = self._extract(t.headers)
        root = self._tracer.start_span(
            f"{operation} {t.model}",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes=attrs,
            start_time=start,
        )
        if t.error is not None:
            root.set_status(trace.Status(trace.StatusCode.ERROR, t.error))
        if gen.done and root.is_recording():
            first = gen.choices[0].finished
            assert first is not None
            decode = max(c.finished.time_decode for c in gen.choices if c.finished is not None)
            child = trace.set_span_in_context(root)
            at = t.submitted_ns
            phases: tuple[tuple[str, float, dict[str, int]], ...] = (
                ("queue", first.time_queued, {}),
                (
                    "prefill",
                    first.time_prefill,
                    {
                        "gen_ai.usage.input_tokens": v.prompt_tokens,
                        "gen_ai.usage.cache_read.input_tokens": v.cached_tokens,
                    },
                ),
                ("decode", decode, {"gen_ai.usage.output_tokens": v.completion_tokens}),
            )
            for name, seconds, extra in phases:
                until = min(at + round(seconds * 1e9), end)
                span = self._tracer.start_span(name, context=child, attributes=extra, start_time=at)
                span.end(end_time=until)
                at = until
        root.end(end_time=end)


TRACER: web.AppKey[RequestTracer] = web.AppKey("tracer", RequestTracer)
"""The app's ``RequestTracer``, when tracing is on."""


def install_tracer(app: web.Application, provider: TracerProvider) -> RequestTracer:
    """Trace ``app``'s requests on ``provider`` (tests pass one with an
    in-memory exporter); the provider is shut down (its spans flushed) on the
    app's cleanup, on a thread."""
    tracer = RequestTracer(provider)
    app[TRACER] = tracer
    app[INFLIGHT].listeners.append(tracer)

    async def shutdown(app: web.Application) -> None:
        await asyncio.to_thread(provider.shutdown)

    app.on_cleanup.append(shutdown)
    return tracer


def otlp_provider(env: Mapping[str, str]) -> TracerProvider | None:
    """A ``TracerProvider`` exporting over OTLP as ``env`` configures it
    (``OTEL_EXPORTER_OTLP_*``: endpoint, headers, timeout, protocol
    ``http/protobuf`` by default or ``grpc`` when its exporter is installed).
    ``None``, with one warning, when the SDK or the exporter is not installed
    or the protocol is not one of those. Reads the process environment too,
    as the SDK does."""
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or "http/protobuf").strip()
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

        exporter: SpanExporter
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporter = HttpExporter()
        elif protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found, unused-ignore]
                OTLPSpanExporter as GrpcExporter,
            )

            exporter = GrpcExporter()
        else:
            log.warning(
                "OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported (http/protobuf or grpc): no traces", protocol
            )
            return None
    except ImportError as e:
        log.warning(
            "OTEL_* asks for traces but %s is not installed (pip install 'exl3-sidecar[tracing]'): no traces",
            e.name or "the OpenTelemetry SDK",
        )
        return None
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def setup_tracing(app: web.Application, env: Mapping[str, str] | None = None) -> RequestTracer | None:
    """Trace ``app``'s generation requests when ``env`` (default: the process
    environment) asks for it (module docstring); else do nothing."""
    env = os.environ if env is None else env
    if not tracing_requested(env):
        return None
    provider = otlp_provider(env)
    if provider is None:
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    log.info("tracing requests to %s (OTLP)", endpoint)
    return install_tracer(app, provider)
