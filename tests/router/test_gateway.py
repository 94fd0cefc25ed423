"""The router as a fleet's gateway: several models and LoRA adapters, client keys and
tenants, limits and traces, in front of real engine simulators, a real conductor and real
HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from tests.router.inprocess import layout
from tests.router.sim_fleet import Fleet
from tests.support.api import eventually, metric
from tests.support.otlp import OtlpReceiver

PROMPT = "Summarize the quarterly report in three short bullet points for the board. " * 3
ADAPTER_ARGS = ("--enable-lora", "--lora-modules", "alpha-sql=/adapters/alpha-sql")


async def ask(
    http: aiohttp.ClientSession,
    url: str,
    model: str | None,
    prompt: str = PROMPT,
    key: str | None = None,
    **body: Any,
) -> tuple[int, CIMultiDict[str], Any]:
    """One completion through the router: status, headers, answer."""
    request = {"prompt": prompt, "max_tokens": 2, **body}
    if model is not None:
        request["model"] = model
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(f"{url}/v1/completions", json=request, headers=headers) as response:
        answer = await response.json(content_type=None)
        return response.status, response.headers.copy(), answer


def engine_cached(answer: Any) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def cached_on_repeat(
    http: aiohttp.ClientSession, url: str, model: str, key: str | None = None
) -> tuple[str, int, int]:
    """The instance, predicted and engine-reported cached tokens of a repeated prompt, once
    the index has the first one's blocks (asked until it predicts a hit, bounded)."""

    async def repeat() -> tuple[str, int, int]:
        status, headers, answer = await ask(http, url, model, key=key)
        assert status == 200, answer
        cached = int(headers["x-conductor-cached-tokens"])
        return headers["x-conductor-prefill-instance"], cached, engine_cached(answer)

    return await eventually(repeat, lambda seen: seen[1] > 0, timeout=10.0)


@pytest.fixture
def two_models(fleet: Fleet) -> dict[str, Any]:
    """Model ``alpha`` (the default, with adapter ``alpha-sql``) on engines a0 and a1, model
    ``beta`` on b0: the router's config."""
    for name in ("a0", "a1"):
        fleet.engine(name, "--served-model-name", "alpha", *ADAPTER_ARGS)
    fleet.engine("b0", "--served-model-name", "beta")
    return fleet.models_config(
        {
            "alpha": {"engines": ["a0", "a1"], "adapters": ["alpha-sql"], "default": True},
            "beta": {"engines": ["b0"], "routing": {"policy": "round_robin"}},
        }
    )


async def test_each_request_goes_to_its_models_engines(fleet, two_models, serve, http):
    router = await serve(two_models)
    await eventually(lambda: models_listed(http, router.url), lambda ids: len(ids) == 3)
    assert sorted(await models_listed(http, router.url)) == ["alpha", "alpha-sql", "beta"]
    for model, engines in ((None, {"a0", "a1"}), ("alpha", {"a0", "a1"}), ("beta", {"b0"})):
        for n in range(3):
            status, headers, answer = await ask(http, router.url, model, f"question {n}")
            assert status == 200, answer
            assert headers["x-conductor-prefill-instance"] in engines
    status, _, answer = await ask(http, router.url, "gamma")
    message = "The model `gamma` does not exist. Valid aliases: alpha, beta."
    assert (status, answer["error"]["message"]) == (404, message)
    health = await (await http.get(f"{router.url}/health")).json()
    assert sorted(health["models"]["alpha"]["prefill_instances"]) == ["a0", "a1"]
    assert health["models"]["beta"]["policy"] == "round_robin"


@pytest.mark.parametrize("embedded", [False, True], ids=["conductor", "embedded"])
async def test_an_adapters_prefix_counts_for_the_adapter_only(
    fleet, two_models, serve, http, embedded
):
    """The adapter's prompt is looked up in the adapter's context (by a conductor, or the
    index in the router): repeated, it goes where the adapter's blocks are (and the engine
    reports them cached); the same prompt on the base model finds nothing of them, as
    vLLM's cache finds nothing."""
    two_models["conductor"]["embedded"] = embedded
    router = await serve(two_models)
    status, headers, answer = await ask(http, router.url, "alpha-sql")
    assert status == 200, answer
    first = headers["x-conductor-prefill-instance"]
    instance, predicted, reported = await cached_on_repeat(http, router.url, "alpha-sql")
    assert instance == first and predicted > 0 and reported >= predicted
    status, headers, answer = await ask(http, router.url, "alpha")
    assert status == 200, answer
    assert (headers["x-conductor-cached-tokens"], engine_cached(answer)) == ("0", 0)


async def test_a_models_own_in_flight_setting_holds(fleet, two_models, serve, http):
    """``routing.in_flight_prefixes: false`` on beta alone: beta's prompts are not held as
    in flight nor reported to the conductor for other replicas; alpha's are."""
    two_models["models"][1]["routing"]["in_flight_prefixes"] = False
    router = await serve(two_models)
    reports = "router_routed_reports_total"
    status, _, answer = await ask(http, router.url, "beta")
    assert status == 200, answer
    await asyncio.sleep(0.3)  # a report would have been sent by now
    assert await metric(http, router.url, reports) == 0
    status, _, answer = await ask(http, router.url, "alpha")
    assert status == 200, answer
    await eventually(lambda: metric(http, router.url, reports), lambda sent: sent == 1)


async def models_listed(http: aiohttp.ClientSession, url: str, key: str | None = None) -> list[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.get(f"{url}/v1/models", headers=headers) as response:
        assert response.status == 200, await response.text()
        return [card["id"] for card in (await response.json())["data"]]


# -- keys, tenants and limits ----------------------------------------------------------------
KEYS = {
    "tenants": {"acme": {"isolated": True, "cache_salt": "acme's own secret"}},
    "keys": [
        {"id": "acme-1", "key": "sk-acme-1", "tenant": "acme"},
        {"id": "acme-2", "key": "sk-acme-2", "tenant": "acme"},
        {"id": "public", "key": "sk-public"},
        {"id": "beta-only", "key": "sk-beta", "models": ["beta"]},
        {"id": "one-at-a-time", "key": "sk-one", "max_concurrent": 1},
    ],
}


def write_keys(path: Path, keys: dict[str, Any]) -> Path:
    path.write_text(json.dumps(keys))
    return path


@pytest.fixture
async def gateway(fleet, two_models, serve, tmp_path):
    keys = write_keys(tmp_path / "keys.json", KEYS)
    two_models["keys"] = {"file": str(keys), "reload_interval_seconds": 0.2}
    return await serve(two_models), keys


async def test_keys_are_checked_and_never_shown(gateway, http):
    router, _ = gateway
    status, headers, answer = await ask(http, router.url, "alpha")
    assert (status, answer["error"]["type"]) == (401, "AuthenticationError")
    assert headers["WWW-Authenticate"] == "Bearer"
    assert (await ask(http, router.url, "alpha", key="sk-wrong"))[0] == 401
    assert (await ask(http, router.url, "alpha", key="sk-public"))[0] == 200
    assert await models_listed(http, router.url, key="sk-beta") == ["beta"]
    status, _, answer = await ask(http, router.url, "alpha", key="sk-beta")
    message = "The model `alpha` does not exist. Valid aliases: beta."
    assert (status, answer["error"]["message"]) == (404, message)
    text = await (await http.get(f"{router.url}/metrics")).text()
    assert 'key="public"' in text and "sk-" not in text


async def test_an_isolated_tenants_cache_is_its_own(gateway, http):
    """acme's prompts are salted with acme's secret: its second key finds the first one's
    prefix, the engine reports it cached; a key of the shared tenant finds nothing."""
    router, _ = gateway
    assert (await ask(http, router.url, "beta", key="sk-acme-1"))[0] == 200
    instance, predicted, reported = await cached_on_repeat(http, router.url, "beta", "sk-acme-2")
    assert (instance, predicted > 0, reported >= predicted) == ("b0", True, True)
    status, headers, answer = await ask(http, router.url, "beta", key="sk-public")
    assert status == 200, answer
    assert (headers["x-conductor-cached-tokens"], engine_cached(answer)) == ("0", 0)


async def test_a_key_over_its_limit_is_told_when_to_come_back(gateway, http):
    router, _ = gateway
    long = ask(http, router.url, "beta", key="sk-one", max_tokens=400, ignore_eos=True)
    first = asyncio.ensure_future(long)
    await eventually(
        lambda: metric(http, router.url, 'router_admission_requests_total{key="one-at-a-time"}'),
        lambda admitted: admitted == 1,
    )
    status, headers, answer = await ask(http, router.url, "beta", key="sk-one")
    assert (status, answer["error"]["type"]) == (429, "RateLimitError")
    assert int(headers["Retry-After"]) >= 1
    assert (await ask(http, router.url, "beta", key="sk-public"))[0] == 200  # others go on
    assert (await first)[0] == 200


async def test_a_changed_keys_file_is_used_without_a_restart(gateway, http):
    router, keys = gateway
    assert (await ask(http, router.url, "beta", key="sk-new"))[0] == 401
    changed = {**KEYS, "keys": [*KEYS["keys"], {"id": "new", "key": "sk-new"}]}
    write_keys(keys, changed)
    await eventually(
        lambda: ask(http, router.url, "beta", key="sk-new"), lambda seen: seen[0] == 200
    )


# -- traces ----------------------------------------------------------------------------------
@pytest.fixture
async def recording_engine() -> AsyncIterator[tuple[str, list[CIMultiDict[str]]]]:
    """A real HTTP upstream that answers every completion and records the headers it got."""
    seen: list[CIMultiDict[str]] = []

    async def complete(request: web.Request) -> web.Response:
        seen.append(request.headers.copy())
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 3}})

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"count": 3, "max_model_len": 64, "tokens": [1, 2, 3]})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", complete), web.post("/tokenize", tokenize)])
    async with TestServer(app, host="127.0.0.1") as server:
        yield f"http://127.0.0.1:{server.port}", seen


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def test_a_request_is_traced_from_the_client_to_the_engine(recording_engine, serve, http):
    url, seen = recording_engine
    async with OtlpReceiver() as collector:
        config = layout([url], tracing={"otlp_endpoint": collector.url, "service_name": "gw"})
        router = await serve(config)
        headers = {"traceparent": CLIENT_TRACEPARENT}
        body = {"model": "m", "prompt": "hello"}
        async with http.post(f"{router.url}/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200 and r.headers["x-conductor-trace-id"] == TRACE_ID
        await router.router.tracer.shutdown()
        spans = {span.name: span for span in await collector.wait_for(5, timeout=10.0)}
    assert set(spans) == {"router.request", "tokenize", "index.query", "decision", "upstream"}
    assert {span.trace_id for span in spans.values()} == {TRACE_ID}
    upstream = spans["upstream"]
    assert seen[0]["traceparent"] == f"00-{TRACE_ID}-{upstream.span_id}-01"
    assert upstream.attributes["conductor.instance_id"] == "e0"
    assert upstream.attributes["server.address"] == "127.0.0.1"
    assert upstream.attributes["server.port"] == int(url.rsplit(":", 1)[1])
    assert spans["decision"].attributes["conductor.policy"] == "least_loaded"  # no index
    assert spans["index.query"].attributes["conductor.fallback"] == "conductor_unavailable"
    assert spans["tokenize"].attributes["conductor.tokenized_by"] == "engine"
    assert spans["router.request"].attributes["gen_ai.request.model"] == "m"


async def test_without_tracing_the_clients_context_reaches_the_engine(
    recording_engine, serve, http
):
    url, seen = recording_engine
    router = await serve(layout([url]))
    headers = {"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=1"}
    body = {"model": "m", "prompt": "hello"}
    async with http.post(f"{router.url}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200 and r.headers["x-conductor-trace-id"] == TRACE_ID
    assert (seen[0]["traceparent"], seen[0]["tracestate"]) == (CLIENT_TRACEPARENT, "vendor=1")
