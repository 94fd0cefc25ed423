"""A loopback OTLP/HTTP trace receiver: what a collector gets from the router, decoded with
OpenTelemetry's own protobuf classes (``opentelemetry-proto``, which the exporter sends with).

``POST /v1/traces`` takes an ``ExportTraceServiceRequest`` (protobuf) and answers an empty
``ExportTraceServiceResponse``; the spans are kept in arrival order for assertions. With
``stalled`` set the receiver holds every export unanswered until it closes (a hung
collector); with ``refusing`` set it answers every export 400 (a collector that rejects
them: the exporter gives up without retrying).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from aiohttp import web
from aiohttp.test_utils import TestServer
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.support.api import eventually

PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class ReceivedSpan:
    """A span as the collector got it; ids in lower-case hex, ``parent_id`` "" for a root."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str  # "SERVER", "CLIENT", "INTERNAL", ...
    status: str  # "UNSET", "OK" or "ERROR"
    attributes: dict[str, Any]
    service_name: str


def _value(value: AnyValue) -> Any:
    field = value.WhichOneof("value")
    return None if field is None else getattr(value, field)


def _attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _received(span: Span, service_name: str) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(),
        kind=Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
        status=Status.StatusCode.Name(span.status.code).removeprefix("STATUS_CODE_"),
        attributes=_attributes(list(span.attributes)),
        service_name=service_name,
    )


class OtlpReceiver:
    """``async with OtlpReceiver() as receiver``: listening on 127.0.0.1 at ``receiver.url``."""

    def __init__(self, stalled: bool = False, refusing: bool = False) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._stalled = stalled
        self._refusing = refusing
        self._closing = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self._server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self._server.make_url("/v1/traces"))

    async def __aenter__(self) -> Self:
        await self._server.start_server()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._closing.set()
        await self._server.close()

    async def wait_for(self, count: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        """The spans once at least ``count`` have arrived; fails after ``timeout``."""

        async def received() -> list[ReceivedSpan]:
            return list(self.spans)

        return await eventually(received, lambda spans: len(spans) >= count, timeout)

    async def _export(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self._stalled:
            await self._closing.wait()
        if self._refusing:
            return web.Response(status=400, text="refused")
        try:
            export = ExportTraceServiceRequest.FromString(await request.read())
        except DecodeError:
            return web.Response(status=400, text="not an ExportTraceServiceRequest")
        for resource_spans in export.resource_spans:
            resource = _attributes(list(resource_spans.resource.attributes))
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(_received(span, service) for span in scope_spans.spans)
        body = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=body, content_type=PROTOBUF)
