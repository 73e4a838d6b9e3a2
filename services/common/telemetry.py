"""Tracing: OpenTelemetry setup, gRPC interceptors, W3C context for pool entries.

Every RPC carries W3C trace context through the opentelemetry gRPC interceptors; every pool entry
carries it in its `trace_context` map (`inject` on submit, `extract` on take), so one request's
spans (gateway -> router -> drafter / verifier through the pool) form one trace in Jaeger.
Export is off by default; set an OTLP/gRPC endpoint (SPECMESH_TELEMETRY__OTLP_ENDPOINT) or the
console exporter for debugging.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, filters
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from specmesh_services.common.config import TelemetrySettings

log = logging.getLogger(__name__)

_NOT_HEALTH = filters.negate(filters.service_name("grpc.health.v1.Health"))


def setup(service_name: str, settings: TelemetrySettings,
          extra_exporter: SpanExporter | None = None) -> TracerProvider | None:
    """Installs the global tracer provider of this process when any exporter is configured."""
    exporters: list[SpanExporter] = []
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=True))
    if settings.console:
        exporters.append(ConsoleSpanExporter())
    if extra_exporter is not None:
        exporters.append(extra_exporter)
    if not exporters:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    log.info("tracing %s to %s", service_name,
             ", ".join(type(e).__name__ for e in exporters))
    return provider


def shutdown() -> None:
    """Flushes and stops the exporters (call on process exit)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def server_interceptors() -> list:
    return [aio_server_interceptor(filter_=_NOT_HEALTH)]


def client_interceptors() -> list:
    return list(aio_client_interceptors(filter_=_NOT_HEALTH))


def inject() -> dict[str, str]:
    """W3C context of the current span, for a pool entry."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str]) -> context.Context:
    """Context to parent a span on, from a pool entry's trace_context."""
    return propagate.extract(dict(carrier))
