"""Event streams under faults: churn, socket limits, hostile replays, unbounded publishers,
dead engines. Real ZMQ sockets on 127.0.0.1, a real ServiceManager or conductor process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from conductor.api import ApiOptions, HttpLimits, api_app
from conductor.config import Registration
from conductor.index import ContextKey, PrefixCacheTable
from conductor.kv_store_watch import StoreWatch
from conductor.manager import CapacityExceeded, ServiceManager
from conductor.metrics import ConductorMetrics
from conductor.security import BearerAuth, EndpointAllowlist
from conductor.states import SubscriberState
from conductor.stream_limits import StreamLimits
from conductor.wire.events import AllBlocksCleared, BlockStored, EventBatch
from publishers.local import free_port
from publishers.publisher import KVEventPublisher
from tests.conftest import REPO
from tests.support.api import eventually, get, post, registration
from tests.support.wire_publisher import END_MARKER, WirePublisher, stored

CONTEXT = ContextKey("default", "m", "", 4)


@pytest.fixture
async def manager_factory() -> AsyncIterator[Callable[..., ServiceManager]]:
    managers: list[ServiceManager] = []

    def create(**limits: Any) -> ServiceManager:
        table = PrefixCacheTable()
        metrics = ConductorMetrics(table)
        stores = StoreWatch(table, metrics, lambda _: "http://127.0.0.1:9", 2.0)
        manager = ServiceManager(table, metrics, stores, StreamLimits(**limits))
        managers.append(manager)
        return manager

    yield create
    for manager in managers:
        await manager.close()


def matched(manager: ServiceManager, tokens: list[int], instance_id: str) -> int:
    matches = manager.table.match_tokens(CONTEXT, tokens) or {}
    return matches[instance_id].gpu if instance_id in matches else 0


def counted(manager: ServiceManager, name: str, **labels: str) -> float:
    return manager.metrics.sample(name, labels) or 0.0


async def until(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    """Poll a synchronous check until it holds (bounded)."""

    async def probe() -> Any:
        return check()

    return await eventually(probe, bool, timeout=timeout, interval=0.02)


async def register(manager: ServiceManager, publisher: WirePublisher, name: str, **fields) -> str:
    body = Registration.model_validate(registration(publisher, name, **fields))
    await manager.register(body)
    await until(lambda: manager.state_of(body.key) == "connected")
    await asyncio.sleep(0.1)  # the subscription travels after the TCP connect
    return body.key


# -- 1. churn ---------------------------------------------------------------------------
def publish_until(publishers: list[KVEventPublisher], stop: threading.Event) -> None:
    block = 0
    while not stop.is_set():
        for publisher in publishers:
            publisher.publish([BlockStored([block], None, [1, 2, 3, 4])])
        block += 1
        time.sleep(0.002)


async def test_register_unregister_churn_never_deadlocks(conductor, http):
    """/unregister raced catch-up replays: a cancellation lost in ``wait_for`` left the
    reader waiting forever and /unregister with it (then SIGTERM hung in context.term)."""
    publishers = [
        KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True) for _ in range(4)
    ]
    bodies = [
        {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint, "instance_id": f"e{n}"}
        for n, p in enumerate(publishers)
    ] + [  # nobody listens: their connections are retried, which the monitors report
        {"endpoint": f"tcp://127.0.0.1:{free_port()}", "instance_id": f"dead{n}"} for n in range(2)
    ]
    stop = threading.Event()
    feeder = threading.Thread(target=publish_until, args=(publishers, stop), daemon=True)
    feeder.start()
    deadline = time.monotonic() + 4.0
    timeout = aiohttp.ClientTimeout(total=3)

    async def churn(body: dict[str, Any]) -> int:
        cycles = 0
        full = {"type": "vLLM", "modelname": "m", "block_size": 4, **body}
        while time.monotonic() < deadline:
            async with http.post(f"{conductor.url}/register", json=full, timeout=timeout) as r:
                assert r.status == 200, await r.text()
            await asyncio.sleep(random.random() * 0.03)
            unregister = {"instance_id": body["instance_id"]}
            async with http.post(f"{conductor.url}/unregister", json=unregister, timeout=timeout):
                cycles += 1
        return cycles

    async def queries() -> None:
        query = {"model": "m", "block_size": 4, "token_ids": [1, 2, 3, 4]}
        while time.monotonic() < deadline:
            async with http.post(f"{conductor.url}/query", json=query, timeout=timeout) as r:
                assert r.status == 200

    try:
        cycles = await asyncio.gather(*(churn(body) for body in bodies), queries())
    finally:
        stop.set()
        feeder.join(2)
        for publisher in publishers:
            publisher.close()
    assert sum(cycles[:-1]) > 20, cycles
    status, health = await get(http, f"{conductor.url}/health")
    assert status == 200 and health["services"] == 0
    assert conductor.stop() < 2.0 and conductor.process.returncode == 0, conductor.log()


# -- 2. supervision at the socket limit -----------------------------------------------------
class ReplayEndpoint:
    """A ROUTER the test answers by hand: silent, garbage, the batches it is given, or
    (``endless``) the first of them over and over."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:0")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.batches: list[tuple[int, bytes]] = []
        self.mode = "silent"
        self.requests = 0
        self._task = asyncio.create_task(self._serve())

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.socket.close(0)

    async def _serve(self) -> None:
        while True:
            identity, _, start = await self.socket.recv_multipart()
            self.requests += 1
            if self.mode in ("garbage", "endless"):  # never an end marker
                seq, payload = self.batches[0] if self.batches else (0, b"")
                reply = [b"", b"", seq.to_bytes(8, "big"), payload]
                while True:
                    junk_or_batch = [b"junk"] if self.mode == "garbage" else reply
                    await self.socket.send_multipart([identity, *junk_or_batch])
                    await asyncio.sleep(0.001)
            if self.mode == "answer":
                for seq, payload in self.batches:
                    if seq >= int.from_bytes(start, "big"):
                        frames = [identity, b"", b"", seq.to_bytes(8, "big"), payload]
                        await self.socket.send_multipart(frames)
                await self.socket.send_multipart([identity, b"", b"", END_MARKER, b""])


@pytest.fixture
async def replay_endpoint(zmq_context) -> AsyncIterator[ReplayEndpoint]:
    endpoint = ReplayEndpoint(zmq_context)
    yield endpoint
    await endpoint.close()


def hold_sockets(context: zmq.asyncio.Context, count: int) -> list[zmq.asyncio.Socket]:
    """Take ``count`` sockets of the context (retrying while closed ones are reaped)."""
    held: list[zmq.asyncio.Socket] = []
    deadline = time.monotonic() + 2
    while len(held) < count:
        try:
            held.append(context.socket(zmq.PAIR))
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the context never freed a socket"
            time.sleep(0.01)
    return held


async def test_reader_survives_a_replay_without_sockets_and_catch_up_is_supervised(
    manager_factory, publisher_factory, replay_endpoint
):
    """At the socket limit a replay cannot open its DEALER: the live reader goes on (it
    died before, the stream still saying "connected"); a catch-up fails visibly ("failed",
    counted, last_error) and is retried with backoff until a socket is free again."""
    manager = manager_factory(max_sockets=4, replay_timeout_s=0.3)
    publisher = publisher_factory(with_replay=False)
    key = await register(manager, publisher, "a", replay_endpoint=replay_endpoint.endpoint)
    # the catch-up's replay goes unanswered: it times out and closes its DEALER
    await until(lambda: counted(manager, "conductor_replays_failed_total", stream=key) == 1)
    held = hold_sockets(manager.context, 1)  # the context is full again

    await manager.instance_down("a")
    await manager.instance_up("a")  # a catch-up that cannot open its DEALER
    await until(lambda: manager.state_of(key) == "failed")
    view = manager.stream_view(key)
    assert view["failures"] >= 1 and "Too many open files" in view["last_error"], view
    assert counted(manager, "conductor_stream_task_failures_total", task="catch-up") >= 1
    health = await health_of(manager)
    assert health["status"] == "degraded" and health["streams"][key]["state"] == "failed"

    await publisher.publish([stored([1], [1, 2, 3, 4])], send=False)
    await publisher.publish([stored([2], [5, 6, 7, 8], parent=1)])  # a gap: its replay fails
    unrepaired = "conductor_sequence_gaps_unrepaired_total"
    await until(lambda: counted(manager, unrepaired, stream=key) == 1)
    assert matched(manager, list(range(1, 9)), "a") == 0
    await publisher.publish([stored([3], [9, 10, 11, 12])])  # the reader still reads
    await until(lambda: matched(manager, [9, 10, 11, 12], "a") == 4)

    replay_endpoint.batches = list(publisher.buffer)
    replay_endpoint.mode = "answer"
    held[0].close(0)
    await until(lambda: manager.state_of(key) == "connected")  # the retry got its socket
    await publisher.publish([stored([5], [13, 14, 15, 16])], send=False)
    replay_endpoint.batches = list(publisher.buffer)
    await publisher.publish([stored([6], [17, 18, 19, 20], parent=5)])  # repaired by replay
    await until(lambda: matched(manager, [13, 14, 15, 16, 17, 18, 19, 20], "a") == 8)


async def health_of(manager: ServiceManager) -> dict[str, Any]:
    """The manager's ``/health`` as the service's routes answer it (in process)."""
    options = ApiOptions(HttpLimits(), BearerAuth(""), EndpointAllowlist(allow_all=True))
    async with TestClient(TestServer(api_app(manager, options))) as client:
        response = await client.get("/health")
        return await response.json()


# -- 3. capacity ----------------------------------------------------------------------------
async def test_capacity_exceeded_is_clear_and_breaks_no_stream(manager_factory, publisher_factory):
    manager = manager_factory(max_sockets=8)
    first, second, third = (publisher_factory() for _ in range(3))
    await register(manager, first, "a")
    await register(manager, second, "b")
    with pytest.raises(CapacityExceeded, match=r"2 registrations use 8 of the 8 ZMQ sockets"):
        await manager.register(Registration.model_validate(registration(third, "c")))
    assert sorted(manager.registrations) == ["a|default|0", "b|default|0"]
    await first.publish([stored([1], [1, 2, 3, 4])])
    await until(lambda: matched(manager, [1, 2, 3, 4], "a") == 4)

    starved = manager_factory(reserved_fds=manager.fd_limit)
    with pytest.raises(CapacityExceeded, match="RLIMIT_NOFILE"):
        await starved.register(Registration.model_validate(registration(third, "c")))
    assert starved.registrations == {}


# -- 4. replay deadline ---------------------------------------------------------------------
async def test_an_endless_replay_ends_at_its_deadline(
    manager_factory, publisher_factory, replay_endpoint
):
    """Each reply came within the per-reply timeout, so the replay never ended and the
    stream stayed "replaying" while its live batches queued."""
    replay_endpoint.mode = "endless"
    replay_endpoint.batches = [(0, msgpack.packb([time.time(), [stored([9], [9, 9, 9, 9])]]))]
    manager = manager_factory(replay_timeout_s=1.0, replay_deadline_s=0.5)
    publisher = publisher_factory(with_replay=False)
    body = registration(publisher, "a", replay_endpoint=replay_endpoint.endpoint)
    key = Registration.model_validate(body).key
    await manager.register(Registration.model_validate(body))
    await until(lambda: replay_endpoint.requests == 1)
    await until(lambda: counted(manager, "conductor_replays_failed_total", stream=key) == 1, 3)
    assert counted(manager, "conductor_decode_errors_total", stream=key, kind="frame") == 0
    await until(lambda: manager.state_of(key) == "connected")
    await publisher.publish([stored([1], [1, 2, 3, 4])])  # seq 0: the replay delivered it
    await publisher.publish([stored([2], [5, 6, 7, 8])])
    await until(lambda: matched(manager, [5, 6, 7, 8], "a") == 4)


async def test_a_replay_answering_garbage_gives_up_after_a_few_replies(
    manager_factory, publisher_factory, replay_endpoint, caplog
):
    """A new stream's catch-up held its first live batch for the whole replay deadline
    (30 s) while the endpoint answered junk; three undecodable replies in a row end it."""
    replay_endpoint.mode = "garbage"
    manager = manager_factory()  # the default deadline: 30 s
    publisher = publisher_factory(with_replay=False)
    body = registration(publisher, "a", replay_endpoint=replay_endpoint.endpoint)
    key = Registration.model_validate(body).key
    await manager.register(Registration.model_validate(body))
    await until(lambda: manager.state_of(key) in ("connected", "replaying"))
    await asyncio.sleep(0.1)  # the subscription travels after the TCP connect
    started = time.monotonic()
    await publisher.publish([stored([1], [1, 2, 3, 4])])
    await until(lambda: matched(manager, [1, 2, 3, 4], "a") == 4, timeout=3)
    assert time.monotonic() - started < 2.0
    assert counted(manager, "conductor_replays_failed_total", stream=key) == 1
    assert counted(manager, "conductor_decode_errors_total", stream=key, kind="frame") == 3
    lines = [record.getMessage() for record in caplog.records]
    failure = next(line for line in lines if "replay from 0 failed" in line)
    assert "3 undecodable replies in a row (last: malformed replay reply of 1 frames)" in failure


# -- 5. cardinality -------------------------------------------------------------------------
async def test_dp_ranks_and_lora_contexts_are_capped_and_counted(
    manager_factory, publisher_factory, caplog
):
    manager = manager_factory(max_dp_ranks=2, max_lora_contexts=2)
    publisher = publisher_factory()
    key = await register(manager, publisher, "a")
    for rank in range(5):  # a new rank per batch
        await publisher.publish([stored([10 + rank], [1, 2, 3, 4])], dp_rank=rank)
    for lora in ("x", "y", "z"):  # a new LoRA per batch
        await publisher.publish([stored([20], [1, 2, 3, 4], lora_name=lora)])
    dropped = "conductor_dropped_events_total"
    await until(lambda: counted(manager, dropped, stream=key, reason="lora_limit") == 2)
    assert counted(manager, dropped, stream=key, reason="dp_rank_limit") == 3
    views = manager.table.context_views()
    assert [view.key for view in views] == [CONTEXT, dataclasses.replace(CONTEXT, lora_name="x")]
    assert views[0].instances == {"a": (0, 1)}
    warnings = [r.message for r in caplog.records if "drops events beyond" in r.message]
    assert len(warnings) == 2  # once per stream and reason


def test_clearing_many_ranks_is_linear():
    """Each rank's clear walked every slot of the stream: 4,000 ranks took O(N^2) (16 M
    slot visits, tens of seconds); now each clear visits its rank's slots only."""
    ranks = 4_000
    table = PrefixCacheTable(max_dp_ranks=ranks)
    table.add_stream(
        Registration.model_validate(
            {"endpoint": "tcp://127.0.0.1:1", "type": "vLLM", "modelname": "m", "block_size": 4}
        ).source()
    )
    key = "tcp://127.0.0.1:1|default|0"
    for rank in range(ranks):
        table.apply(key, EventBatch(0.0, [BlockStored([rank], None, [1, 2, 3, 4])], rank))
    assert table.context_views()[0].instances == {"tcp://127.0.0.1:1": tuple(range(ranks))}
    started = time.process_time()
    for rank in range(ranks):
        table.apply(key, EventBatch(0.0, [AllBlocksCleared()], rank))
    assert time.process_time() - started < 2.0  # linear: far below; quadratic: far above
    assert table.block_count() == 0


# -- 6. dead engines ------------------------------------------------------------------------
async def test_instance_down_drops_blocks_and_events_until_up_replays_them(
    manager_factory, publisher_factory
):
    manager = manager_factory()
    publisher = publisher_factory()
    key = await register(manager, publisher, "a")
    await publisher.publish([stored([1], [1, 2, 3, 4])])
    await until(lambda: matched(manager, [1, 2, 3, 4], "a") == 4)

    streams, dropped = await manager.instance_down("a", reason="connection refused", ttl_s=60)
    assert (streams, dropped) == ([key], 1)
    assert matched(manager, [1, 2, 3, 4], "a") == 0
    view = manager.stream_view(key)
    assert view["state"] == "down" and view["down_reason"] == "connection refused"
    await publisher.publish([stored([2], [5, 6, 7, 8], parent=1)])
    dropped_events = "conductor_dropped_events_total"
    await until(lambda: counted(manager, dropped_events, stream=key, reason="instance_down") == 1)
    assert matched(manager, list(range(1, 9)), "a") == 0

    assert await manager.instance_up("a") == [key]  # the replay buffer, with no new batch
    await until(lambda: matched(manager, list(range(1, 9)), "a") == 8)
    assert manager.state_of(key) == "connected" and "down_until" not in manager.stream_view(key)

    await manager.instance_down("a", ttl_s=0.3)  # not renewed: it expires like an up
    assert matched(manager, [1, 2, 3, 4], "a") == 0
    await until(lambda: matched(manager, list(range(1, 9)), "a") == 8)

    with pytest.raises(KeyError):
        await manager.instance_down("nobody")


async def test_instance_routes_answer_as_agreed(served, http, publisher_factory):
    from tests.support.api import register_and_connect

    await register_and_connect(http, served.url, publisher_factory(), "a")
    status, body = await post(http, f"{served.url}/instance_down", {"instance_id": "a"})
    assert (status, body) == (
        200,
        {
            "instance_id": "a",
            "streams": ["a|default|0"],
            "blocks_dropped": 0,
            "status": "marked down",
        },
    )
    _, services = await get(http, f"{served.url}/services")
    assert services["services"][0]["State"] == "down"
    status, body = await post(http, f"{served.url}/instance_up", {"instance_id": "a"})
    assert (status, body) == (
        200,
        {"instance_id": "a", "streams": ["a|default|0"], "status": "marked up"},
    )
    status, body = await post(http, f"{served.url}/instance_down", {"instance_id": "zz"})
    assert (status, body) == (404, {"error": "instance not found: zz", "field": "instance_id"})
    status, _ = await post(http, f"{served.url}/instance_down", {"instance_id": "a", "ttl_s": 0})
    assert status == 400


PUBLISHER_SCRIPT = """
import sys, time
from conductor.wire.events import BlockStored
from publishers.publisher import KVEventPublisher
publisher = KVEventPublisher(sys.argv[1], sys.argv[2], bind=True)
publisher.publish([BlockStored([1], None, [1, 2, 3, 4])])
print("ready", flush=True)
time.sleep(60)
"""


async def test_killed_publisher_leaves_the_index_within_its_timeout(manager_factory):
    manager = manager_factory(publisher_timeout_s=1.0)
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    process = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER_SCRIPT, endpoint, replay],
        cwd=REPO,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        body = {
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "type": "vLLM",
            "modelname": "m",
            "instance_id": "a",
            "block_size": 4,
        }
        await manager.register(Registration.model_validate(body))
        await until(lambda: matched(manager, [1, 2, 3, 4], "a") == 4)  # by the catch-up
        process.send_signal(signal.SIGKILL)
        # bound: publisher_timeout_s + one heartbeat interval (a killed process is faster)
        await until(lambda: matched(manager, [1, 2, 3, 4], "a") == 0, timeout=2.5)
    finally:
        process.kill()
        process.wait(5)


async def test_a_busy_conductor_keeps_a_healthy_publisher(manager_factory):
    """A stream whose receive queue is full is not taken for a dead publisher: with ZMTP
    heartbeats libzmq stopped reading the full connection, missed the publisher's replies
    and dropped it (clearing its blocks) exactly when the conductor fell behind."""
    manager = manager_factory(publisher_timeout_s=1.0, receive_buffer_bytes=4 * 1024 * 1024)
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True)
    try:
        body = {
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "type": "vLLM",
            "modelname": "m",
            "instance_id": "busy",
            "block_size": 4,
        }
        registered = Registration.model_validate(body)
        await manager.register(registered)
        await until(lambda: manager.state_of(registered.key) == "connected")
        await asyncio.sleep(0.1)  # the subscription travels after the TCP connect
        batches = 200  # far more than the one message the receive queue holds here
        for n in range(batches):
            publisher.publish([BlockStored([n + 1], None, [n, n, n, n])])
        assert publisher.flush()
        time.sleep(2.5)  # the event loop is busy for 2.5 publisher timeouts: nothing is read
        await until(lambda: matched(manager, [batches - 1] * 4, "busy") == 4, timeout=10)
        assert all(matched(manager, [n] * 4, "busy") == 4 for n in range(batches))
        assert counted(manager, "conductor_publisher_disconnects_total", stream=registered.key) == 0
    finally:
        publisher.close()


async def test_a_large_batch_is_applied_in_steps_that_let_queries_in(manager_factory):
    """A batch of hundreds of blocks is applied in steps of about ``loop_share.step_s``
    (here the smallest: 4 events), with a loop round between two steps, so a query waits
    for one step, not the whole batch; the batch is still applied whole and counted once."""
    manager = manager_factory()
    manager.loop_share.step_s = 0.0
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True)
    try:
        registered = Registration.model_validate(
            {
                "endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
                "type": "vLLM",
                "modelname": "m",
                "instance_id": "big",
                "block_size": 4,
            }
        )
        await manager.register(registered)
        await until(lambda: manager.state_of(registered.key) == "connected")
        await asyncio.sleep(0.1)  # the subscription travels after the TCP connect
        seen: set[int] = set()

        async def watch() -> None:  # what a query running meanwhile would see
            while True:
                seen.add(manager.table.block_count())
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        publisher.publish([BlockStored([n + 1], None, [n] * 4) for n in range(40)])
        await until(lambda: manager.table.block_count() == 40)
        watcher.cancel()
        assert {4, 8, 36} <= seen, sorted(seen)  # one step of 4 events per round
        assert all(matched(manager, [n] * 4, "big") == 4 for n in range(40))
        key = registered.key
        assert counted(manager, "conductor_batches_applied_total", stream=key) == 1
        assert counted(manager, "conductor_events_applied_total", stream=key) == 40
    finally:
        publisher.close()


def test_subscriber_state_is_one_series_per_stream():
    """A scrape renders every series while the loop waits: a stream's state is one series
    (1 on its current state), gone when the stream is."""
    metrics = ConductorMetrics(PrefixCacheTable())
    value = metrics.sample
    metrics.set_subscriber_state("s", SubscriberState.CONNECTING)
    metrics.set_subscriber_state("s", SubscriberState.CONNECTED)
    assert value("conductor_subscriber_state", {"stream": "s", "state": "connected"}) == 1
    assert value("conductor_subscriber_state", {"stream": "s", "state": "connecting"}) is None
    assert value("conductor_batches_applied_created", {"stream": "s"}) is None
    metrics.forget_stream("s")
    assert value("conductor_subscriber_state", {"stream": "s", "state": "connected"}) is None


async def test_indexed_until_is_the_publish_time_of_the_latest_batch_applied(
    manager_factory, publisher_factory
):
    """What lets the router's embedded index say when a finished request's blocks are in:
    per instance, the oldest of its streams' latest applied batch times."""
    manager = manager_factory()
    assert manager.indexed_until("a", "default") is None  # no such instance
    ranks = [publisher_factory(), publisher_factory()]
    for rank, publisher in enumerate(ranks):
        await register(manager, publisher, "a", dp_rank=rank)
    assert manager.indexed_until("a", "default") is None  # nothing applied yet
    before = time.time()
    await ranks[0].publish([stored([1], [1, 2, 3, 4])])
    await until(lambda: matched(manager, [1, 2, 3, 4], "a") == 4)
    assert manager.indexed_until("a", "default") is None  # rank 1 has applied nothing
    await ranks[1].publish([stored([2], [5, 6, 7, 8])], dp_rank=1)
    await until(lambda: manager.indexed_until("a", "default") is not None)
    first = manager.indexed_until("a", "default")
    assert first is not None and before <= first <= time.time()
    await ranks[1].publish([stored([3], [9, 9, 9, 9])], dp_rank=1)
    await asyncio.sleep(0.2)
    assert manager.indexed_until("a", "default") == first  # rank 0 is the older
    assert manager.indexed_until("a", "other-tenant") is None
    for odd_time in (math.inf, math.nan):  # applied, but no word on progress
        payload = msgpack.packb([odd_time, [stored([4], [7, 7, 7, 7])], 0])
        await ranks[0].send_raw([ranks[0].topic, ranks[0].next_seq.to_bytes(8, "big"), payload])
        ranks[0].next_seq += 1
    await until(lambda: matched(manager, [7, 7, 7, 7], "a") == 4)
    assert manager.indexed_until("a", "default") == first


async def test_a_query_reports_the_progress_of_the_instances_it_names(
    served, http, publisher_factory
):
    """Ours: ``X-Conductor-Progress`` (a JSON list of instance ids) on ``/query`` is answered
    with ``X-Conductor-Indexed-Until`` ({id: publish time or null}); a malformed list is a
    400 naming the header; without it the answer has no such header (the Go shape)."""
    from tests.support.api import register_and_connect

    publisher = publisher_factory()
    await register_and_connect(http, served.url, publisher, "a")
    before = time.time()
    await publisher.publish([stored([1], [1, 2, 3, 4])])
    query = {"model": "m", "block_size": 4, "token_ids": [1, 2, 3, 4]}

    async def progress() -> dict[str, Any]:
        headers = {"X-Conductor-Progress": '["a", "nobody", "\\u00e9"]'}
        async with http.post(f"{served.url}/query", json=query, headers=headers) as response:
            assert response.status == 200
            return json.loads(response.headers["X-Conductor-Indexed-Until"])

    answer = await eventually(progress, lambda p: p["a"] is not None)
    assert answer["nobody"] is None and answer["é"] is None
    assert before <= answer["a"] <= time.time()
    async with http.post(f"{served.url}/query", json=query) as response:
        assert "X-Conductor-Indexed-Until" not in response.headers
    for bad in ("a", '{"a": 1}', "[1]", json.dumps(["x"] * 257)):
        headers = {"X-Conductor-Progress": bad}
        async with http.post(f"{served.url}/query", json=query, headers=headers) as response:
            assert response.status == 400
            assert (await response.json())["field"] == "X-Conductor-Progress"


async def test_hits_only_lists_the_instances_with_a_hit(served, http, publisher_factory):
    """Ours: ``X-Conductor-Hits-Only: 1`` leaves out the instances with no hit (the Go shape,
    without it, lists every instance of the tenant); a query for one instance is unchanged."""
    from tests.support.api import register_and_connect

    holder = publisher_factory()
    for publisher, name in ((holder, "a"), (publisher_factory(), "b")):
        await register_and_connect(http, served.url, publisher, name)
    await holder.publish([stored([1], [1, 2, 3, 4])])
    query = {"model": "m", "block_size": 4, "token_ids": [1, 2, 3, 4]}
    hits_only = {"X-Conductor-Hits-Only": "1"}

    async def answer(body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        async with http.post(f"{served.url}/query", json=body, headers=headers) as response:
            assert response.status == 200
            return (await response.json())["default"]

    listed = await eventually(lambda: answer(query, hits_only), lambda a: "a" in a)
    assert list(listed) == ["a"] and listed["a"]["longest_matched"] == 4
    everyone = await answer(query, {})
    assert sorted(everyone) == ["a", "b"] and everyone["b"]["longest_matched"] == 0
    assert list(await answer(query | {"instance_id": "b"}, hits_only)) == ["b"]
