"""The router under faults, hostile input and operator mistakes (issue 9): engines that
report poison numbers, never answer, stall mid-stream or tokenize slowly; bodies too big,
too many or too deep; config mistakes; conductors that are down, several, or guarded."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router import config as router_config
from router.__main__ import main as router_main
from router.engine_metrics import engine_in_flight, parse_metrics
from router.policy import PrefillCostModel
from router.pool import CostLearner
from tests.router.inprocess import MODEL, layout
from tests.support.api import eventually, metric
from tests.support.processes import ConductorProcess, EngineSim, RouterProcess, free_port

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


# -- an engine that misbehaves on purpose ----------------------------------------------------
@dataclass
class OddEngine:
    """A real HTTP upstream on 127.0.0.1 whose every route can be told to misbehave."""

    url: str = ""
    tokenize: str = "ok"  # ok | slow | list | strings
    complete: str = "ok"  # ok | hang | stall (one chunk of a stream, then nothing)
    ttft_ms: list[str] = field(default_factory=list)  # x-engine-ttft-ms per answer, in turn
    metrics: str = 'vllm:num_requests_running{model_name="m"} 0\n'
    completions: int = 0  # requests that reached /v1/completions
    released: asyncio.Event = field(default_factory=asyncio.Event)

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.tokenize == "slow":
            await self.released.wait()
        answers = {"list": [1, 2, 3], "strings": {"tokens": ["a", "b"]}}
        return web.json_response(answers.get(self.tokenize, {"tokens": [1, 2, 3, 4, 5]}))

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.completions += 1
        body = await request.json()
        if self.complete == "hang":
            await self.released.wait()
        headers = {"x-engine-ttft-ms": self.ttft_ms.pop(0)} if self.ttft_ms else {}
        if self.complete == "stall" or body.get("stream"):
            response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            if self.complete == "stall":
                await self.released.wait()
            await response.write(b"data: [DONE]\n\n")
            return response
        answer = {"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 5}}
        return web.json_response(answer, headers=headers)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/tokenize", self._tokenize),
                web.post("/v1/completions", self._complete),
                web.get("/metrics", self._metrics),
                web.get("/health", self._ok),
                web.get("/v1/models", self._ok),
            ]
        )
        return app


@pytest.fixture
async def odd_engines() -> AsyncIterator[list[OddEngine]]:
    """Two misbehaving engines (well-behaved until told otherwise)."""
    engines = [OddEngine(), OddEngine()]
    servers = [TestServer(engine.app(), host="127.0.0.1") for engine in engines]
    for engine, server in zip(engines, servers, strict=True):
        await server.start_server(shutdown_timeout=0.1)
        engine.url = f"http://127.0.0.1:{server.port}"
    yield engines
    for engine in engines:
        engine.released.set()
    for server in servers:
        await server.close()


async def complete(
    http: aiohttp.ClientSession, url: str, **body: Any
) -> tuple[int, dict[str, str], Any]:
    request = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, **body}
    async with http.post(f"{url}/v1/completions", json=request) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)


async def health(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/health") as response:
        return await response.json()


def assert_openai_error(answer: Any, status: int) -> None:
    assert set(answer["error"]) == OPENAI_ERROR_KEYS, answer
    assert answer["error"]["code"] == status, answer


# -- engine-reported numbers ------------------------------------------------------------------
async def test_poison_ttft_headers_never_fail_later_requests(serve, odd_engines, http):
    engine = odd_engines[0]
    engine.ttft_ms = ["NaN", "inf", "-5", "1e300", "nonsense", "12.5"]
    router, url = await serve(
        layout([engine.url], routing={"policy": "ttft", "ttft_slo_ms": 60000})
    )
    for _ in range(8):
        async with http.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True}
        ) as response:
            assert response.status == 200, await response.text()
            await response.read()
    assert await metric(http, url, 'router_engine_values_rejected_total{value="ttft_header"}') == 5
    learner = router.catalog.default.learner
    assert learner is not None and math.isfinite(learner.model.per_token_s)


def test_one_absurd_ttft_moves_the_learned_cost_a_bounded_step():
    learner = CostLearner(PrefillCostModel(overhead_s=0.0, per_token_s=1e-4), weight=0.1)
    learner.observe(new_tokens=100, queued_tokens=0, ttft_s=3600.0)  # a stalled hour
    assert learner.model.per_token_s <= 1.3e-4 + 1e-12  # not 0.36 s per token


def test_metrics_lines_are_read_one_by_one():
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{model_name="m"} 3\n'
        "this line is not prometheus\n"
        'vllm:num_requests_waiting{model_name="m" 2\n'  # unclosed labels
        'vllm:num_requests_waiting{model_name="m"} NaN\n'
        'vllm:num_requests_waiting{model_name="m"} 1e300\n'  # finite, absurd: ignored
        'vllm:num_requests_waiting{model_name="m"} 2\n'
    )
    samples, skipped = parse_metrics(text)
    assert skipped == 3
    assert engine_in_flight(samples) == (5, 1)


async def test_odd_metrics_lines_do_not_stop_the_load_refresher(serve, odd_engines, http):
    engine = odd_engines[0]
    engine.metrics = 'vllm:num_requests_running{model_name="m"} inf\nodd line\n'
    router, url = await serve(layout([engine.url], upstream={"metrics_interval_seconds": 0.05}))
    name = 'router_engine_values_rejected_total{value="metrics_line"}'
    await eventually(lambda: metric(http, url, name), lambda n: n >= 2)  # two scrapes at least
    engine.metrics = 'vllm:num_requests_running{model_name="m"} 7\nodd line\n'
    in_flight = router.pool.prefill["e0"]
    await eventually(lambda: asyncio.sleep(0, in_flight.engine_in_flight), lambda n: n == 7)
    state = (await health(http, url))["tasks"]["refresh_engine_load"]
    assert state == {"state": "running", "restarts": 0, "last_error": ""}


# -- timeouts ---------------------------------------------------------------------------------
async def test_an_engine_that_never_answers_is_a_timeout_then_another_engine(
    serve, odd_engines, http
):
    hung, fine = odd_engines
    hung.complete = "hang"
    timeouts = {"first_byte_timeout_seconds": 0.3, "probe_interval_seconds": 60}
    _, url = await serve(layout([hung.url, fine.url], upstream=timeouts))
    status, headers, _ = await complete(http, url)  # round robin: the hung one first
    assert (status, headers["x-conductor-prefill-instance"]) == (200, "e1")
    assert hung.completions == 1
    name = 'router_upstream_timeouts_total{instance="e0",stage="first_byte"}'
    assert await metric(http, url, name) == 1

    _, alone = await serve(layout([hung.url], upstream=timeouts))
    status, _, answer = await complete(http, alone)
    assert status == 504 and answer["error"]["type"] == "GatewayTimeoutError"
    assert_openai_error(answer, 504)


async def test_a_stream_that_stalls_is_cut_after_the_idle_timeout(serve, odd_engines, http):
    engine = odd_engines[0]
    engine.complete = "stall"
    _, url = await serve(layout([engine.url], upstream={"idle_timeout_seconds": 0.3}))
    request = {"model": MODEL, "prompt": "go", "max_tokens": 4, "stream": True}
    async with http.post(f"{url}/v1/completions", json=request) as response:
        assert response.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):  # cut, never a clean end
            await asyncio.wait_for(response.read(), timeout=5)
    assert (
        await metric(http, url, 'router_upstream_timeouts_total{instance="e0",stage="idle"}') == 1
    )


async def test_a_slow_tokenizer_is_a_timeout_not_a_dead_engine(serve, odd_engines, http):
    slow, fine = odd_engines
    slow.tokenize = "slow"
    config = layout([slow.url, fine.url], upstream={"tokenize_timeout_seconds": 0.2})
    _, url = await serve(config)
    for _ in range(4):
        status, headers, _ = await complete(http, url)
        # tokens came from the other engine: only the (absent) conductor is missing
        assert (status, headers["x-conductor-fallback"]) == (200, "conductor_unavailable")
    assert (await health(http, url))["prefill_instances"] == ["e0", "e1"]  # both in rotation
    assert (
        await metric(http, url, 'router_upstream_timeouts_total{instance="e0",stage="tokenize"}')
        >= 1
    )
    assert slow.completions == 2  # still routed to


@pytest.mark.parametrize("shape", ["list", "strings"])
async def test_a_tokenize_answer_of_another_shape_is_skipped(serve, odd_engines, http, shape):
    odd_engines[0].tokenize = shape
    _, url = await serve(layout([odd_engines[0].url]))
    status, headers, answer = await complete(http, url)
    assert status == 200, answer
    assert headers["x-conductor-fallback"] == "tokenize_failed"
    assert await metric(http, url, 'router_engine_values_rejected_total{value="tokenize_answer"}')


# -- request limits ---------------------------------------------------------------------------
async def test_bodies_too_deep_too_many_or_too_big_are_clear_client_errors(
    serve, odd_engines, http
):
    limits = {"max_body_bytes": 200_000, "max_json_items": 1000, "max_json_depth": 8}
    _, url = await serve(layout([odd_engines[0].url], limits=limits))
    deep = b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    nested = json.dumps({"model": MODEL, "prompt": "x", "extra": [[[[[[[[[1]]]]]]]]]}).encode()
    many = json.dumps({"model": MODEL, "prompt": list(range(2000))}).encode()
    big = json.dumps({"model": MODEL, "prompt": "x" * 300_000}).encode()
    for body, status, words in (
        (deep, 400, "nested deeper"),
        (nested, 400, "nested deeper"),
        (many, 400, "1000 JSON values"),
        (big, 413, "over 200000 bytes"),
    ):
        async with http.post(f"{url}/v1/completions", data=body) as response:
            answer = await response.json()
        assert response.status == status and words in answer["error"]["message"], answer
        assert_openai_error(answer, status)
    assert odd_engines[0].completions == 0


async def test_every_error_is_openai_shaped(serve, odd_engines, http):
    _, url = await serve(layout([odd_engines[0].url]))
    for method, path, status, kind in (
        ("GET", "/nowhere", 404, "NotFoundError"),
        ("GET", "/v1/completions", 405, "MethodNotAllowedError"),
    ):
        async with http.request(method, f"{url}{path}") as response:
            answer = await response.json()
        assert response.status == status and answer["error"]["type"] == kind, answer
        assert_openai_error(answer, status)


async def test_background_tasks_and_loop_lag_are_visible(serve, odd_engines, http):
    _, url = await serve(layout([odd_engines[0].url]))
    state = await health(http, url)
    assert set(state["tasks"]) == {
        "learn_models",
        "probe_unhealthy",
        "refresh_engine_load",
        "keep_registered",
        "report_dead_upstreams",
        "tokenizers",  # runs on: the engine names no tokenizer the router can load
    }
    assert {task["state"] for task in state["tasks"].values()} == {"running"}
    assert state["event_loop_lag_worst_seconds"] >= 0
    assert await metric(http, url, "router_event_loop_lag_seconds_count") >= 0
    async with http.get(f"{url}/metrics") as response:
        assert "router_event_loop_lag_seconds_bucket" in await response.text()


# -- configuration ----------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_config.add_cli_flags(parser)
    return parser.parse_args(argv)


def write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "router.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ((), "routng"),
        (("conductor",), "adress"),
        (("prefill", "config"), "block_sise"),
        (("routing",), "polcy"),
    ],
)
def test_unknown_config_keys_are_rejected_by_name(tmp_path, where, key):
    config = layout(["http://127.0.0.1:1"])
    section = config
    for name in where:
        section = section[name]
    section[key] = 1
    path = write(tmp_path, config)
    with pytest.raises(router_config.ConfigError) as error:
        router_config.load(parse(["--config", path]), environ={})
    assert str(error.value) == f"{path}: {'.'.join([*where, key])}: unknown key"


def test_flags_beat_env_beat_the_file(tmp_path):
    config = layout(["http://127.0.0.1:1"])
    config["conductor"]["auth_token"] = "from-file"
    path = write(tmp_path, config)
    argv = ["--config", path, "--policy", "ttft", "--conductor-address", "h1:1", "h2:2"]
    env = {"ROUTER_CONDUCTOR_TOKEN": "from-env", "ROUTER_CONDUCTOR_ADDRESS": "env:1"}
    timeout = ["--stream-headers-timeout-seconds", "3.5"]
    loaded = router_config.load(parse([*argv, "--max-body-bytes", "5000", *timeout]), environ=env)
    assert loaded.routing.policy == "ttft"  # the file says round_robin
    assert loaded.upstream.stream_headers_timeout_seconds == 3.5
    assert loaded.conductor.urls() == ["http://h1:1", "http://h2:2"]
    assert loaded.conductor.auth_token == "from-env"
    assert loaded.limits.max_body_bytes == 5000
    from_env = router_config.load(parse(["--config", path]), environ=env)
    assert from_env.conductor.urls() == ["http://env:1"]
    from_file = router_config.load(parse(["--config", path]), environ={})
    assert (from_file.conductor.auth_token, from_file.routing.policy) == (
        "from-file",
        "round_robin",
    )
    with_hosts = router_config.load(
        parse(["--config", path, "--prefiller-hosts", "h", "--prefiller-ports", "9"]), environ={}
    )
    assert [i.http_endpoint for i in with_hosts.prefill.instances] == ["http://h:9"]


def test_several_conductors_in_either_spelling(tmp_path):
    config = layout(["http://127.0.0.1:1"])
    config["conductor"] = {"address": ["a:1", "http://b:2/"], "addresses": ["c:3", "a:1"]}
    loaded = router_config.load(parse(["--config", write(tmp_path, config)]), environ={})
    assert loaded.conductor.urls() == ["http://a:1", "http://b:2", "http://c:3"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "must be a port 1..65535"),
        (["--log-level", "verbose"], "must be one of"),
        (["--config", "/nonexistent/router.json"], "config file /nonexistent/router.json does not"),
    ],
)
def test_operator_mistakes_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        router_main(argv)
    assert exit_.value.code != 0
    out = capsys.readouterr()
    assert message in out.err + str(exit_.value.code)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        router_main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("mooncake-router ")


# -- the process: signals, logs ---------------------------------------------------------------
async def test_sigterm_stops_within_two_seconds_while_a_stream_is_held(tmp_path, odd_engines, http):
    engine = odd_engines[0]
    engine.complete = "stall"
    router = RouterProcess(tmp_path, layout([engine.url]), "--access-log")
    try:
        router.wait_ready()
        async with http.get(f"{router.url}/health") as response:
            assert response.status == 200
        request = {"model": MODEL, "prompt": "go", "max_tokens": 4, "stream": True}
        async with http.post(f"{router.url}/v1/completions", json=request) as response:
            await response.content.readline()  # the stream is open and stalled upstream
            router.process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(router.process.wait, 2.0)
        assert code == 0, router.log_tail()
    except subprocess.TimeoutExpired:
        pytest.fail(f"the router did not stop within 2 s:\n{router.log_tail()}")
    finally:
        router.kill()
    assert re.search(r"logger=router.access .*GET /health", router.log())


async def test_sigint_stops_an_idle_router(tmp_path, odd_engines):
    router = RouterProcess(tmp_path, layout([odd_engines[0].url]))
    try:
        router.wait_ready()
        router.process.send_signal(signal.SIGINT)
        try:
            assert await asyncio.to_thread(router.process.wait, 2.0) == 0
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 2 s after SIGINT; its log:\n{router.log_tail(40)}")
    finally:
        router.kill()


async def test_a_down_conductor_is_one_warning_not_one_per_request(
    serve, odd_engines, http, caplog
):
    _, url = await serve(layout([odd_engines[0].url]))
    with caplog.at_level(logging.WARNING, logger="router"):
        for _ in range(5):
            status, headers, _ = await complete(http, url)
            assert status == 200 and headers["x-conductor-fallback"] == "conductor_unavailable"
    lines = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(lines) == 1, lines
    assert (await health(http, url))["conductors"] != {}


# -- with real conductors ---------------------------------------------------------------------
@dataclass
class SimEngine:
    """An engine simulator publishing KV events on fixed ports, restartable on its port."""

    tmp_path: Path
    pub: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)
    process: EngineSim | None = None

    def start(self) -> EngineSim:
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{self.pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}",
        }
        port = self.process.port if self.process is not None else None
        self.process = EngineSim(
            self.tmp_path, "a", "--kv-events-config", json.dumps(events), "--sim-kv-bind",
            port=port,
        )  # fmt: skip
        self.process.wait_ready()
        return self.process

    def instance(self) -> dict[str, Any]:
        """Its entry in the router's config."""
        assert self.process is not None
        stream = {
            "endpoint": f"tcp://127.0.0.1:{self.pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay}",
        }
        return {"instance_id": "a", "http_endpoint": self.process.url, "registrations": [stream]}


@pytest.fixture
def engine_sim(tmp_path: Path) -> Iterator[SimEngine]:
    engine = SimEngine(tmp_path)
    engine.start()
    yield engine
    assert engine.process is not None
    engine.process.stop()


def conductor_config(*conductors: ConductorProcess, **extra: Any) -> dict[str, Any]:
    return {
        "address": [c.url for c in conductors],
        "query_timeout_seconds": 0.5,
        "reregister_interval_seconds": 0.5,
        "registration_timeout_seconds": 2,
        **extra,
    }


async def services(http: aiohttp.ClientSession, conductor: ConductorProcess, **kw) -> list:
    async with http.get(f"{conductor.url}/services", **kw) as response:
        return (await response.json())["services"]


async def test_several_conductors_fail_over(tmp_path, serve, engine_sim, conductor_factory, http):
    first, second = conductor_factory(), conductor_factory()
    config = layout([], conductor=conductor_config(first, second))
    config["prefill"]["instances"] = [engine_sim.instance()]
    router, url = await serve(config)
    for conductor in (first, second):  # registered with both
        await eventually(lambda c=conductor: services(http, c), lambda s: len(s) == 1)
    status, headers, _ = await complete(http, url)
    assert status == 200 and "x-conductor-fallback" not in headers
    first.kill()
    status, headers, _ = await complete(http, url)
    assert status == 200 and "x-conductor-fallback" not in headers  # the second answered
    assert (await health(http, url))["conductors"] == {first.url: "down", second.url: "up"}


async def test_the_conductor_token_goes_with_every_call(
    tmp_path, serve, engine_sim, conductor_factory, http
):
    try:
        conductor = conductor_factory("--auth-token", "s3cret", "--auth-all")
    except RuntimeError as error:
        pytest.skip(f"this conductor has no --auth-token/--auth-all yet: {error}")
    config = layout([], conductor=conductor_config(conductor, auth_token="s3cret"))
    config["prefill"]["instances"] = [engine_sim.instance()]
    _, url = await serve(config)
    bearer = {"headers": {"Authorization": "Bearer s3cret"}}
    await eventually(lambda: services(http, conductor, **bearer), lambda s: len(s) == 1)
    status, headers, _ = await complete(http, url)
    assert status == 200 and "x-conductor-fallback" not in headers  # /query passed auth too


async def test_a_dead_engine_is_reported_down_to_the_conductor_and_up_again(
    tmp_path, serve, engine_sim, conductor_factory, http
):
    conductor = conductor_factory()
    async with http.post(f"{conductor.url}/instance_up", json={"instance_id": "x"}) as response:
        if response.status == 405 or (
            response.status == 404 and "instance not found" not in await response.text()
        ):
            pytest.skip("this conductor has no /instance_down and /instance_up routes yet")
    upstream = {"probe_interval_seconds": 0.2, "metrics_interval_seconds": 0.2}
    config = layout([], conductor=conductor_config(conductor), upstream=upstream)
    config["prefill"]["instances"] = [engine_sim.instance()]
    await serve(config)

    async def state() -> str:
        found = await services(http, conductor)
        return found[0]["State"] if found else "absent"

    await eventually(state, lambda s: s == "connected")
    assert engine_sim.process is not None
    engine_sim.process.kill()
    await eventually(state, lambda s: s == "down")  # the scraper saw it go and said so
    engine_sim.start()  # back on its port: probed healthy, reported up
    await eventually(state, lambda s: s == "connected")
