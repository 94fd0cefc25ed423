"""KV moves through a real Mooncake store between two real vLLM engines, all started by
``mooncake-fleet up`` with a ``kv_store`` (vLLM's own MooncakeStoreConnector, the store's
memory in its own process, engines as pure clients): what engine A computed, engine B loads
instead of recomputing; the conductor shows it on B's CPU tier before B has seen it, the
router prices it, and nothing of it leaves 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq

from conductor.wire import BlockStored, decode_batch
from conductor.wire.events import Tier
from publishers.engine.block_hash import BlockHasher
from tests.real.checks import MODEL, conductor_hit, documents, indexed
from tests.real.conftest import fleet_spec, running_fleet
from tests.support.api import eventually, metric
from tests.support.fleet import established_tcp, fleet_pids, is_loopback

pytestmark = pytest.mark.needs("vllm", "store")

BLOCK = 32
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"  # tokens a KV connector loaded
KEY_LAYOUT = "@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"  # the connector's key after the model


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


@pytest.fixture(scope="module")
def store_fleet(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    """Two real engines sharing one store, behind conductor and router. ``store-a`` runs in
    vLLM's dev mode, which serves /reset_prefix_cache."""
    engines = [
        {"name": "store-a", "kind": "vllm", "env": {"VLLM_SERVER_DEV_MODE": "1"}},
        {"name": "store-b", "kind": "vllm"},
    ]
    spec = fleet_spec(
        engines,
        BLOCK,
        model={"name": MODEL, "path": str(model_dir)},
        kv_store={"segment_mb": 256},
    )
    with running_fleet(tmp_path_factory.mktemp("store-fleet"), spec) as services:
        yield services


def url(fleet: dict[str, Any], name: str) -> str:
    return fleet[name]["url"]


async def _complete(http: aiohttp.ClientSession, base: str, prompt: str) -> tuple[Any, dict]:
    """(headers, answer) of a greedy completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    async with http.post(f"{base}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return response.headers, await response.json()


async def _tokens(http: aiohttp.ClientSession, engine: str, prompt: str) -> list[int]:
    async with http.post(f"{engine}/tokenize", json={"model": MODEL, "prompt": prompt}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["tokens"]


def _events(socket: zmq.Socket) -> list:
    events = []
    while socket.poll(500):
        topic, _, payload = socket.recv_multipart()
        events.extend(decode_batch(payload, topic).events)
    return events


async def test_a_prefix_saved_by_one_engine_is_loaded_by_another(
    store_fleet, http, model_dir
) -> None:
    """The conductor shows B the prefix on the CPU tier (the store) before B has seen it;
    the store holds it under the connector's keys; B then loads it instead of computing it
    and answers what A answered."""
    a, b, conductor = (url(store_fleet, n) for n in ("store-a", "store-b", "conductor"))
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(store_fleet["store-a"]["events_endpoint"])
    await asyncio.sleep(0.5)  # the subscription reaches the publisher
    try:
        prompt = documents(1, 500, seed=31)[0]
        tokens = await _tokens(http, a, prompt)
        _, first = await _complete(http, a, prompt)
        saved_tokens = len(tokens) // BLOCK * BLOCK
        seen_by_b = await eventually(
            lambda: conductor_hit(http, conductor, "store-b", tokens, BLOCK),
            lambda hit: hit["CPU"] == saved_tokens,
        )
        assert seen_by_b["GPU"] == 0  # B computed nothing; the store holds it all
        hits_before = await metric(http, b, EXTERNAL_HITS)
        _, second = await _complete(http, b, prompt)
        events = _events(subscriber)
    finally:
        context.destroy(linger=0)

    prompt_tokens = first["usage"]["prompt_tokens"]
    full_blocks = prompt_tokens // BLOCK
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == min(full_blocks * BLOCK, prompt_tokens - 1)  # B computed none of them
    assert await metric(http, b, EXTERNAL_HITS) - hits_before == cached  # it loaded them
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, same KV

    saved = [e for e in events if isinstance(e, BlockStored) and e.tier is Tier.CPU]
    assert len(saved) == full_blocks  # one BlockStored per block, medium "cpu"
    assert all(len(e.block_hashes) == 1 and e.token_ids for e in saved)
    gpu = [e for e in events if isinstance(e, BlockStored) and e.tier is Tier.GPU]
    assert [h for e in gpu for h in e.block_hashes] == [e.block_hashes[0] for e in saved]

    digests = BlockHasher("sha256", "0").block_digests(tokens, BLOCK)  # A: PYTHONHASHSEED=0
    keys = [f"{model_dir.name}{KEY_LAYOUT}{digest.hex()}" for digest in digests]
    admin = url(store_fleet, "mooncake-master")
    async with http.get(f"{admin}/batch_query_keys", params={"keys": ",".join(keys)}) as r:
        found = (await r.json())["data"]
    assert [found[key]["ok"] for key in keys] == [True] * full_blocks


async def test_the_router_prices_a_prefix_only_the_store_holds(store_fleet, http) -> None:
    """A computes a prompt, then loses it from its own cache: the store is the only place
    left. Through the router the prompt is priced with the store's tokens and answered by
    loading them (the engine's cached tokens equal the router's claim)."""
    a, router, conductor = (url(store_fleet, n) for n in ("store-a", "router", "conductor"))
    prompt = documents(1, 400, seed=47)[0]
    tokens = await _tokens(http, a, prompt)
    await _complete(http, a, prompt)
    await indexed(http, conductor, "store-a", tokens, BLOCK)
    saved_tokens = len(tokens) // BLOCK * BLOCK

    async def reset_a() -> dict:
        """vLLM refuses a reset while blocks are in use (the connector may still be saving
        them) and announces one only with its next step: ask until the conductor shows it."""
        async with http.post(f"{a}/reset_prefix_cache") as response:
            assert response.status == 200, await response.text()
        await _complete(http, a, "Hello")
        return await conductor_hit(http, conductor, "store-a", tokens, BLOCK)

    await eventually(reset_a, lambda hit: hit["GPU"] == 0, timeout=30.0, interval=0.5)
    for instance in ("store-a", "store-b"):
        await eventually(
            lambda i=instance: conductor_hit(http, conductor, i, tokens, BLOCK),
            lambda hit: hit["GPU"] == 0 and hit["CPU"] == saved_tokens,
        )

    hits_before = {
        n: await metric(http, url(store_fleet, n), EXTERNAL_HITS) for n in ("store-a", "store-b")
    }
    headers, answer = await _complete(http, router, prompt)
    owner = headers["x-conductor-prefill-instance"]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert int(headers["x-conductor-cached-tokens"]) == cached > 0
    assert cached == min(saved_tokens, len(tokens) - 1)
    loaded = await metric(http, url(store_fleet, owner), EXTERNAL_HITS) - hits_before[owner]
    assert loaded == cached  # all of it came from the store
    async with http.get(f"{conductor}/health") as response:  # checked at the fleet's admin URL
        store = (await response.json())["kv_stores"][
            store_fleet["mooncake-master"]["master_address"]
        ]
    assert store["state"] == "up" and store["blocks"] > 0


async def test_everything_the_store_moves_stays_on_loopback(store_fleet, http) -> None:
    """Every established TCP connection of the fleet's processes (engines to the master and
    to the store process included) runs 127.0.0.1 to 127.0.0.1, and the store advertises
    127.0.0.1 for the blocks it holds."""
    a, b, admin = (url(store_fleet, n) for n in ("store-a", "store-b", "mooncake-master"))
    prompt = documents(1, 200, seed=59)[0]
    await _complete(http, a, prompt)
    await _complete(http, b, prompt)  # a load: B talks to the store process
    connections = established_tcp(fleet_pids(store_fleet))
    names = {name for name, _, _ in connections}
    assert {"mooncake_master", "mooncake_client"} <= names, connections
    outside = [c for c in connections if not (is_loopback(c[1]) and is_loopback(c[2]))]
    assert not outside, outside

    async with http.get(f"{admin}/get_all_keys") as response:
        keys = (await response.text()).split()
    assert keys
    async with http.get(f"{admin}/query_key", params={"key": keys[0]}) as response:
        replicas = (await response.json())["data"]
    endpoints = {replica["transport_endpoint_"] for replica in replicas}
    assert endpoints and all(e.startswith("127.0.0.1:") for e in endpoints), endpoints
    async with http.get(f"{admin}/get_all_segments") as response:
        segments = (await response.text()).split()
    assert segments and all(s.startswith("127.0.0.1:") for s in segments), segments
