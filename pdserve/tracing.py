"""OpenTelemetry traces across the hops of a request (router, prefill, KV transfer, decode).

Off and free unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set: then ``init_tracing`` installs the
SDK with a batching OTLP/gRPC exporter (the ``otel`` extra: opentelemetry-sdk and
opentelemetry-exporter-otlp-proto-grpc), and every other ``OTEL_*`` variable of the SDK applies
(``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_EXPORTER_OTLP_INSECURE`` ...). Without it the API's no-op
tracer makes spans that record nothing and ``traceparent`` returns "".

One trace per sequence: the router's ``router.request`` span is its root; its W3C
``traceparent`` travels in the Prefill call's gRPC metadata and in ``DecodeRequest.traceparent``
(the Steps socket's start frames). Node-side spans are made when their work ends, from the times
noted on the way (``record``), so the engine thread never touches the tracer.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
_initialized = False
tracer = trace.get_tracer("pdserve")


def init_tracing(service_name: str) -> bool:
    """Install the SDK and the OTLP exporter when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (once per
    process); True when traces are exported. A missing SDK is an error naming the extra."""
    global _initialized
    if _initialized or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _initialized
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise RuntimeError(
            f"OTEL_EXPORTER_OTLP_ENDPOINT is set but the OpenTelemetry SDK is missing ({e}): "
            "install pdserve[otel], or unset OTEL_EXPORTER_OTLP_ENDPOINT"
        ) from e
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _initialized = True
    logger.info("traces exported by OTLP to %s", os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return True


def shutdown_tracing() -> None:
    """Flush what is batched (a stopping process)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if _initialized and shutdown is not None:
        shutdown()


def enabled() -> bool:
    return _initialized


def traceparent(span: trace.Span) -> str:
    """``span``'s W3C traceparent, "" for a span that records nothing."""
    if not span.get_span_context().is_valid:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def context_of(tp: str) -> Context | None:
    """The remote parent a ``traceparent`` names (None for "")."""
    return _PROPAGATOR.extract({"traceparent": tp}) if tp else None


def metadata_traceparent(metadata: Any) -> str:
    """The ``traceparent`` of a gRPC call's invocation metadata ("" when absent)."""
    for k, v in metadata or ():
        if k == "traceparent":
            return v if isinstance(v, str) else v.decode()
    return ""


# Epoch minus monotonic nanoseconds, once per process: one monotonic reading is always the same
# span time (spans that meet at a reading meet exactly).
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as the epoch nanoseconds spans carry."""
    return int(monotonic_s * 1e9) + _WALL_OFFSET_NS


def start_span(name: str, start_s: float, **attrs: Any) -> trace.Span:
    """A root span begun at a ``time.monotonic()`` reading (end it yourself)."""
    return tracer.start_span(name, start_time=wall_ns(start_s), attributes=attrs or None)


def record(
    name: str, parent: Context | trace.Span | None, start_s: float, end_s: float, **attrs: Any
) -> trace.Span:
    """A finished span from two ``time.monotonic()`` readings, child of ``parent``."""
    ctx = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    span = tracer.start_span(name, context=ctx, start_time=wall_ns(start_s), attributes=attrs or None)
    span.end(end_time=wall_ns(end_s))
    return span
