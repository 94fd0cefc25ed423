"""The router in front of real engine simulators and a real conductor: as a process, and in
this process (``inprocess``) where a test looks only at answers, statuses and metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from conductor.hashing import token_bytes
from publishers.local import LocalService
from router.index_client import PromptBlocks
from router.pending import GRACE_S
from router.prompt_ids import TOKENIZER_HINT
from tests.router.inprocess import MODEL, ServedRouter, layout
from tests.router.sim_fleet import AnyRouter, Fleet, complete
from tests.support import api
from tests.support.api import eventually, get, matched
from tests.support.processes import ConductorProcess, free_port

SHARED = "Answer as a careful assistant who explains every step in plain words. " * 3


async def indexed_everywhere(http: aiohttp.ClientSession, fleet: Fleet, names: list[str]) -> None:
    """Until the conductor lists every engine (its streams registered and connected)."""

    async def services() -> list[dict[str, Any]]:
        async with http.get(f"{fleet.conductor.url}/services") as response:
            return (await response.json())["services"]

    await eventually(
        services,
        lambda found: (
            sorted(s["InstanceID"] for s in found if s["State"] == "connected") == sorted(names)
        ),
    )
    await asyncio.sleep(0.2)


async def metric(
    http: aiohttp.ClientSession, service: LocalService | ServedRouter, name: str
) -> float:
    return await api.metric(http, service.url, name)


async def cache_metrics(http: aiohttp.ClientSession, router: AnyRouter, instance: str):
    """(predicted, realized, unverified, answers compared) of one instance."""
    label = f'{{instance="{instance}"}}'
    names = (
        "router_cache_predicted_tokens_total",
        "router_cache_realized_tokens_total",
        "router_cache_unverified_answers_total",
        "router_cache_prediction_error_tokens_count",
    )
    return tuple([await metric(http, router, name + label) for name in names])


async def error_buckets(http: aiohttp.ClientSession, router: AnyRouter, instance: str):
    """Cumulative counts of the prediction-error histogram, by upper bound."""
    async with http.get(f"{router.url}/metrics") as response:
        text = await response.text()
    pattern = re.compile(
        rf'^router_cache_prediction_error_tokens_bucket{{instance="{instance}",le="([^"]+)"}} '
        r"(\S+)$",
        re.MULTILINE,
    )
    return {float(le): float(count) for le, count in pattern.findall(text)}


async def router_models(http: aiohttp.ClientSession, router: AnyRouter) -> list[str]:
    async with http.get(f"{router.url}/v1/models") as response:
        return [model["id"] for model in (await response.json())["data"]]


class Relay:
    """Passes an engine's KV events on to the conductor, and can hold them back: the
    engine's cache then changes behind the conductor's back, deterministically."""

    def __init__(self, context: zmq.asyncio.Context, source: str) -> None:
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(source)
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self._pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.open = asyncio.Event()
        self.open.set()
        self._task = asyncio.create_task(self._forward())

    async def _forward(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            await self.open.wait()
            await self._pub.send_multipart(frames)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._sub.close(0)
        self._pub.close(0)


async def test_routing_follows_the_cache(fleet, http):
    for name in ("a", "b", "c"):
        fleet.engine(name)
    router = fleet.start_router(fleet.config(["a", "b", "c"]))
    await indexed_everywhere(http, fleet, ["a", "b", "c"])
    status, headers, first = await complete(http, router, SHARED + "First question?")
    assert status == 200, first
    owner = headers["x-conductor-prefill-instance"]
    assert headers["x-conductor-policy"] == "ttft"
    assert headers["x-conductor-cached-tokens"] == "0"
    assert 0 < float(headers["x-conductor-overhead-ms"]) < 1000

    async def second() -> dict[str, str]:
        return (await complete(http, router, SHARED + "Second question?"))[1]

    headers = await eventually(second, lambda h: int(h["x-conductor-cached-tokens"]) > 0)
    assert headers["x-conductor-prefill-instance"] == owner
    assert int(headers["x-conductor-cached-tokens"]) >= len(SHARED) // 8


async def test_an_embedded_index_routes_by_the_cache_without_a_conductor(fleet, http):
    """``conductor.embedded``: the router subscribes to the engines' KV events itself and
    asks its own index; no conductor service runs (the fleet's is stopped)."""
    fleet.conductor.stop()
    for name in ("a", "b", "c"):
        fleet.engine(name)
    config = fleet.config(["a", "b", "c"], in_flight_prefixes=False)  # the index alone
    config["conductor"] |= {"embedded": True}
    router = fleet.start_router(config)

    async def connected() -> int:  # the router's own subscribers, per their state series
        async with http.get(f"{router.url}/metrics") as response:
            return (await response.text()).count('conductor_subscriber_state{state="connected"')

    await eventually(connected, lambda streams: streams == 3)
    async with http.get(f"{router.url}/health") as response:
        assert (await response.json())["conductors"] == {"embedded": "up"}
    status, headers, _ = await complete(http, router, SHARED + "First question?")
    assert status == 200 and "x-conductor-fallback" not in headers
    owner = headers["x-conductor-prefill-instance"]

    async def second() -> dict[str, str]:
        return (await complete(http, router, SHARED + "Second question?"))[1]

    headers = await eventually(second, lambda h: int(h["x-conductor-cached-tokens"]) > 0)
    assert headers["x-conductor-prefill-instance"] == owner
    assert "x-conductor-fallback" not in headers
    assert await metric(http, router, "conductor_blocks_stored_total") > 0


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "service"])
async def test_a_finished_prompt_counts_as_in_flight_until_the_index_has_it(
    fleet, serve, http, embedded
):
    """A finished request's prompt counts as in flight until the index has applied an
    event batch its engine published after it ended, however late: the embedded index
    says so, a conductor service in the answer of each query (for the instances with
    prompts in flight); a fixed grace is for a conductor that cannot say (the Go service).
    An idle engine publishes nothing more, so the prompt stays past that grace; the next
    request's events release it."""
    fleet.engine("a")
    config = fleet.config(["a"])
    if embedded:
        config["conductor"] |= {"embedded": True}
    served = await serve(config)
    router, pending = served.router, served.router.pending
    assert pending is not None

    async def in_flight(prompt: str) -> dict[str, int]:
        request = {"model": MODEL, "prompt": prompt}
        async with http.post(f"{fleet.engines['a'].url}/tokenize", json=request) as response:
            ids = (await response.json())["tokens"]
        context = router.catalog.default.context("")
        return pending.match(PromptBlocks(token_bytes(ids), context, "").hashes)

    async def after_another_request() -> dict[str, int]:
        assert (await complete(http, served, "Another, unrelated " * 20))[0] == 200
        return await in_flight(first)

    first = "First " * 40
    for _ in range(2):  # a service says an instance's progress when a query names it
        assert (await complete(http, served, first))[0] == 200
    await asyncio.sleep(GRACE_S + 0.5)
    assert (await in_flight(first)).get("a", 0) > 0  # kept past the Go conductor's grace
    await eventually(after_another_request, lambda match: match == {})
    until = router.index.indexed_until("a")
    assert until is not None and until <= time.time()


async def test_a_burst_spreads_over_instances(fleet, http):
    for name in ("a", "b"):
        fleet.engine(name, time_scale=1.0)
    router = fleet.start_router(fleet.config(["a", "b"]))
    await indexed_everywhere(http, fleet, ["a", "b"])
    prompts = [f"{SHARED} Question {i}: " + "detail " * 60 for i in range(8)]
    answers = await asyncio.gather(*(complete(http, router, p, max_tokens=8) for p in prompts))
    chosen = {headers["x-conductor-prefill-instance"] for _, headers, _ in answers}
    assert all(status == 200 for status, _, _ in answers)
    assert chosen == {"a", "b"}


async def test_streaming_passes_through_intact(fleet, http):
    fleet.engine("a")
    router = fleet.start_router(fleet.config(["a"]))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}]}
    body["max_tokens"] = 12
    async with http.post(f"{router.url}/v1/chat/completions", json=body) as response:
        whole = await response.json()
    async with http.post(
        f"{router.url}/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-conductor-prefill-instance"] == "a"
        raw = await response.text()
    events = [line.removeprefix("data: ") for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]


async def test_disaggregated_flow_hands_kv_transfer_params_to_decode(fleet, http):
    fleet.engine("prefill")
    fleet.engine("decode")
    router = fleet.start_router(fleet.config(["prefill"], decode=["decode"]))
    status, headers, answer = await complete(http, router, SHARED, max_tokens=6)
    assert status == 200, answer
    assert headers["x-conductor-prefill-instance"] == "prefill"
    assert headers["x-conductor-decode-instance"] == "decode"
    assert answer["usage"]["completion_tokens"] == 6

    async def held() -> float:
        async with http.get(f"{fleet.engines['prefill'].url}/metrics") as response:
            text = await response.text()
        return float(re.search(r"^sim_kv_transfer_held_requests\S* (\S+)$", text, re.M).group(1))

    await eventually(held, lambda n: n == 0)  # the decode side pulled the KV and released it
    # the prediction was for the prefill instance: compared there, never on the decode side
    assert (await cache_metrics(http, router, "prefill"))[2:] == (0, 1)
    assert await cache_metrics(http, router, "decode") == (0, 0, 0, 0)


async def test_conductor_down_falls_back_then_recovers(fleet, http):
    for name in ("a", "b"):
        fleet.engine(name)
    router = fleet.start_router(fleet.config(["a", "b"]))
    await indexed_everywhere(http, fleet, ["a", "b"])
    await complete(http, router, SHARED + "warm up")
    compared = [await cache_metrics(http, router, name) for name in ("a", "b")]
    fleet.conductor.kill()
    status, headers, _ = await complete(http, router, SHARED + "while the conductor is down")
    assert status == 200
    assert headers["x-conductor-policy"] == "least_loaded"
    assert headers["x-conductor-fallback"] == "conductor_unavailable"
    assert await metric(http, router, "router_fallbacks_total") >= 1
    # no prediction was made: the engine's count is not compared with one
    assert [await cache_metrics(http, router, name) for name in ("a", "b")] == compared

    fleet.conductor = ConductorProcess(fleet.tmp_path, port=fleet.conductor.port)
    fleet.conductor.wait_ready()
    await indexed_everywhere(http, fleet, ["a", "b"])  # the router re-registered them

    async def routed() -> dict[str, str]:
        return (await complete(http, router, SHARED + "after recovery"))[1]

    headers = await eventually(routed, lambda h: int(h["x-conductor-cached-tokens"]) > 0)
    assert headers["x-conductor-policy"] == "ttft" and "x-conductor-fallback" not in headers


async def test_dead_engine_is_retried_elsewhere_and_probed_back(fleet, http):
    for name in ("a", "b"):
        fleet.engine(name)
    router = fleet.start_router(fleet.config(["a", "b"], policy="round_robin"))
    fleet.engines["a"].kill()
    answers = [await complete(http, router, f"question {i}") for i in range(4)]
    assert all(status == 200 for status, _, _ in answers)
    assert {h["x-conductor-prefill-instance"] for _, h, _ in answers} == {"b"}
    assert await metric(http, router, 'router_upstream_healthy{instance="a"}') == 0

    fleet.engine("a").wait_ready()  # back on the same port

    async def chosen() -> set[str]:
        answers = [await complete(http, router, f"again {i}") for i in range(2)]
        return {h["x-conductor-prefill-instance"] for _, h, _ in answers}

    await eventually(chosen, lambda names: names == {"a", "b"})


@pytest.fixture
async def broken_engine() -> AsyncIterator[tuple[str, list[CIMultiDict[str]]]]:
    """A real HTTP upstream that tokenizes and looks healthy but fails every completion with
    a 500, as an engine with a crashed worker does; it records the headers it was sent."""
    seen: list[CIMultiDict[str]] = []

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]})

    async def fail(request: web.Request) -> web.Response:
        seen.append(request.headers.copy())  # case-insensitive, like HTTP
        return web.json_response({"error": {"message": "worker died"}}, status=500)

    app = web.Application()
    app.add_routes([web.post("/tokenize", tokenize), web.post("/v1/completions", fail)])
    async with TestServer(app, host="127.0.0.1") as server:
        yield f"http://127.0.0.1:{server.port}", seen


@pytest.fixture
async def cutting_engine() -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A real HTTP upstream whose completions die: before any byte ("mode": "early") or
    after part of the answer ("late"), as an engine process killed mid-request."""
    mode = {"mode": "early"}

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    async def die(request: web.Request) -> web.StreamResponse:
        await request.read()
        assert request.transport is not None
        if mode["mode"] == "late":
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b'{"choices": [{"text": "par')
            await asyncio.sleep(0.2)  # the router has passed it on: the client has a part
        request.transport.close()
        return web.Response()

    app = web.Application()
    app.add_routes(
        [
            web.post("/tokenize", tokenize),
            web.get("/health", health),
            web.post("/v1/completions", die),
        ]
    )
    async with TestServer(app, host="127.0.0.1") as server:
        yield f"http://127.0.0.1:{server.port}", mode


async def test_an_answer_cut_before_any_byte_is_retried_after_it_is_not(
    fleet, http, cutting_engine
):
    url, mode = cutting_engine
    fleet.engine("a")
    config = fleet.config(["a"], policy="round_robin")
    config["prefill"]["instances"].insert(0, {"instance_id": "cut", "http_endpoint": url})
    router = fleet.start_router(config)
    status, headers, _ = await complete(http, router, "first")  # round robin: "cut" first
    assert (status, headers["x-conductor-prefill-instance"]) == (200, "a")
    assert await metric(http, router, "router_retries_total") == 1

    mode["mode"] = "late"
    await eventually(  # the prober brings "cut" back (its /health answers)
        lambda: metric(http, router, 'router_upstream_healthy{instance="cut"}'),
        lambda healthy: healthy == 1,
    )
    outcomes = set()
    for i in range(2):  # one of two round-robin turns lands on "cut"
        try:
            status, headers, _ = await complete(http, router, f"again {i}")
            outcomes.add((status, headers["x-conductor-prefill-instance"]))
        except aiohttp.ClientPayloadError:
            outcomes.add("truncated")
    assert outcomes == {(200, "a"), "truncated"}  # never a clean 200 for a cut answer


async def test_dead_decode_instance_is_a_502_not_a_dead_prefill(fleet, http):
    fleet.engine("prefill")
    fleet.engine("decode")
    router = fleet.start_router(fleet.config(["prefill"], decode=["decode"]))
    fleet.engines["decode"].kill()
    status, _, answer = await complete(http, router, SHARED, max_tokens=4)
    assert status == 502 and "decode instance decode failed" in answer["error"]["message"]
    async with http.get(f"{router.url}/health") as response:
        health = await response.json()
    assert (health["prefill_instances"], health["decode_instances"]) == (["prefill"], [])
    status, _, answer = await complete(http, router, SHARED, max_tokens=4)
    assert status == 503 and "no healthy decode" in answer["error"]["message"]


async def test_upstream_error_is_retried_on_the_next_instance(fleet, http, broken_engine):
    broken_url, seen = broken_engine
    fleet.engine("a")
    config = fleet.config(["a"], policy="round_robin")
    config["prefill"]["instances"].insert(0, {"instance_id": "broken", "http_endpoint": broken_url})
    router = fleet.start_router(config)
    headers = {"Authorization": "Bearer secret", "X-Request-Id": "req-42"}
    answers = []
    for i in range(2):
        body = {"model": MODEL, "prompt": f"question {i}", "max_tokens": 4}
        async with http.post(f"{router.url}/v1/completions", json=body, headers=headers) as r:
            answers.append((r.status, r.headers["x-conductor-prefill-instance"]))
    assert answers == [(200, "a"), (200, "a")]
    assert await metric(http, router, "router_retries_total") == 1
    assert await metric(http, router, 'router_upstream_healthy{instance="broken"}') == 0
    assert len(seen) == 1  # forwarded once, then out of rotation
    assert (seen[0]["Authorization"], seen[0]["X-Request-Id"]) == ("Bearer secret", "req-42")


async def test_slow_conductor_falls_back_within_the_query_timeout(fleet, http):
    fleet.engine("a")
    router = fleet.start_router(fleet.config(["a"]))
    await indexed_everywhere(http, fleet, ["a"])
    fleet.conductor.process.send_signal(signal.SIGSTOP)  # alive, listening, never answering
    try:
        started = time.monotonic()
        status, headers, _ = await complete(http, router, SHARED + "while it hangs")
        elapsed = time.monotonic() - started
    finally:
        fleet.conductor.process.send_signal(signal.SIGCONT)
    assert status == 200 and headers["x-conductor-fallback"] == "conductor_unavailable"
    assert elapsed < 2.0  # query timeout 0.5 s, then straight to least_loaded
    status, headers, _ = await complete(http, router, SHARED + "after it resumed")
    assert status == 200 and "x-conductor-fallback" not in headers


async def test_client_disconnect_cancels_the_upstream_request(fleet, http):
    engine = fleet.engine("a", time_scale=1.0)
    router = fleet.start_router(fleet.config(["a"]))
    body = {"model": MODEL, "prompt": "go on and on", "max_tokens": 2000, "stream": True}
    async with http.post(f"{router.url}/v1/completions", json=body) as response:
        await response.content.readline()  # the first token arrived: it is running

    async def running() -> float:
        async with http.get(f"{engine.url}/metrics") as response:
            text = await response.text()
        return float(re.search(r"^vllm:num_requests_running\S* (\S+)$", text, re.M).group(1))

    # each hop notices the closed connection at its next token: quickly, but a loaded CI
    # machine once took over 5 s to show it in the engine's metrics
    await eventually(running, lambda n: n == 0, timeout=15.0)


BAD_REQUESTS = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"null", 400, "JSON object"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist"),
    (json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "cannot be empty"),
    (json.dumps({"model": MODEL, "prompt": [2**40, 1, 2]}).encode(), 400, "out of vocabulary"),
    (json.dumps({"model": MODEL, "prompt": "x", "cache_salt": 5}).encode(), 400, "cache_salt"),
    # a lone surrogate: JSON allows its escape, UTF-8 (which the salt is hashed as) does not
    (b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "cache_salt": "\\ud800"}', 400, "salt"),
]


async def test_bad_requests_get_openai_errors(engine_sims, serve, http):
    router = await serve(layout([engine_sims("a").url]))
    # the 404 for a model no engine serves comes once the router knows what they serve
    await eventually(
        lambda: get(http, f"{router.url}/v1/models"),
        lambda answer: answer[1]["data"][0]["owned_by"] != "conductor-router",
    )
    headers = {"Content-Type": "application/json"}
    for body, status, message in BAD_REQUESTS:
        async with http.post(
            f"{router.url}/v1/completions", data=body, headers=headers
        ) as response:
            assert response.status == status, body
            error = (await response.json())["error"]
        assert message in error["message"] and error["code"] == status, body


async def test_oversized_slo_and_no_upstream_statuses(fleet, serve, http):
    fleet.engine("a")
    config = fleet.config(["a"], ttft_slo_ms=0.001)
    router = await serve({**config, "limits": {"max_body_bytes": 2000}})
    status, _, answer = await complete(http, router, "x" * 5000)
    assert status == 413 and answer["error"]["type"] == "RequestTooLargeError"
    status, _, answer = await complete(http, router, "short")
    assert status == 429 and "SLO" in answer["error"]["message"]
    fleet.engines["a"].kill()
    status, _, answer = await complete(http, router, "short")
    assert status in (502, 503), answer
    status, _, answer = await complete(http, router, "short")
    assert status == 503 and "no healthy" in answer["error"]["message"]
    assert await metric(http, router, "router_rejections_total") >= 2


async def test_models_health_and_metrics(fleet, serve, http):
    fleet.engine("a")
    router = await serve(fleet.config(["a"]))
    async with http.get(f"{router.url}/v1/models") as response:
        assert [m["id"] for m in (await response.json())["data"]] == [MODEL]

    async def health() -> dict[str, Any]:  # ok once the conductor accepted the registrations
        async with http.get(f"{router.url}/health") as response:
            return await response.json()

    health = await eventually(health, lambda body: body["status"] == "ok")
    tasks, conductors = health.pop("tasks"), health.pop("conductors")
    assert health.pop("event_loop_lag_worst_seconds") >= 0
    assert health == {
        "status": "ok",
        "reasons": [],
        "prefill_instances": ["a"],
        "decode_instances": [],
        "policy": "ttft",
        "models": {
            MODEL: {
                "prefill_instances": ["a"],
                "adapters": [],
                "policy": "ttft",
                "default": True,
                "tokenizer": {
                    "directory": None,
                    "local": [],
                    "note": "every prompt is tokenized by an engine; " + TOKENIZER_HINT,
                },
            }
        },
    }
    assert conductors == {fleet.conductor.url: "up"}
    assert {task["state"] for task in tasks.values()} == {"running"}
    await complete(http, router, "count me")
    assert await metric(http, router, "router_decisions_total") == 1
    assert await metric(http, router, "router_overhead_seconds_count") == 1


async def test_cache_prediction_is_compared_with_what_the_engine_reports(fleet, http, zmq_context):
    for name in ("a", "b"):
        fleet.engine(name)
    config = fleet.config(["a", "b"])
    relays = {}
    for instance in config["prefill"]["instances"]:
        stream = instance["registrations"][0]
        relays[instance["instance_id"]] = relay = Relay(zmq_context, stream["endpoint"])
        stream["endpoint"] = relay.endpoint  # replays still come from the engine itself
    router = fleet.start_router(config)
    try:
        await indexed_everywhere(http, fleet, ["a", "b"])
        prompt = list(range(100, 142))  # 42 tokens: 10 full blocks, the engine may reuse all
        status, headers, _ = await complete(http, router, prompt)
        owner = headers["x-conductor-prefill-instance"]
        assert status == 200 and headers["x-conductor-cached-tokens"] == "0"
        conductor = fleet.conductor.url
        await eventually(lambda: matched(http, conductor, prompt, owner), lambda n: n == 40)

        _, headers, answer = await complete(http, router, prompt)
        assert headers["x-conductor-prefill-instance"] == owner
        assert headers["x-conductor-cached-tokens"] == "40"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        assert await cache_metrics(http, router, owner) == (40, 40, 0, 2)
        buckets = await error_buckets(http, router, owner)
        assert (buckets[-1], buckets[0]) == (0, 2)  # both exactly as predicted

        relays[owner].open.clear()  # the engine's AllBlocksCleared stays in the relay
        async with http.post(f"{fleet.engines[owner].url}/reset_prefix_cache") as response:
            assert response.status == 200
        _, headers, answer = await complete(http, router, prompt)
        assert headers["x-conductor-cached-tokens"] == "40"  # the index has not heard yet
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert await cache_metrics(http, router, owner) == (80, 40, 0, 3)
        buckets = await error_buckets(http, router, owner)
        assert (buckets[-64], buckets[-16], buckets[-1]) == (0, 1, 1)  # realized − predicted = −40

        relays[owner].open.set()
        clears = await eventually(
            lambda: metric(http, fleet.conductor, "conductor_clears_total"), lambda n: n
        )
        assert clears == 1
    finally:
        await asyncio.gather(*(relay.close() for relay in relays.values()))


async def test_streamed_usage_is_compared_and_streams_without_it_are_unverified(fleet, http):
    fleet.engine("a")
    router = fleet.start_router(fleet.config(["a"]))
    body = {"model": MODEL, "prompt": SHARED, "max_tokens": 6, "stream": True}
    async with http.post(f"{router.url}/v1/completions", json=body) as response:
        assert response.status == 200 and "usage" not in await response.text()
    assert await cache_metrics(http, router, "a") == (0, 0, 1, 0)

    body["stream_options"] = {"include_usage": True}
    async with http.post(f"{router.url}/v1/completions", json=body) as response:
        predicted = int(response.headers["x-conductor-cached-tokens"])
        events = (await response.text()).split("\n\n")
    usage = json.loads(events[-3].removeprefix("data: "))["usage"]  # before [DONE]
    realized = usage["prompt_tokens_details"]["cached_tokens"]
    assert realized > 0  # the first stream left the prompt cached
    assert await cache_metrics(http, router, "a") == (predicted, realized, 1, 1)


async def test_a_model_no_upstream_serves_is_answered_by_the_router(
    engine_sims, serve, http, caplog
):
    engine = engine_sims("a", "--served-model-name", "other", "alias")
    with caplog.at_level(logging.WARNING, logger="router"):
        router = await serve(layout([engine.url]))
        models = await eventually(lambda: router_models(http, router), lambda ids: ids != [MODEL])
    assert models == ["other", "alias"]
    warnings = [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "configured modelname" in record.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert "instance=e0" in warnings[0] and "['other', 'alias']" in warnings[0]
    assert f"modelname '{MODEL}'" in warnings[0]
    for model in (MODEL, "nope"):
        status, headers, answer = await complete(http, router, "hello", model=model)
        assert (status, answer) == (
            404,
            {
                "error": {
                    "message": f"The model `{model}` does not exist. Valid aliases: .",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            },
        )
        assert "x-conductor-prefill-instance" not in headers  # answered here, not forwarded
    status, headers, _ = await complete(http, router, "hello", model="alias")
    assert (status, headers["x-conductor-prefill-instance"]) == (200, "e0")


async def test_models_of_an_upstream_unreachable_at_start_are_learned_later(
    engine_sims, serve, http
):
    port = free_port()
    # the upstream is not there: start-up goes on
    router = await serve(layout([f"http://127.0.0.1:{port}"]))
    assert await router_models(http, router) == [MODEL]  # the configured model meanwhile
    status, _, answer = await complete(http, router, "hello", model="nope")
    assert status == 503, answer  # no upstream to take it, but not refused as unknown

    engine_sims("late", "--served-model-name", MODEL, "alias", port=port)
    await eventually(lambda: router_models(http, router), lambda ids: ids == [MODEL, "alias"])
    status, _, answer = await complete(http, router, "hello", model="nope")
    assert status == 404 and answer["error"]["type"] == "NotFoundError"
    status, headers, _ = await complete(http, router, "hello", model="alias")
    assert (status, headers["x-conductor-prefill-instance"]) == (200, "e0")
