"""The engine simulator's store tier against a real Mooncake store, as vLLM's
``MooncakeStoreConnector`` behaves: the events it publishes are the captured connector's,
a 4k-token prompt saved by one simulated engine loads byte-identical in another (and the
conductor shows it there first), a block with the wrong bytes is caught and recomputed, and
a dead master costs recomputation, not requests."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from publishers.engine.block_hash import BlockHasher
from router.store_loads import store_loads
from tests.support.api import eventually, metric
from tests.support.processes import REPO, ConductorProcess, EngineSim

pytestmark = pytest.mark.needs("store")

CAPTURE = json.loads((REPO / "tests/fixtures/vllm_store_connector_capture.json").read_text())
BLOCK = CAPTURE["block_size"]
MODEL = "tiny"
MODEL_PATH = f"/models/{CAPTURE['model_path_basename']}"  # keys take the path's basename
TOPIC = "kv-events"
EVENTS = json.dumps(
    {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "topic": TOPIC}
)
ONLY_IN_VLLM_032 = "kv_cache_spec_kind"  # see test_the_simulator_publishes_the_connectors_events
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def fresh_store(tmp_path: Path) -> Iterator[Any]:
    """A store of the test's own: empty, and its master may be killed."""
    from publishers.mooncake_store import LocalStore

    store = LocalStore(tmp_path, 256 << 20)
    store.start()
    yield store
    store.stop()


@pytest.fixture
def store_engines(tmp_path: Path) -> Iterator[Callable[..., EngineSim]]:
    """Simulated engines with vLLM's store flag and config file, PYTHONHASHSEED=0 (the
    capture's), events on a loopback port."""
    from publishers.mooncake_store import MIB, STORE_CONNECTOR, connector_config

    started: list[EngineSim] = []

    def start(name: str, store: Any, *args: str) -> EngineSim:
        config = tmp_path / f"{name}-mooncake.json"
        config.write_text(json.dumps(connector_config(store.address, 64 * MIB)))
        engine = EngineSim(
            tmp_path,
            name,
            MODEL_PATH,
            "--kv-transfer-config",
            json.dumps(STORE_CONNECTOR),
            "--kv-events-config",
            EVENTS,
            "--sim-kv-bind",
            "--max-model-len",
            "8192",
            *args,
            model=MODEL,
            block_size=BLOCK,
            env={"PYTHONHASHSEED": "0", "MOONCAKE_CONFIG_PATH": str(config)},
        )
        started.append(engine)
        engine.wait_ready(timeout=40)
        return engine

    yield start
    for engine in started:
        engine.stop()


async def complete(http: aiohttp.ClientSession, engine: EngineSim, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    async with http.post(f"{engine.url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def saved_blocks(http: aiohttp.ClientSession, engine: EngineSim) -> float:
    return await metric(http, engine.url, "sim_store_saved_blocks_total")


class Frames:
    """Every KV-event frame an engine publishes, as (topic, seq, payload)."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)

    async def take(self, count: int, quiet_s: float = 0.5) -> list[tuple[str, int, bytes]]:
        """``count`` frames, then nothing more for ``quiet_s``; bounded."""
        frames = []
        deadline = time.monotonic() + 10
        while len(frames) < count and time.monotonic() < deadline:
            if await self.socket.poll(100):
                frames.append(await self.socket.recv_multipart())
        while await self.socket.poll(int(quiet_s * 1000)):
            frames.append(await self.socket.recv_multipart())
        return [(t.decode(), int.from_bytes(s, "big"), p) for t, s, p in frames]


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def events_endpoint(http: aiohttp.ClientSession, engine: EngineSim) -> str:
    async with http.get(f"{engine.url}/kv_event_sources") as response:
        sources = await response.json()
    return next(iter(sources.values()))["endpoint"] if isinstance(sources, dict) else ""


def decoded(payload: bytes) -> tuple[list[dict[str, Any]], int]:
    _, events, dp_rank = msgpack.unpackb(payload)
    return events, dp_rank


def comparable(event: dict[str, Any]) -> list[tuple[str, Any]]:
    """An event's fields in wire order, without the one vLLM 0.32 adds to GPU events."""
    return [(key, value) for key, value in event.items() if key != ONLY_IN_VLLM_032]


async def test_the_simulator_publishes_the_connectors_events(
    fresh_store, store_engines, http, zmq_context
) -> None:
    """The capture's three steps (A computes a prompt, B sends it, A sends it one block
    longer) through two simulated engines and a real store: the same cached tokens, the
    same frames (topic, sequence numbers, one GPU batch then one batch of cpu BlockStored
    per saved block, nothing for B's load), every event field by field, hashes included,
    and the store ends up holding exactly the keys the connector wrote.

    One field differs on purpose: vLLM 0.32's BlockPool adds ``kv_cache_spec_kind:
    "full_attention"`` to its GPU events, the simulator's (vLLM 0.33's, pinned in
    ``test_engine_block_manager``) does not; consumers ignore it (the conductor, the Go
    decoder). The GPU map's msgpack header also differs (0.33 declares more fields), which
    only the decoded comparison can see past. The connector's cpu events match in full."""
    engines = {name: store_engines(name, fresh_store) for name in ("store-a", "store-b")}
    frames = {}
    for name, engine in engines.items():
        frames[name] = Frames(zmq_context, await events_endpoint(http, engine))
    await asyncio.sleep(0.3)  # the subscriptions travel after the connect
    for step in CAPTURE["steps"]:
        answer = await complete(http, engines[step["engine"]], step["prompt_token_ids"])
        assert cached(answer) == step["cached_tokens"]
        for name, expected in step["frames"].items():
            got = await frames[name].take(len(expected))
            assert [(t, s) for t, s, _ in got] == [(f["topic"], f["seq"]) for f in expected]
            for (_, _, payload), frame in zip(got, expected, strict=True):
                events, dp_rank = decoded(payload)
                want, want_rank = decoded(base64.b64decode(frame["payload_b64"]))
                assert dp_rank == want_rank
                assert [comparable(e) for e in events] == [comparable(e) for e in want]
    b_hits = await metric(http, engines["store-b"].url, EXTERNAL_HITS)
    assert b_hits == CAPTURE["steps"][1]["cached_tokens"]

    async with http.get(f"{fresh_store.admin_url}/get_all_keys") as response:
        keys = set((await response.text()).split())
    assert keys == set(CAPTURE["master_admin"]["/get_all_keys"]["body"].split())


async def test_a_4k_prompt_saved_by_one_engine_loads_byte_identical_in_another(
    real_store, store_engines, http, tmp_path
) -> None:
    """A computes a 4,096-token prompt and saves its 128 blocks; before B has seen it, the
    conductor shows it on B's CPU tier (the store's pool); B then loads 127 blocks (all but
    the last token's) instead of computing them, each verified byte for byte, and reports
    them as cached and as external prefix-cache hits, with vLLM's store-operation metrics
    (what the router learns the store's bandwidth from). The test reads every block back."""
    from publishers.mooncake_store import KVBlockShape, KVBlockStore, kv_block

    conductor = ConductorProcess(
        tmp_path, config={"kv_store_admin_urls": {real_store.address.master: real_store.admin_url}}
    )
    conductor.wait_ready()
    try:
        register = ("--sim-register-with", conductor.url)
        a = store_engines("sim-a", real_store, *register)
        b = store_engines("sim-b", real_store, *register)
        await eventually(lambda: _connected(http, conductor), lambda n: n == 2, timeout=20)
        await asyncio.sleep(0.2)  # the subscriptions travel after the connect
        prompt = [(7919 * i + 13) % 50_000 + 100 for i in range(4096)]

        assert cached(await complete(http, a, prompt)) == 0
        hit = await eventually(
            lambda: _hit(http, conductor, "sim-b", prompt),
            lambda hit: hit.get("CPU") == 4096,
            timeout=20,
        )
        assert hit["GPU"] == 0  # B has computed nothing: the store's pool is its only hit

        answer = await complete(http, b, prompt)
        assert cached(answer) == 4064  # vLLM computes the last token: 127 of 128 blocks
        assert await metric(http, b.url, EXTERNAL_HITS) == 4064
        assert await metric(http, b.url, "sim_store_loaded_blocks_total") == 127
        assert await metric(http, b.url, "sim_store_mismatched_blocks_total") == 0
        assert await saved_blocks(http, b) == 0  # A had saved them all
        async with http.get(f"{b.url}/metrics") as response:
            loads = store_loads(await response.text())  # as the router reads vLLM's
        assert loads is not None and (loads.tokens, loads.bytes) == (4064, 127 * 32768)
        assert loads.seconds > 0
    finally:
        conductor.stop()

    shape = KVBlockShape(layers=2, kv_heads=2, block_size=BLOCK, head_dim=32)
    assert shape.nbytes == 32 << 10  # the tiny model's block, as vLLM stores it
    digests = BlockHasher("sha256", "0").block_digests(prompt, BLOCK)
    client = KVBlockStore(real_store.address, CAPTURE["model_path_basename"])
    try:
        blocks = client.get(digests, shape)
    finally:
        client.close()
    assert len(blocks) == 128
    assert all(block is not None and block.equal(kv_block(shape, d))
               for block, d in zip(blocks, digests, strict=True))  # fmt: skip


async def _connected(http: aiohttp.ClientSession, conductor: ConductorProcess) -> int:
    async with http.get(f"{conductor.url}/services") as response:
        services = (await response.json())["services"]
    return sum(1 for service in services if service["State"] == "connected")


async def _hit(
    http: aiohttp.ClientSession, conductor: ConductorProcess, instance: str, tokens: list[int]
) -> dict[str, int]:
    body = {"model": MODEL, "block_size": BLOCK, "token_ids": tokens, "instance_id": instance}
    async with http.post(f"{conductor.url}/query", json=body) as response:
        answer = await response.json()
    return answer.get("default", {}).get(instance, {})


async def test_a_dead_master_costs_recomputation_until_it_returns(
    fresh_store, store_engines, http
) -> None:
    """Master killed: the engine keeps answering by computing, saves and announces nothing,
    says so once in its log; the master back on the same ports (an empty store): the
    engine saves again and another engine loads what it saved."""
    a = store_engines("sim-a", fresh_store)
    b = store_engines("sim-b", fresh_store)
    prompts = [[(31 * i + 7 * p) % 40_000 + 100 for i in range(640)] for p in range(12)]
    await complete(http, a, prompts[0])
    await eventually(lambda: saved_blocks(http, a), lambda saved: saved == 20)

    fresh_store.kill_master()
    for prompt in prompts[1:4]:
        assert cached(await complete(http, a, prompt)) == 0
    assert cached(await complete(http, b, prompts[0])) == 0  # the store cannot be asked
    assert await saved_blocks(http, a) == 20
    assert await metric(http, a.url, "sim_store_up") == 0
    assert await metric(http, a.url, "sim_store_unavailable_calls_total") >= 3
    assert a.log().count("store unreachable") == 1

    fresh_store.start_master()
    await eventually(lambda: metric(http, a.url, "sim_store_up"), lambda up: up == 1, 15)
    for prompt in prompts[4:]:  # the store process remounts its memory in a moment
        await complete(http, a, prompt)
        await asyncio.sleep(1.0)
        if await saved_blocks(http, a) > 20:
            break
    assert await saved_blocks(http, a) == 40, "nothing saved once the master was back"
    assert cached(await complete(http, b, prompt)) == 608  # 19 of 20 blocks, from the store


async def test_a_block_with_the_wrong_bytes_is_recomputed_from_there_on(
    real_store, store_engines, http
) -> None:
    """Blocks put under the connector's keys by someone else, the fourth with other bytes:
    the engine loads the three before it, counts and logs the bad one, computes the rest."""
    from publishers.mooncake_store import KVBlockShape, KVBlockStore, kv_block

    prompt = [(13 * i + 5) % 30_000 + 100 for i in range(257)]  # 8 full blocks
    digests = BlockHasher("sha256", "0").block_digests(prompt, BLOCK)
    shape = KVBlockShape(layers=2, kv_heads=2, block_size=BLOCK, head_dim=32)
    blocks = [kv_block(shape, digest) for digest in digests]
    blocks[3] = kv_block(shape, digests[4])
    client = KVBlockStore(real_store.address, CAPTURE["model_path_basename"])
    try:
        client.put(digests, blocks)
    finally:
        client.close()

    engine = store_engines("sim-c", real_store)
    assert cached(await complete(http, engine, prompt)) == 3 * BLOCK
    assert await metric(http, engine.url, "sim_store_mismatched_blocks_total") == 1
    assert await metric(http, engine.url, "sim_store_loaded_blocks_total") == 3
    assert "store block mismatch" in engine.log()
