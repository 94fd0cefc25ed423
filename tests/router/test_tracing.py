"""Request tracing (router/tracing.py): W3C trace context parsing and propagation, the no-op
tracer, and the OpenTelemetry tracer's spans as an OTLP/HTTP collector receives them."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from router.tracing import (
    TRACE_ID_HEADER,
    RequestTrace,
    TraceContext,
    Tracer,
    TracingSection,
    TracingUnavailable,
    make_tracer,
)
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.processes import REPO

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
CLIENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
VENDORS = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def headers(*pairs: tuple[str, str]) -> CIMultiDictProxy[str]:
    """Request headers as aiohttp hands them over (case-insensitive, repeatable)."""
    return CIMultiDictProxy(CIMultiDict(pairs))


# --- the traceparent header (W3C Trace Context) -------------------------------------------


def test_a_version_00_traceparent_is_read_and_rendered_back_unchanged() -> None:
    context = TraceContext.parse(CLIENT, VENDORS)
    assert context == TraceContext(TRACE_ID, PARENT_ID, 1, VENDORS)
    assert context.sampled
    assert context.header() == CLIENT
    assert context.headers() == {"traceparent": CLIENT, "tracestate": VENDORS}


def test_surrounding_blanks_are_not_part_of_the_value() -> None:
    assert TraceContext.parse(f" \t{CLIENT}\t ") == TraceContext(TRACE_ID, PARENT_ID, 1)


@pytest.mark.parametrize(
    "traceparent",
    [
        "",
        "garbage",
        f"00-{TRACE_ID}-{PARENT_ID}",  # no flags
        f"00-{TRACE_ID}-{PARENT_ID}-1",  # one flag digit
        f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01",  # a short trace id
        f"00-{TRACE_ID}0-{PARENT_ID}-01",  # a long one
        f"00-{TRACE_ID}-{PARENT_ID[:-1]}-01",
        f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",  # hex is lower case
        f"00-{TRACE_ID}-{PARENT_ID.upper()}-01",
        f"0A-{TRACE_ID}-{PARENT_ID}-01",
        f"00-{TRACE_ID}-{PARENT_ID}-0G",
        f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero ids are invalid
        f"00-{TRACE_ID}-{'0' * 16}-01",
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is forbidden
        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 ends at its flags
        f"00_{TRACE_ID}_{PARENT_ID}_01",
        f"cc-{TRACE_ID}-{PARENT_ID}-01.what-the-future-will-not-be-like",
    ],
)
def test_an_invalid_traceparent_is_ignored(traceparent: str) -> None:
    assert TraceContext.parse(traceparent, VENDORS) is None


def test_a_later_version_is_read_by_its_first_fields_and_sent_on_as_version_00() -> None:
    context = TraceContext.parse(f"cc-{TRACE_ID}-{PARENT_ID}-09-what-the-future-will-be-like")
    # of a later version's flags only the sampled bit is known
    assert context == TraceContext(TRACE_ID, PARENT_ID, 1)
    assert context.header() == f"00-{TRACE_ID}-{PARENT_ID}-01"
    assert TraceContext.parse(f"cc-{TRACE_ID}-{PARENT_ID}-00") == TraceContext(
        TRACE_ID, PARENT_ID, 0
    )


def test_request_headers_give_one_context_and_join_the_tracestate_headers() -> None:
    request = headers(("TraceParent", CLIENT), ("tracestate", "congo=1"), ("tracestate", "rojo=2"))
    assert TraceContext.from_headers(request) == TraceContext(
        TRACE_ID, PARENT_ID, 1, "congo=1,rojo=2"
    )
    assert TraceContext.from_headers({"traceparent": CLIENT}) == TraceContext(
        TRACE_ID, PARENT_ID, 1
    )
    assert TraceContext.from_headers(headers()) is None


def test_two_traceparent_headers_are_invalid() -> None:
    twice = headers(("traceparent", CLIENT), ("traceparent", f"00-{'1' * 32}-{PARENT_ID}-01"))
    assert TraceContext.from_headers(twice) is None


def test_a_started_context_is_valid_new_and_sampled_as_asked() -> None:
    started = TraceContext.start(sampled=True)
    assert TraceContext.parse(started.header()) == started
    assert started.sampled and not TraceContext.start(sampled=False).sampled
    assert TraceContext.start(sampled=True).trace_id != started.trace_id


# --- the tracing section ----------------------------------------------------------------


def test_the_section_takes_an_otlp_http_url_and_rejects_unknown_keys() -> None:
    assert TracingSection().otlp_endpoint == ""
    base = TracingSection(otlp_endpoint="http://127.0.0.1:4318/")
    assert base.otlp_endpoint == "http://127.0.0.1:4318/v1/traces"
    custom = TracingSection(otlp_endpoint="https://collector:4318/custom/traces")
    assert custom.otlp_endpoint == "https://collector:4318/custom/traces"
    for bad in (
        {"otlp_endpoint": "127.0.0.1:4318"},
        {"otlp_endpoint": "grpc://127.0.0.1:4317"},
        {"sample_ratio": 1.5},
        {"service_name": ""},
        {"endpoint": "http://127.0.0.1:4318"},
    ):
        with pytest.raises(ValidationError):
            TracingSection.model_validate(bad)


# --- tracing off ------------------------------------------------------------------------


def test_tracing_off_passes_the_clients_context_to_the_engine_unchanged() -> None:
    tracer = make_tracer(TracingSection())
    trace = tracer.begin(headers(("traceparent", CLIENT), ("tracestate", VENDORS)), method="POST")
    with trace.span("upstream", instance_id="a") as call:
        call.set(status_code=200)
        assert call.upstream_headers() == {"traceparent": CLIENT, "tracestate": VENDORS}
    assert trace.upstream_headers() == {"traceparent": CLIENT, "tracestate": VENDORS}
    assert trace.response_headers() == {TRACE_ID_HEADER: TRACE_ID}
    trace.end(200)


def test_tracing_off_starts_a_sampled_trace_for_a_request_without_one() -> None:
    trace = Tracer().begin(headers(("traceparent", f"00-{'0' * 32}-{PARENT_ID}-01")))
    sent = TraceContext.from_headers(trace.upstream_headers())
    assert sent is not None and sent.sampled and sent.trace_id == trace.trace_id
    assert sent.tracestate == ""
    assert trace.response_headers() == {TRACE_ID_HEADER: trace.trace_id}


def test_tracing_off_imports_nothing_of_opentelemetry() -> None:
    script = (
        "import sys\n"
        "from router.tracing import TracingSection, make_tracer\n"
        "trace = make_tracer(TracingSection()).begin({})\n"
        "with trace.span('tokenize', prompt_tokens=3):\n"
        "    pass\n"
        "trace.end(200)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "[]"


def test_a_missing_opentelemetry_is_an_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a module set to None in sys.modules cannot be imported: as if it were not installed
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    monkeypatch.delitem(sys.modules, "router.tracing_otel", raising=False)
    section = TracingSection(otlp_endpoint="http://127.0.0.1:4318/v1/traces")
    with pytest.raises(TracingUnavailable) as raised:
        make_tracer(section)
    assert str(raised.value) == (
        "tracing.otlp_endpoint is set but OpenTelemetry is not installed "
        "(opentelemetry.exporter.otlp.proto.http.trace_exporter): "
        "pip install 'mooncake-conductor-py[tracing]'"
    )


# --- tracing on: spans exported over OTLP/HTTP --------------------------------------------


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as started:
        yield started


def traced_request(trace: RequestTrace) -> dict[str, str]:
    """A request's stages as the router runs them; the headers sent to the engine."""
    with trace.span("tokenize") as span:
        span.set(prompt_tokens=12, tokenized_by="router")
    with trace.span("index.query", prompt_tokens=12):
        pass
    with trace.span("decision") as span:
        span.set(instance_id="a", cached_tokens=8, policy="ttft")
    with trace.span("upstream", server_address="127.0.0.1", server_port=8001, attempt=1) as call:
        sent = call.upstream_headers()
        call.set(status_code=200, instance_id="a")
    trace.set(model="m", key_id="k1", lora_name="sql-lora")
    trace.end(200)
    return sent


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {span.name: span for span in spans}


async def test_the_span_tree_reaches_the_collector_under_the_clients_trace(
    receiver: OtlpReceiver,
) -> None:
    section = TracingSection(otlp_endpoint=receiver.url, service_name="router-under-test")
    tracer = make_tracer(section)
    request = headers(("traceparent", CLIENT), ("tracestate", VENDORS))
    trace = tracer.begin(request, method="POST", route="/v1/completions")
    sent = traced_request(trace)
    assert receiver.spans == []  # batched: nothing sent before the shutdown flushes
    await tracer.shutdown()
    spans = by_name(await receiver.wait_for(5))
    assert sorted(spans) == ["decision", "index.query", "router.request", "tokenize", "upstream"]

    root = spans["router.request"]
    assert {span.trace_id for span in spans.values()} == {TRACE_ID}
    assert (root.parent_id, root.kind) == (PARENT_ID, "SERVER")
    assert root.service_name == "router-under-test"
    assert root.attributes == {
        "http.request.method": "POST",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
        "gen_ai.request.model": "m",
        "conductor.key_id": "k1",
        "conductor.lora_name": "sql-lora",
    }
    for name in ("tokenize", "index.query", "decision", "upstream"):
        assert spans[name].parent_id == root.span_id
        assert spans[name].kind == ("CLIENT" if name == "upstream" else "INTERNAL")
    assert spans["tokenize"].attributes == {
        "conductor.prompt_tokens": 12,
        "conductor.tokenized_by": "router",
    }
    assert spans["decision"].attributes == {
        "conductor.instance_id": "a",
        "conductor.cached_tokens": 8,
        "conductor.policy": "ttft",
    }
    assert spans["upstream"].attributes == {
        "server.address": "127.0.0.1",
        "server.port": 8001,
        "conductor.attempt": 1,
        "http.response.status_code": 200,
        "conductor.instance_id": "a",
    }
    # the engine is told the upstream span called it; the vendors' tracestate goes along
    assert sent == {
        "traceparent": f"00-{TRACE_ID}-{spans['upstream'].span_id}-01",
        "tracestate": VENDORS,
    }
    assert trace.response_headers() == {TRACE_ID_HEADER: TRACE_ID}


async def test_a_trace_the_router_starts_is_a_root_whose_id_the_client_gets(
    receiver: OtlpReceiver,
) -> None:
    tracer = make_tracer(TracingSection(otlp_endpoint=receiver.url))
    trace = tracer.begin(headers())
    traced_request(trace)
    await tracer.shutdown()
    root = by_name(await receiver.wait_for(5))["router.request"]
    assert root.parent_id == ""
    assert trace.response_headers() == {TRACE_ID_HEADER: root.trace_id}


async def test_failed_stages_and_error_answers_mark_their_spans(receiver: OtlpReceiver) -> None:
    tracer = make_tracer(TracingSection(otlp_endpoint=receiver.url))
    trace = tracer.begin(headers())
    with pytest.raises(ConnectionRefusedError), trace.span("upstream", attempt=1):
        raise ConnectionRefusedError
    with trace.span("upstream", attempt=2) as call:
        call.set(status_code=404)  # a client span fails from 4xx on
    trace.end(502)
    trace.end(200)  # a second end changes nothing
    await tracer.shutdown()
    spans = await receiver.wait_for(3)
    refused, not_found, root = sorted(spans, key=lambda s: s.attributes.get("conductor.attempt", 9))
    assert (refused.status, refused.attributes["error.type"]) == ("ERROR", "ConnectionRefusedError")
    assert (not_found.status, not_found.attributes["http.response.status_code"]) == ("ERROR", 404)
    assert (root.status, root.attributes["http.response.status_code"]) == ("ERROR", 502)


@pytest.mark.parametrize(
    ("traceparent", "ratio"),
    [(f"00-{TRACE_ID}-{PARENT_ID}-00", 1.0), (CLIENT, 0.0)],
    ids=["client-not-sampled", "ratio-0-client-sampled"],
)
async def test_the_clients_sampling_decision_is_followed(
    receiver: OtlpReceiver, traceparent: str, ratio: float
) -> None:
    """A client's sampled flag decides (ParentBased); the ratio only for the router's own."""
    tracer = make_tracer(TracingSection(otlp_endpoint=receiver.url, sample_ratio=ratio))
    trace = tracer.begin(headers(("traceparent", traceparent)))
    sent = traced_request(trace)
    unsampled = tracer.begin(headers())
    traced_request(unsampled)
    await tracer.shutdown()
    recorded = {span.trace_id for span in receiver.spans}
    assert (TRACE_ID in recorded) == (traceparent == CLIENT)
    assert (unsampled.trace_id in recorded) == (ratio == 1.0)
    if traceparent != CLIENT:  # not recorded: the engine gets the client's context as is
        assert sent == {"traceparent": traceparent}


@pytest.mark.parametrize(("refusing", "counts"), [(False, (5, 0)), (True, (0, 5))])
async def test_exported_and_failed_spans_are_counted(
    refusing: bool, counts: tuple[int, int]
) -> None:
    registry = CollectorRegistry()
    async with OtlpReceiver(refusing=refusing) as collector:
        tracer = make_tracer(TracingSection(otlp_endpoint=collector.url))
        tracer.register_metrics(registry)
        traced_request(tracer.begin(headers()))
        await tracer.shutdown()
        assert collector.requests == 1

    def count(result: str) -> float | None:
        return registry.get_sample_value("router_trace_spans_total", {"result": result})

    assert (count("exported"), count("failed")) == counts


async def test_shutdown_is_bounded_when_the_collector_hangs() -> None:
    async with OtlpReceiver(stalled=True) as stalled:
        tracer = make_tracer(TracingSection(otlp_endpoint=stalled.url))
        traced_request(tracer.begin(headers()))
        started = time.monotonic()
        await tracer.shutdown(timeout=0.5)
        assert time.monotonic() - started < 2.0
        assert stalled.requests == 1 and stalled.spans == []
