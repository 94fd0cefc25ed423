"""The conductor's store tier against a real Mooncake store: what the store evicts (without
any event) or loses (its master killed or restarted) leaves ``/query`` within the bound
docs/kv-store.md states: one check interval plus one check's duration.

Blocks are put by a real store client under vLLM MooncakeStoreConnector keys and each put
is announced as the connector does (one cpu ``BlockStored``) by a real ZMQ publisher
registered with the store's master as ``kv_store``; engine B, registered with the same
store, computed nothing, so every CPU hit it gets is the store's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.api import eventually, get, metric, query, register_and_connect
from tests.support.processes import ConductorProcess
from tests.support.wire_publisher import WirePublisher, stored

pytestmark = pytest.mark.needs("store")

BLOCK = 4  # tokens per block: the conductor's block size in these tests
INTERVAL_S = 0.5
CHECK_ALLOWANCE_S = 0.5  # one check (ms here) plus this test's polling, on 2 busy cores
BOUND_S = INTERVAL_S + CHECK_ALLOWANCE_S
MODEL_KEY_NAME = "tiny-model0"  # the model part of keys: the basename of the model path


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def start_store(run_dir: Path, segment_mib: int) -> Any:
    from publishers.mooncake_store import MIB, LocalStore

    store = LocalStore(run_dir, segment_mib * MIB)
    store.start()
    return store


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[Any]:
    """16 MiB: about 220 blocks of 64 KiB fit."""
    store = start_store(tmp_path, 16)
    yield store
    store.stop()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Any]:
    """A store of the test's own, whose master the test may kill and restart."""
    store = start_store(tmp_path, 64)
    yield store
    store.stop()


def conductor_for(tmp_path: Path, store: Any, interval: float = INTERVAL_S) -> ConductorProcess:
    conductor = ConductorProcess(
        tmp_path,
        config={
            "kv_store_admin_urls": {store.address.master: store.admin_url},
            "kv_store_check_interval_s": interval,
        },
    )
    conductor.wait_ready()
    return conductor


def digest(block: int) -> bytes:
    return hashlib.sha256(f"block {block}".encode()).digest()


def tokens(block: int) -> list[int]:
    return list(range(block * BLOCK + 1, (block + 1) * BLOCK + 1))


class Saver:
    """Engine A's side: put a block in the store, then announce it like the connector."""

    def __init__(self, store: Any, publisher: WirePublisher) -> None:
        from publishers.mooncake_store import KVBlockShape, KVBlockStore

        self.shape = KVBlockShape(layers=2, kv_heads=8, block_size=BLOCK, head_dim=128)  # 64 KiB
        self.client = KVBlockStore(store.address, MODEL_KEY_NAME)
        self.publisher = publisher
        self.put_started: dict[int, float] = {}

    def key(self, block: int) -> str:
        return self.client.keys([digest(block)])[0]

    def event_hash(self, block: int) -> int:
        from conductor.vllm_hash import low64_be

        return low64_be(digest(block))

    async def save(self, block: int, attempts: int = 20, pause: float = 0.05) -> bool:
        """True once the store took the block and it was announced; a full store evicts
        to make room after a failed put, so a few attempts are made."""
        from publishers.mooncake_store import StoreError, kv_block

        data = kv_block(self.shape, digest(block))
        for _ in range(attempts):
            self.put_started.setdefault(block, time.monotonic())
            try:
                await asyncio.to_thread(self.client.put, [digest(block)], [data])
            except StoreError:
                await asyncio.sleep(pause)
                continue
            event = stored([self.event_hash(block)], tokens(block), medium="cpu", block_size=BLOCK)
            await self.publisher.publish([event])
            return True
        return False

    def close(self) -> None:
        self.client.close()


@pytest.fixture
async def engines(http, publisher_factory) -> AsyncIterator[Any]:
    """Registers engine A (the saver) and B with a conductor and a store, on demand."""
    savers: list[Saver] = []

    async def register(conductor: ConductorProcess, store: Any) -> Saver:
        a, b = publisher_factory(), publisher_factory()
        master = store.address.master
        await register_and_connect(http, conductor.url, a, "engine-a", kv_store=master)
        await register_and_connect(http, conductor.url, b, "engine-b", kv_store=master)
        savers.append(Saver(store, a))
        return savers[-1]

    yield register
    for saver in savers:
        saver.close()


async def cpu_hit_of_b(http: aiohttp.ClientSession, base: str, block: int) -> int:
    answer = await query(http, base, tokens(block))
    return answer["default"]["engine-b"]["CPU"]


async def store_keys(http: aiohttp.ClientSession, store: Any) -> set[str]:
    async with http.get(f"{store.admin_url}/get_all_keys") as response:
        assert response.status == 200
        return set((await response.text()).split())


async def admin_keys(http: aiohttp.ClientSession, store: Any) -> set[str] | None:
    """The master's keys; None while its admin server does not listen yet."""
    try:
        return await store_keys(http, store)
    except aiohttp.ClientConnectorError:
        return None


async def in_store(http: aiohttp.ClientSession, store: Any, keys: list[str]) -> dict[str, bool]:
    """The master's own answer per key (``/batch_query_keys``, 20 keys a request)."""
    found = {}
    for start in range(0, len(keys), 20):
        batch = keys[start : start + 20]
        url = f"{store.admin_url}/batch_query_keys"
        async with http.get(url, params={"keys": ",".join(batch)}) as response:
            body = json.loads(await response.text())
        assert body["success"], body
        found.update({key: body["data"][key]["ok"] for key in batch})
    return found


async def store_state(http: aiohttp.ClientSession, base: str, master: str) -> dict:
    health = (await get(http, f"{base}/health"))[1]
    return {"status": health["status"], **health["kv_stores"][master]}


class Timeline:
    """When each key was last listed by the master and each engine hash last indexed,
    polled every 50 ms: a block evicted after the master last listed it (or after its put
    began) and gone from the index by the first poll that missed it was stale at most the
    difference."""

    def __init__(self, http: aiohttp.ClientSession, store: Any, base: str) -> None:
        self.http, self.store, self.base = http, store, base
        self.listed: dict[str, float] = {}  # key -> when the last request listing it was sent
        self.indexed: dict[int, float] = {}  # engine hash -> when last seen in the index
        self.polls: list[float] = []  # when each index poll's answer came back
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        while True:
            sent = time.monotonic()
            for key in await store_keys(self.http, self.store):
                self.listed[key] = sent
            _, view = await get(self.http, f"{self.base}/global_view?hashes=10000")
            seen = time.monotonic()
            for entry in view["hashmap"]:
                self.indexed[int(next(iter(entry)))] = seen
            self.polls.append(seen)
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def staleness(self, key: str, event_hash: int, put_started: float) -> float:
        evicted_after = max(self.listed.get(key, put_started), put_started)
        last_indexed = self.indexed.get(event_hash, evicted_after)
        gone = min(t for t in self.polls if t > last_indexed)
        return gone - evicted_after


async def test_blocks_a_full_store_evicts_leave_the_index_within_the_bound(
    small_store, tmp_path, http, engines
):
    conductor = conductor_for(tmp_path, small_store)
    base = conductor.url
    try:
        saver = await engines(conductor, small_store)
        timeline = Timeline(http, small_store, base)
        timeline.start()
        saved = [block for block in range(660) if await saver.save(block)]
        await asyncio.sleep(2 * BOUND_S)  # the store settles; the last checks run
        await timeline.stop()

        keys = {block: saver.key(block) for block in saved}
        present = await store_keys(http, small_store)
        evicted = [block for block in saved if keys[block] not in present]
        kept = [block for block in saved if keys[block] in present]
        assert len(saved) > 600 and len(evicted) > 300 and len(kept) > 150, (
            len(saved),
            len(evicted),
        )
        answers = await in_store(http, small_store, [keys[b] for b in evicted[:40] + kept[:40]])
        assert [answers[keys[b]] for b in evicted[:40]] == [False] * 40  # OBJECT_NOT_FOUND
        assert [answers[keys[b]] for b in kept[:40]] == [True] * 40

        hits = {block: await cpu_hit_of_b(http, base, block) for block in saved}
        assert [b for b in evicted if hits[b]] == []  # no stale hit is left
        assert [b for b in kept if hits[b] != BLOCK] == []  # and nothing present is lost
        staleness = [
            timeline.staleness(keys[b], saver.event_hash(b), saver.put_started[b]) for b in evicted
        ]
        print(
            f"store full: {len(saved)} blocks saved, {len(evicted)} evicted; staleness max "
            f"{max(staleness):.3f} s, median {sorted(staleness)[len(staleness) // 2]:.3f} s "
            f"(bound {BOUND_S} s at interval {INTERVAL_S} s)"
        )
        assert max(staleness) <= BOUND_S
        assert await metric(http, base, "conductor_kv_store_blocks_dropped_total") == len(evicted)
        assert (await store_state(http, base, small_store.address.master))["state"] == "up"
    finally:
        conductor.stop()


async def test_a_killed_master_clears_the_store_tier_until_it_returns(
    store, tmp_path, http, engines
):
    master = store.address.master
    conductor = conductor_for(tmp_path, store)
    base = conductor.url
    try:
        saver = await engines(conductor, store)
        assert all([await saver.save(block) for block in range(8)])
        await eventually(lambda: cpu_hit_of_b(http, base, 7), lambda cpu: cpu == BLOCK)

        store.kill_master()
        killed = time.monotonic()
        state = await eventually(
            lambda: store_state(http, base, master),
            lambda s: s["state"] == "down",
            timeout=BOUND_S + 2,
            interval=0.02,
        )
        noticed = time.monotonic() - killed
        assert state["status"] == "degraded" and state["blocks"] == 0
        assert [await cpu_hit_of_b(http, base, block) for block in range(8)] == [0] * 8
        print(f"master killed: store down in the index after {noticed:.3f} s")
        assert noticed <= BOUND_S
        event = stored([saver.event_hash(99)], tokens(99), medium="cpu", block_size=BLOCK)
        await saver.publisher.publish([event])  # announced while down: dropped, counted
        await eventually(
            lambda: metric(http, base, "conductor_dropped_events_total"), lambda n: n == 1
        )

        store.start_master()  # same ports, an empty store
        state = await eventually(
            lambda: store_state(http, base, master),
            lambda s: s["state"] == "up",
            timeout=BOUND_S + 5,
        )
        assert state["status"] == "ok"
        assert await saver.save(8, attempts=200, pause=0.1)  # the store process re-mounts
        await eventually(lambda: cpu_hit_of_b(http, base, 8), lambda cpu: cpu == BLOCK)
        await asyncio.sleep(2 * INTERVAL_S)  # checks of the new master keep it
        assert await cpu_hit_of_b(http, base, 8) == BLOCK
        assert [await cpu_hit_of_b(http, base, block) for block in range(8)] == [0] * 8
    finally:
        conductor.stop()


async def test_a_master_restarted_between_two_checks_is_reconciled_empty(
    store, tmp_path, http, engines
):
    """No check failed, but the master came back empty: the next check finds none of the
    blocks and drops them all, as evicted."""
    interval = 4.0
    conductor = conductor_for(tmp_path, store, interval=interval)
    base = conductor.url
    try:
        saver = await engines(conductor, store)
        assert all([await saver.save(block) for block in range(6)])
        await eventually(lambda: cpu_hit_of_b(http, base, 5), lambda cpu: cpu == BLOCK)
        checks = await metric(http, base, "conductor_kv_store_checks_total")
        await eventually(
            lambda: metric(http, base, "conductor_kv_store_checks_total"),
            lambda n: n > checks,
            timeout=interval + 2,
            interval=0.02,
        )
        restarted = time.monotonic()
        store.kill_master()
        store.start_master()
        assert await eventually(lambda: admin_keys(http, store), lambda k: k is not None) == set()
        assert time.monotonic() - restarted < interval / 2, "restart too slow for this test"
        await eventually(
            lambda: cpu_hit_of_b(http, base, 0), lambda cpu: cpu == 0, timeout=interval + 2
        )
        assert [await cpu_hit_of_b(http, base, block) for block in range(6)] == [0] * 6
        text = await (await http.get(f"{base}/metrics")).text()
        assert 'outcome="ok"' in text and 'outcome="unreachable"' not in text
        assert await metric(http, base, "conductor_kv_store_blocks_dropped_total") == 6
        assert (await store_state(http, base, store.address.master))["state"] == "up"
    finally:
        conductor.stop()
