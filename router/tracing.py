"""Request tracing: the W3C trace context a request brings (or the router starts) carried on
to the engine, and the router's own spans for the request when an OTLP endpoint is set.

Off by default, and then nothing of OpenTelemetry is imported: a request's trace is one
small object, its spans are that same object (``span()`` returns ``self``) and every
attribute call returns at once, so the stages can be traced unconditionally. With
``tracing.otlp_endpoint`` set, ``make_tracer`` builds the OpenTelemetry form
(``router/tracing_otel.py``: a root span ``router.request`` with a child per stage,
exported over OTLP/HTTP in batches). docs/tracing.md lists the spans and their attributes.

Use::

    trace = tracer.begin(request.headers, method="POST", route="/v1/completions")
    with trace.span("tokenize") as span:
        span.set(prompt_tokens=len(ids), tokenized_by="router")
    with trace.span("upstream", server_address=host) as call:
        headers.update(call.upstream_headers())  # the engine's span is parented on ``call``
        call.set(status_code=response.status)
    response.headers.update(trace.response_headers())
    trace.end(response.status)
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from types import TracebackType
from typing import Literal, NamedTuple, Protocol, Self, TypedDict, Unpack
from urllib.parse import urlsplit

from multidict import MultiMapping
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, field_validator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_ID_HEADER = "x-conductor-trace-id"  # on every response: the id to look the trace up by
TRACING_EXTRA = "mooncake-conductor-py[tracing]"
DEFAULT_OTLP_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, when the endpoint names none
SHUTDOWN_TIMEOUT_S = 5.0  # at the router's stop, for the spans still buffered

SAMPLED = 0x01
# version-trace_id-parent_id-flags, lower-case hex only; a later version may append fields
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.S)
_ZERO_TRACE_ID = "0" * 32
_ZERO_SPAN_ID = "0" * 16

SpanName = Literal["tokenize", "index.query", "decision", "upstream"]


class SpanAttributes(TypedDict, total=False):
    """What a span may carry, by keyword; ``ATTRIBUTE_NAMES`` gives each one's exported name
    (OpenTelemetry's semantic conventions where they have one, ``conductor.*`` otherwise)."""

    method: str  # http.request.method
    route: str  # http.route
    status_code: int  # http.response.status_code: the router's answer, or the engine's
    server_address: str  # server.address: the engine called
    server_port: int  # server.port
    model: str  # gen_ai.request.model
    error_type: str  # error.type
    instance_id: str
    decode_instance_id: str
    cached_tokens: int
    prompt_tokens: int
    policy: str
    fallback: str
    tokenized_by: str
    key_id: str
    tenant_id: str
    lora_name: str
    attempt: int  # the upstream call's try, from 1


_SEMANTIC_CONVENTIONS = {
    "method": "http.request.method",
    "route": "http.route",
    "status_code": "http.response.status_code",
    "server_address": "server.address",
    "server_port": "server.port",
    "model": "gen_ai.request.model",
    "error_type": "error.type",
}
ATTRIBUTE_NAMES = {
    key: _SEMANTIC_CONVENTIONS.get(key, f"conductor.{key}")
    for key in SpanAttributes.__annotations__
}


class TracingSection(BaseModel):
    """The router config's ``tracing`` section: an empty ``otlp_endpoint`` is tracing off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # OTLP/HTTP (protobuf) URL of a collector, e.g. http://127.0.0.1:4318/v1/traces
    otlp_endpoint: str = ""
    service_name: str = Field(default="conductor-router", min_length=1)
    # the share of the traces the router starts that it records; a client's traceparent
    # decides for its own requests (its sampled flag)
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str) -> str:
        value = value.strip()
        if not value:
            return value
        url = urlsplit(value)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"must be an http(s) URL of an OTLP/HTTP receiver, got {value!r}")
        return value if url.path not in ("", "/") else value.rstrip("/") + DEFAULT_OTLP_PATH


class TracingUnavailable(ValueError):
    """Tracing is configured but OpenTelemetry's packages are not installed."""


class TraceContext(NamedTuple):
    """A W3C trace context: the trace, the caller's span in it (``parent_id``), the flags and
    the vendors' ``tracestate``, kept as given. A tuple: made per request, it costs least."""

    trace_id: str  # 32 lower-case hex digits, not all zero
    parent_id: str  # 16 lower-case hex digits, not all zero
    flags: int
    tracestate: str = ""

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    @classmethod
    def parse(cls, traceparent: str, tracestate: str = "") -> TraceContext | None:
        """The context of a ``traceparent`` value, or None where the spec says to ignore it
        (and start a new trace): version ``ff``, upper-case or missing digits, an all-zero
        id, or version 00 with anything after the flags. A later version is read by its
        first four fields, of whose flags only the sampled bit is known."""
        match = _TRACEPARENT.fullmatch(traceparent.strip(" \t"))
        if match is None:
            return None
        version, trace_id, parent_id, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest is not None):
            return None
        if trace_id == _ZERO_TRACE_ID or parent_id == _ZERO_SPAN_ID:
            return None
        known = int(flags, 16) if version == "00" else int(flags, 16) & SAMPLED
        return cls(trace_id, parent_id, known, tracestate.strip(" \t"))

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> TraceContext | None:
        """The context a request's headers carry, if valid. Two ``traceparent`` headers are
        invalid; several ``tracestate`` headers are one list. A plain mapping is looked up
        by the lower-case names."""
        parents = _values(headers, TRACEPARENT)
        if len(parents) != 1:
            return None
        return cls.parse(parents[0], ",".join(_values(headers, TRACESTATE)))

    @classmethod
    def start(cls, sampled: bool) -> TraceContext:
        """A new trace with random ids (the W3C's advice: ids that are unique by chance)."""
        return cls(_random_hex(128), _random_hex(64), SAMPLED if sampled else 0)

    def header(self) -> str:
        """The ``traceparent`` value (version 00) naming ``parent_id`` as the caller."""
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"

    def headers(self) -> dict[str, str]:
        """``traceparent`` and, when there is one, ``tracestate``, to send on."""
        if not self.tracestate:
            return {TRACEPARENT: self.header()}
        return {TRACEPARENT: self.header(), TRACESTATE: self.tracestate}


def _values(headers: Mapping[str, str], name: str) -> list[str]:
    if isinstance(headers, MultiMapping):
        return list(headers.getall(name, ()))
    value = headers.get(name)
    return [] if value is None else [value]


def _random_hex(bits: int) -> str:
    value = 0
    while not value:  # all zero is invalid (one chance in 2**bits)
        value = random.getrandbits(bits)
    return value.to_bytes(bits // 8).hex()


class TraceSpan(Protocol):
    """A stage of a request, entered as a context manager."""

    def set(self, **attributes: Unpack[SpanAttributes]) -> None:
        """Attributes of the span (keywords of ``SpanAttributes``)."""

    def upstream_headers(self) -> dict[str, str]:
        """The trace context headers for a call made within this span."""

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...


class RequestTrace:
    """One request's trace, which records nothing: the engine gets the client's context
    unchanged (or the one started for the request), spans are the trace itself."""

    __slots__ = ("context",)

    def __init__(self, context: TraceContext) -> None:
        self.context = context

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None

    def set(self, **attributes: Unpack[SpanAttributes]) -> None:
        """Attributes of the request's span (keywords of ``SpanAttributes``)."""

    @property
    def trace_id(self) -> str:
        return self.context.trace_id

    def span(self, name: SpanName, **attributes: Unpack[SpanAttributes]) -> TraceSpan:
        """A child of the request's span for one stage: ``with trace.span(...) as span``."""
        return self

    def upstream_headers(self) -> dict[str, str]:
        return self.context.headers()

    def response_headers(self) -> dict[str, str]:
        """``x-conductor-trace-id``: the client's handle on the trace."""
        return {TRACE_ID_HEADER: self.context.trace_id}

    def end(self, status_code: int) -> None:
        """The request is answered with ``status_code``; the trace is complete."""


class Tracer:
    """Tracing off: a request's trace is its context, nothing is recorded or exported."""

    def begin(
        self, headers: Mapping[str, str], **attributes: Unpack[SpanAttributes]
    ) -> RequestTrace:
        """The trace of a request with these headers: the client's context, else a new one,
        marked sampled so an engine that traces records it under the id the client gets."""
        return RequestTrace(TraceContext.from_headers(headers) or TraceContext.start(True))

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Expose the export counters on ``registry`` (none when nothing is exported)."""

    async def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Send what is still buffered, within ``timeout``; called once, at the router's stop."""


def make_tracer(section: TracingSection) -> Tracer:
    """The no-op tracer, or the OpenTelemetry one when ``section`` names an endpoint; raises
    ``TracingUnavailable`` when that needs packages that are not installed."""
    if not section.otlp_endpoint:
        return Tracer()
    try:
        from .tracing_otel import OtelTracer
    except ImportError as error:
        raise TracingUnavailable(missing_packages_message(error)) from None
    return OtelTracer(section)


def missing_packages_message(error: ImportError) -> str:
    missing = error.name or str(error)
    return (
        f"tracing.otlp_endpoint is set but OpenTelemetry is not installed ({missing}): "
        f"pip install '{TRACING_EXTRA}'"
    )
