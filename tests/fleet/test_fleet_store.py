"""``mooncake-fleet up config/fleet-sim-store.json``: simulated engines sharing a real
Mooncake store come up, serve, move KV through the store on loopback only, and stop in
order; a store process that dies takes the fleet down with its log."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.api import eventually, metric
from tests.support.fleet import FleetProcess, established_tcp, fleet_pids, is_loopback
from tests.support.processes import REPO

pytestmark = pytest.mark.needs("store")


SIM_STORE = json.loads((REPO / "config" / "fleet-sim-store.json").read_text())
MODEL, BLOCK = SIM_STORE["model"]["name"], SIM_STORE["block_size"]
PROMPT = "Why a prefix saved to the store can be loaded by any engine of the fleet. " * 12


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetProcess, dict]]:
    """The shipped file as it is (its fixed ports are free in a namespace of its own)."""
    process = FleetProcess(tmp_path_factory.mktemp("sim-store"), SIM_STORE)
    try:
        yield process, process.wait_ready(timeout=60)
    finally:
        process.stop(timeout=30)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def _complete(http: aiohttp.ClientSession, base: str) -> tuple[Any, dict[str, Any]]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    async with http.post(f"{base}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return response.headers, await response.json()


async def _hit(http: aiohttp.ClientSession, conductor: str, tokens: list[int], name: str) -> dict:
    body = {"model": MODEL, "block_size": BLOCK, "token_ids": tokens, "instance_id": name}
    async with http.post(f"{conductor}/query", json=body) as response:
        return (await response.json()).get("default", {}).get(name, {"GPU": 0, "CPU": 0})


async def test_the_simulated_store_fleet_moves_kv_through_the_store(fleet, http) -> None:
    _, services = fleet
    master, store = services["mooncake-master"], services["mooncake-store"]
    assert master["master_address"] == "127.0.0.1:25051" and master["url"].endswith(":9003")
    assert store["segment_mb"] == SIM_STORE["kv_store"]["segment_mb"]
    a, b = services["sim-0"]["url"], services["sim-1"]["url"]
    conductor, router = services["conductor"]["url"], services["router"]["url"]
    async with http.post(f"{a}/tokenize", json={"model": MODEL, "prompt": PROMPT}) as response:
        tokens = (await response.json())["tokens"]
    saved = len(tokens) // BLOCK * BLOCK

    await _complete(http, a)
    seen = await eventually(
        lambda: _hit(http, conductor, tokens, "sim-1"), lambda hit: hit["CPU"] == saved
    )
    assert seen["GPU"] == 0  # sim-1 has not seen the prompt: the store holds it
    hits = await metric(http, b, "vllm:external_prefix_cache_hits_total")
    _, answer = await _complete(http, b)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == min(saved, len(tokens) - 1)
    assert await metric(http, b, "vllm:external_prefix_cache_hits_total") - hits == cached

    headers, answer = await _complete(http, router)
    assert (
        int(headers["x-conductor-cached-tokens"])
        == (answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    )

    async def store_health() -> dict[str, Any]:
        async with http.get(f"{conductor}/health") as response:
            return (await response.json())["kv_stores"][master["master_address"]]

    # the conductor checks the store at the admin URL the fleet gave it
    await eventually(store_health, lambda store: store["state"] == "up", timeout=15)

    connections = established_tcp(fleet_pids(services))
    assert {"mooncake_master", "mooncake_client"} <= {c[0] for c in connections}
    outside = [c for c in connections if not (is_loopback(c[1]) and is_loopback(c[2]))]
    assert not outside, outside


def test_the_store_stops_after_the_engines(fleet) -> None:
    process, services = fleet
    assert process.stop(timeout=30) == 0
    assert (
        "stopping router, sim-0, sim-1, mooncake-store, mooncake-master, conductor"
        in process.output()
    )
    assert not fleet_pids(services), "a fleet process outlived the fleet"


def test_a_store_process_that_dies_stops_the_fleet(tmp_path: Path) -> None:
    spec = {**SIM_STORE, "conductor": {}, "router": {}, "kv_store": {"segment_mb": 64}}
    spec["engines"] = [{"name": "sim-0", "kind": "sim"}]
    process = FleetProcess(tmp_path / "run", spec)
    try:
        services = process.wait_ready(timeout=60)
        os.kill(services["mooncake-store"]["pid"], signal.SIGKILL)
        assert process.wait_exit(timeout=40) == 1
    finally:
        process.stop()
    output = process.output()
    assert "mooncake-store exited with code -9; last lines of" in output
    assert "Mounting segment" in output.split("mooncake-store exited")[1]  # its log's tail
    assert not fleet_pids(services)
