"""The router with a Mooncake store configured, in front of a real conductor process that
watches the store: the instances' kv_store reaches the conductor in their registrations,
store hits are priced for every instance of the store, and while the conductor reports the
store down nothing is priced or pulled through it (``router_kv_store_up``) until it is up.
A router without a store never asks the conductor about one. The store's cost is learned
from what the engines' /metrics say they loaded."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.store_loads import store_loads
from tests.router.sim_fleet import Fleet, complete
from tests.router.test_router_service import indexed_everywhere, metric
from tests.router.vllm_metrics import VllmStoreMetrics
from tests.support.api import eventually
from tests.support.processes import RouterProcess, free_port
from tests.support.wire_publisher import WirePublisher, stored

CHECK_S = 0.2  # the conductor's store checks and the router's look at them
PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks of 4, the engine may reuse all
STORED_TOKENS = 16


@pytest.fixture
def store_fleet(tmp_path: Path) -> Iterator[Callable[[str, str], Fleet]]:
    """A fleet whose conductor checks the store ``master`` at ``admin_url`` every CHECK_S."""
    fleets: list[Fleet] = []

    def start(master: str, admin_url: str) -> Fleet:
        config = {"kv_store_admin_urls": {master: admin_url}, "kv_store_check_interval_s": CHECK_S}
        fleets.append(Fleet(tmp_path, conductor_config=config))
        return fleets[-1]

    yield start
    for fleet in fleets:
        fleet.stop()


def with_store(config: dict[str, Any], master: str) -> dict[str, Any]:
    """``config`` with every prefill instance saving to the store at ``master``."""
    for instance in config["prefill"]["instances"]:
        instance["kv_store"] = master
    config["conductor"]["store_check_interval_seconds"] = CHECK_S
    return config


async def router_json(http: aiohttp.ClientSession, router: RouterProcess, path: str) -> Any:
    async with http.get(f"{router.url}{path}") as response:
        return await response.json()


async def store_up(http: aiohttp.ClientSession, router: RouterProcess, master: str) -> float:
    return await metric(http, router, f'router_kv_store_up{{kv_store="{master}"}}')


async def test_a_store_the_conductor_reports_down_is_not_priced(store_fleet, http):
    """Nothing answers at the store's admin URL: the conductor's checks fail, its /health
    says down, and so does the router, which keeps serving (by recomputation)."""
    master = f"127.0.0.1:{free_port()}"
    fleet = store_fleet(master, f"http://127.0.0.1:{free_port()}")
    for name in ("a", "b"):
        fleet.engine(name)
    router = fleet.start_router(with_store(fleet.config(["a", "b"]), master))
    await indexed_everywhere(http, fleet, ["a", "b"])
    async with http.get(f"{fleet.conductor.url}/services") as response:
        services = (await response.json())["services"]
    assert {s["InstanceID"]: s["KVStore"] for s in services} == {"a": master, "b": master}

    await eventually(lambda: store_up(http, router, master), lambda up: up == 0)
    health = await router_json(http, router, "/health")
    assert health["kv_stores"] == {master: "down"} and health["status"] == "ok"
    status, headers, _ = await complete(http, router, PROMPT)
    assert status == 200 and headers["x-conductor-policy"] == "ttft"
    warnings = [line for line in router.log().splitlines() if f"kv store {master} is down" in line]
    assert len(warnings) == 1, warnings


async def test_without_a_store_the_router_never_asks_about_one(tmp_path, http):
    fleet = Fleet(tmp_path)
    try:
        await _no_store(fleet, http)
    finally:
        fleet.stop()


async def _no_store(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    fleet.engine("a")
    router = fleet.start_router(fleet.config(["a"]))
    await complete(http, router, PROMPT)
    await asyncio.sleep(1.5)  # the store interval is 1 s by default
    async with http.get(f"{fleet.conductor.url}/metrics") as response:
        text = await response.text()
    assert 'conductor_http_requests_total{route="/register"' in text
    assert 'route="/health"' not in text
    assert "kv_stores" not in await router_json(http, router, "/health")
    assert await metric(http, router, "router_kv_store_up") == 0  # no series at all


@pytest.mark.needs("store")
async def test_a_killed_master_stops_pricing_until_it_returns(
    store_fleet, http, publisher_factory, tmp_path
):
    """A real store holds a prompt's blocks that engine a saved (its "cpu" events): both
    instances of the store are offered them. The master is killed: the conductor says the
    store is down, the router prices nothing from it; the master returns: up again."""
    from publishers.mooncake_store import KVBlockShape, KVBlockStore, LocalStore, kv_block

    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store", 64 << 20)
    store.start()
    try:
        digests = [hashlib.sha256(bytes(PROMPT[: 4 * (i + 1)])).digest() for i in range(4)]
        client = KVBlockStore(store.address, "m")
        shape = KVBlockShape(layers=2, kv_heads=2, block_size=4, head_dim=32)
        client.put(digests, [kv_block(shape, digest) for digest in digests])
        client.close()
        await _killed_and_back(store_fleet, http, publisher_factory, store, digests)
    finally:
        store.stop()


async def _killed_and_back(store_fleet, http, publisher_factory, store, digests) -> None:
    from conductor.vllm_hash import low64_be

    master = store.address.master
    fleet = store_fleet(master, store.admin_url)
    for name in ("a", "b"):
        fleet.engine(name)
    # the index holds what the test publishes, nothing else: the prompt the test keeps sending
    # must not count as cached where it just ran (routing.in_flight_prefixes)
    config = with_store(fleet.config(["a", "b"], in_flight_prefixes=False), master)
    publishers: dict[str, WirePublisher] = {}
    for instance in config["prefill"]["instances"]:  # the index is fed what the test says
        publisher = publishers[instance["instance_id"]] = publisher_factory()
        stream = instance["registrations"][0]
        stream.update(endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    router = fleet.start_router(config)
    await indexed_everywhere(http, fleet, ["a", "b"])
    health = lambda: router_json(http, router, "/health")  # noqa: E731
    await eventually(health, lambda answer: answer["kv_stores"] == {master: "up"})
    hashes = [low64_be(digest) for digest in digests]
    await publishers["a"].publish([stored(hashes, PROMPT[:STORED_TOKENS], medium="cpu")])

    async def cached() -> int:
        _, headers, _ = await complete(http, router, PROMPT)
        return int(headers["x-conductor-cached-tokens"])

    # either instance may be chosen: both load the prefix from the store
    await eventually(cached, lambda tokens: tokens == STORED_TOKENS)

    store.kill_master()
    await eventually(lambda: store_up(http, router, master), lambda up: up == 0)
    assert await cached() == 0
    assert (await health())["kv_stores"] == {master: "down"}

    store.start_master()
    await eventually(lambda: store_up(http, router, master), lambda up: up == 1, timeout=20)
    assert (await health())["kv_stores"] == {master: "up"}


@pytest.fixture
async def loading_engine() -> AsyncIterator[str]:
    """A real HTTP upstream whose ``/metrics`` are a vLLM engine's with the store connector:
    between two scrapes it loaded 1,000 tokens of 1 KiB from the store at 20 MB/s (a small
    model over loopback TCP)."""
    metrics = VllmStoreMetrics()

    async def scrape(request: web.Request) -> web.Response:
        metrics.load(tokens=1000, nbytes=1_024_000, seconds=0.0512, reads=4)
        return web.Response(text=metrics.text())

    app = web.Application()
    app.add_routes([web.get("/metrics", scrape)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_the_store_cost_is_learned_from_the_engines_store_loads(
    tmp_path, http, loading_engine
):
    fleet = Fleet(tmp_path)
    try:
        config = fleet.config([])
        config["prefill"]["instances"] = [
            {"instance_id": "a", "http_endpoint": loading_engine, "kv_store": "127.0.0.1:1"}
        ]
        router = fleet.start_router(config)
        parameter = 'router_cost_model{{parameter="{}"}}'.format
        assert await metric(http, router, parameter("store_bandwidth_bytes_s")) == 100e9
        bandwidth = await eventually(
            lambda: metric(http, router, parameter("store_bandwidth_bytes_s")),
            lambda value: value < 100e9,
        )  # the first scrape is the baseline, the second one a load
        assert bandwidth == pytest.approx(20e6)
        assert await metric(http, router, parameter("store_bytes_per_token")) == 1024
    finally:
        fleet.stop()


@pytest.mark.needs("store")
async def test_the_store_cost_is_learned_from_simulated_engines_loading_from_a_real_store(
    store_fleet, http, tmp_path
):
    """Engine a computes a prompt and saves it to a real store; engine b (round robin) loads
    it from there. The router reads both engines' store metrics (recorded as vLLM records
    its store calls) and prices the store with what b's loads took."""
    import json

    from publishers.mooncake_store import MIB, STORE_CONNECTOR, LocalStore, connector_config

    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store", 64 << 20)
    store.start()
    try:
        fleet = store_fleet(store.address.master, store.admin_url)
        config_path = tmp_path / "mooncake.json"
        config_path.write_text(json.dumps(connector_config(store.address, 16 * MIB)))
        for name in ("a", "b"):
            fleet.engine(
                name, "--kv-transfer-config", json.dumps(STORE_CONNECTOR),
                env={"MOONCAKE_CONFIG_PATH": str(config_path)},
            )  # fmt: skip
        config = with_store(fleet.config(["a", "b"], policy="round_robin"), store.address.master)
        router = fleet.start_router(config)
        parameter = 'router_cost_model{{parameter="{}"}}'.format
        rounds = iter(range(100))

        async def a_saves_b_loads() -> float:
            """A new prompt to a, then to b; the store bandwidth the router prices now."""
            start = 1000 * next(rounds) + 100
            prompt = list(range(start, start + 641))  # 160 full blocks of 4 tokens
            saved = await metric(http, fleet.engines["a"], "sim_store_saved_blocks_total")
            _, headers, _ = await complete(http, router, prompt)
            assert headers["x-conductor-prefill-instance"] == "a"
            await eventually(
                lambda: metric(http, fleet.engines["a"], "sim_store_saved_blocks_total"),
                lambda blocks: blocks == saved + 160,
            )
            _, headers, answer = await complete(http, router, prompt)
            assert headers["x-conductor-prefill-instance"] == "b"
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 640  # loaded
            return await metric(http, router, parameter("store_bandwidth_bytes_s"))

        # a load before the router's first look at b's metrics is its baseline, not learned
        bandwidth = await eventually(a_saves_b_loads, lambda value: value != 100e9, timeout=30)
        assert 1e5 < bandwidth < 1e11  # loopback TCP, whatever this machine's load
        # the simulator's blocks: 2 layers × K and V × 2 heads × 32 dims × 4 B per token,
        # exactly, in b's own counters
        async with http.get(f"{fleet.engines['b'].url}/metrics") as response:
            loads = store_loads(await response.text())
        assert loads is not None and loads.bytes / loads.tokens == 1024
        # the router learns it between two scrapes: the engine counts a load's bytes when the
        # load ends and its tokens when the request is scheduled (as vLLM does), so a scrape
        # in between shifts one load's bytes to the next sample
        learned = await metric(http, router, parameter("store_bytes_per_token"))
        assert 1024 / 1.5 <= learned <= 1024 * 1.5
    finally:
        store.stop()
