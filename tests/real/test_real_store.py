"""KV moves through a real Mooncake store between two real vLLM engines (vLLM's own
MooncakeStoreConnector, the store as a separate process, engines as pure clients): what
engine A computed, engine B loads instead of recomputing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import zmq

from conductor.wire import BlockStored, decode_batch
from conductor.wire.events import Tier
from tests.real.checks import MODEL, conductor_hit, documents, metric
from tests.real.conftest import RealEngine
from tests.support.api import eventually
from tests.support.processes import ConductorProcess
from tests.support.store import store_skip_reason

BLOCK = 32
pytestmark = pytest.mark.skipif(store_skip_reason() is not None, reason=str(store_skip_reason()))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def _all_healthy(engines: list[RealEngine]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        await asyncio.gather(*(engine.wait_healthy(http) for engine in engines))


@pytest.fixture(scope="module")
def store_pair(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[tuple]:
    from publishers.store import MIB, LocalStore

    run_dir = tmp_path_factory.mktemp("store-pair")
    store = LocalStore(run_dir, 512 * MIB)
    store.start()
    config = run_dir / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "mode": "standalone-store",  # the store process holds the memory
                "metadata_server": store.address.metadata_url,
                "master_server_address": store.address.master,
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": "0",
                "local_buffer_size": "128MB",
            }
        )
    )
    connector = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    engines = [
        RealEngine(
            run_dir / name,
            model_dir,
            BLOCK,
            name=name,
            args=["--kv-transfer-config", json.dumps(connector)],
            env={
                "MOONCAKE_CONFIG_PATH": str(config),
                "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
                "VLLM_CPU_OMP_THREADS_BIND": cpu,
            },
        )
        for name, cpu in (("store-a", "0"), ("store-b", "1"))
    ]
    try:
        for engine in engines:
            engine.start()
        asyncio.run(_all_healthy(engines))
        yield store, *engines
    finally:
        for engine in engines:
            engine.stop()
        store.stop()


async def _complete(http: aiohttp.ClientSession, engine: RealEngine, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    async with http.post(f"{engine.url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def _events(socket: zmq.Socket) -> list:
    events = []
    while socket.poll(500):
        topic, _, payload = socket.recv_multipart()
        events.extend(decode_batch(payload, topic).events)
    return events


async def _register(http, conductor: str, engine: RealEngine, kv_store: str) -> None:
    body = {
        "endpoint": engine.plan.events_endpoint,
        "replay_endpoint": engine.plan.replay_endpoint,
        "type": "vLLM",
        "modelname": MODEL,
        "block_size": BLOCK,
        "instance_id": engine.name,
        "kv_store": kv_store,
    }
    async with http.post(f"{conductor}/register", json=body) as response:
        assert response.status == 200, await response.text()


async def test_a_prefix_saved_by_one_engine_is_loaded_by_another(
    store_pair, http, tmp_path
) -> None:
    """The conductor shows B the prefix on the CPU tier (the store) before B has seen it;
    B then loads it from the store instead of computing it."""
    store, engine_a, engine_b = store_pair
    conductor = ConductorProcess(tmp_path)
    conductor.wait_ready()
    for engine in (engine_a, engine_b):
        await _register(http, conductor.url, engine, store.address.master)
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(engine_a.plan.events_endpoint)
    await asyncio.sleep(0.5)  # the subscription reaches the publisher
    try:
        prompt = documents(1, 500, seed=31)[0]
        async with http.post(
            f"{engine_a.url}/tokenize", json={"model": MODEL, "prompt": prompt}
        ) as r:
            tokens = (await r.json())["tokens"]
        first = await _complete(http, engine_a, prompt)
        saved_tokens = len(tokens) // BLOCK * BLOCK
        seen_by_b = await eventually(
            lambda: conductor_hit(http, conductor.url, engine_b.name, tokens, BLOCK),
            lambda hit: hit["CPU"] == saved_tokens,
        )
        assert seen_by_b["GPU"] == 0  # B computed nothing; the store holds it all
        hits_before = await metric(http, engine_b.url, "vllm:external_prefix_cache_hits_total")
        second = await _complete(http, engine_b, prompt)
        events = _events(subscriber)
    finally:
        context.destroy(linger=0)
        conductor.stop()

    prompt_tokens = first["usage"]["prompt_tokens"]
    full_blocks = prompt_tokens // BLOCK
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == min(full_blocks * BLOCK, prompt_tokens - 1)  # B computed none of them
    hits = await metric(http, engine_b.url, "vllm:external_prefix_cache_hits_total")
    assert hits - hits_before == cached  # ... because it loaded them from the store
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # greedy, same KV

    saved = [e for e in events if isinstance(e, BlockStored) and e.tier is Tier.CPU]
    assert len(saved) == full_blocks  # one BlockStored per block, medium "cpu"
    assert all(len(e.block_hashes) == 1 and e.token_ids for e in saved)
    gpu = [e for e in events if isinstance(e, BlockStored) and e.tier is Tier.GPU]
    assert [h for e in gpu for h in e.block_hashes] == [e.block_hashes[0] for e in saved]
