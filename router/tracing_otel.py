"""The OpenTelemetry form of ``router/tracing.py``: spans recorded with OpenTelemetry's SDK
and exported in batches over OTLP/HTTP (protobuf). Imported only when tracing is configured
(the ``tracing`` extra installs its packages).

A request's root span ``router.request`` (SERVER) is parented on the client's
``traceparent`` when it sent one, and sampled as it says; a trace the router starts is
sampled at ``sample_ratio``. A request not sampled gets the no-op trace, so the engine sees
the client's context unchanged. Spans are parented explicitly, never through the ambient
context, since a request's stages are awaited among other requests'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Self, Unpack, cast

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from conductor.runtime import package_version

from .tracing import (
    ATTRIBUTE_NAMES,
    SHUTDOWN_TIMEOUT_S,
    RequestTrace,
    SpanAttributes,
    SpanName,
    TraceContext,
    Tracer,
    TraceSpan,
    TracingSection,
)

log = logging.getLogger("router.tracing")

ROOT_SPAN = "router.request"
EXPORT_TIMEOUT_S = 5.0  # one batch's POST to the collector, retries included
# a client span is an error from a 4xx answer on, a server span from a 5xx (OTel's HTTP rules)
CLIENT_ERROR_FROM = 400
SERVER_ERROR_FROM = 500


def _named(attributes: SpanAttributes) -> dict[str, AttributeValue]:
    return {ATTRIBUTE_NAMES[key]: cast(AttributeValue, value) for key, value in attributes.items()}


def _context_of(span: trace_api.Span, tracestate: str) -> TraceContext:
    """``span`` as the caller of whatever it calls, with the client's ``tracestate``."""
    context = span.get_span_context()
    return TraceContext(
        f"{context.trace_id:032x}", f"{context.span_id:016x}", context.trace_flags, tracestate
    )


def _parent(incoming: TraceContext | None) -> Context:
    """The context a root span starts in: the client's span as a remote parent, else none
    (an empty context, never the ambient one)."""
    if incoming is None:
        return Context()
    remote = SpanContext(
        int(incoming.trace_id, 16),
        int(incoming.parent_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(incoming.flags),
    )
    return trace_api.set_span_in_context(NonRecordingSpan(remote), Context())


class _RecordedSpan:
    """A span the SDK records; the calls made within it name it as their parent."""

    __slots__ = ("_span", "_tracestate", "_error_from")

    def __init__(self, span: trace_api.Span, tracestate: str, error_from: int) -> None:
        self._span = span
        self._tracestate = tracestate
        self._error_from = error_from

    def set(self, **attributes: Unpack[SpanAttributes]) -> None:
        self._span.set_attributes(_named(attributes))
        status_code = attributes.get("status_code")
        if status_code is not None and status_code >= self._error_from:
            self._span.set_status(Status(StatusCode.ERROR))

    def upstream_headers(self) -> dict[str, str]:
        return _context_of(self._span, self._tracestate).headers()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is not None:  # the stage failed or was cancelled: its type, no traceback
            self._span.set_status(Status(StatusCode.ERROR))
            self._span.set_attribute(ATTRIBUTE_NAMES["error_type"], exc_type.__qualname__)
        self._span.end()


class _RecordingTrace(RequestTrace):
    """A sampled request: its root span and a child span per stage."""

    __slots__ = ("_tracer", "_root_span", "_root", "_in_root")

    def __init__(self, tracer: trace_api.Tracer, root: trace_api.Span, tracestate: str) -> None:
        super().__init__(_context_of(root, tracestate))
        self._tracer = tracer
        self._root_span = root
        self._root = _RecordedSpan(root, tracestate, SERVER_ERROR_FROM)
        self._in_root = trace_api.set_span_in_context(root, Context())

    def span(self, name: SpanName, **attributes: Unpack[SpanAttributes]) -> TraceSpan:
        kind = SpanKind.CLIENT if name == "upstream" else SpanKind.INTERNAL
        child = self._tracer.start_span(
            name, context=self._in_root, kind=kind, attributes=_named(attributes)
        )
        return _RecordedSpan(child, self.context.tracestate, CLIENT_ERROR_FROM)

    def set(self, **attributes: Unpack[SpanAttributes]) -> None:
        self._root.set(**attributes)

    def upstream_headers(self) -> dict[str, str]:
        return self._root.upstream_headers()

    def end(self, status_code: int) -> None:
        if self._root_span.is_recording():  # not ended yet
            self._root.set(status_code=status_code)
            self._root_span.end()


class _CountingExporter(SpanExporter):
    """OTLP's exporter, counting the spans it delivered and the ones it gave up on."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter
        self.exported = 0  # written by the batch processor's one thread
        self.failed = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self._exporter.export(spans)
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _ExportCollector(Collector):
    def __init__(self, exporter: _CountingExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterable[Metric]:
        spans = CounterMetricFamily(
            "router_trace_spans",
            "Spans sent to the OTLP endpoint, by result (failed: dropped after the "
            "exporter's retries)",
            labels=["result"],
        )
        spans.add_metric(["exported"], self._exporter.exported)
        spans.add_metric(["failed"], self._exporter.failed)
        yield spans


class OtelTracer(Tracer):
    """Records sampled requests' spans and exports them in batches from a thread of its own
    (BatchSpanProcessor), so a slow collector never holds a request."""

    def __init__(self, section: TracingSection) -> None:
        self._exporter = _CountingExporter(
            OTLPSpanExporter(endpoint=section.otlp_endpoint, timeout=EXPORT_TIMEOUT_S)
        )
        self._provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(section.sample_ratio)),
            resource=Resource.create(
                {"service.name": section.service_name, "service.version": package_version()}
            ),
        )
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter))
        self._tracer = self._provider.get_tracer("router.tracing", package_version())

    def begin(
        self, headers: Mapping[str, str], **attributes: Unpack[SpanAttributes]
    ) -> RequestTrace:
        incoming = TraceContext.from_headers(headers)
        root = self._tracer.start_span(
            ROOT_SPAN,
            context=_parent(incoming),
            kind=SpanKind.SERVER,
            attributes=_named(attributes),
        )
        if not root.is_recording():  # sampled out: the engine gets the context as it came
            return RequestTrace(incoming or _context_of(root, ""))
        return _RecordingTrace(self._tracer, root, incoming.tracestate if incoming else "")

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(_ExportCollector(self._exporter))

    async def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        if not await _finished_within(self._provider.shutdown, timeout):
            log.warning("tracing spans still unsent at stop are dropped: timeout_s=%.1f", timeout)


async def _finished_within(work: Callable[[], object], timeout: float) -> bool:
    """Run blocking ``work`` in a daemon thread (one still stuck at exit does not hold the
    process); whether it finished within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()

    def run() -> None:
        try:
            work()
        finally:
            with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
                loop.call_soon_threadsafe(finished.set)

    threading.Thread(target=run, name="tracing-shutdown", daemon=True).start()
    try:
        await asyncio.wait_for(finished.wait(), timeout)
    except TimeoutError:
        return False
    return True
