"""End to end: real ZMQ publishers in vLLM 0.33 format and the conductor, as a subprocess for
the stream rules, in-process (``served``) for the shapes of its answers."""

from __future__ import annotations

import asyncio

import msgpack

from tests.support.api import (
    eventually,
    get,
    matched,
    metric,
    post,
    query,
    register_and_connect,
)
from tests.support.wire_publisher import removed, stored

PROMPT = list(range(1, 13))  # three blocks of 4
HASHES = [101, 102, 103]


async def test_register_store_remove_unregister(served, http, publisher_factory):
    base = served.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")
    assert await matched(http, base, PROMPT, "engine-a") == 0

    await publisher.publish([stored(HASHES, PROMPT)])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    answer = await query(http, base, PROMPT)
    assert answer == {
        "default": {
            "engine-a": {"longest_matched": 12, "DP": {"0": 12}, "GPU": 12, "CPU": 12, "DISK": 12}
        }
    }

    await publisher.publish([removed([102])])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 4)

    status, body = await post(http, f"{base}/unregister", {"instance_id": "engine-a"})
    assert (status, body) == (
        200,
        {"removed_instances": ["engine-a|default|0"], "status": "unregistered successfully"},
    )
    assert await query(http, base, PROMPT) == {}
    _, view = await get(http, f"{base}/global_view")
    assert view["context_count"] == 0


async def test_gap_is_repaired_by_replay(conductor, http, publisher_factory):
    base = conductor.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")
    await publisher.publish([stored([101], PROMPT[:4])])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 4)

    await publisher.publish([stored([102], PROMPT[4:8], parent=101)], send=False)  # lost
    await publisher.publish([stored([103], PROMPT[8:], parent=102)])

    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    assert publisher.replay_requests == [0, 1]  # the catch-up on connecting, then the gap
    assert await metric(http, base, "conductor_sequence_gaps_total") == 1
    assert await metric(http, base, "conductor_replayed_batches_applied_total") == 1
    assert await metric(http, base, "conductor_orphaned_events_total") == 0


async def test_joining_a_running_publisher_replays_from_zero(conductor, http, publisher_factory):
    base = conductor.url
    publisher = publisher_factory(legacy_replay=True)  # vLLM <= 0.25 3-frame replies
    await publisher.publish([stored([101], PROMPT[:4])], send=False)
    await publisher.publish([stored([102], PROMPT[4:8], parent=101)], send=False)
    await register_and_connect(http, base, publisher, "engine-a")
    await publisher.publish([stored([103], PROMPT[8:], parent=102)])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    assert publisher.replay_requests == [0]


async def test_publisher_restart_clears_its_blocks(conductor, http, publisher_factory):
    base = conductor.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")
    for seq in range(3):
        await publisher.publish([stored([100 + seq], [seq] * 4)])
    await eventually(lambda: matched(http, base, [2] * 4, "engine-a"), lambda n: n == 4)

    publisher.next_seq, publisher.buffer = 0, []  # the engine process restarted
    await publisher.publish([stored(HASHES, PROMPT)])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    assert await matched(http, base, [0] * 4, "engine-a") == 0
    assert await metric(http, base, "conductor_publisher_restarts_total") == 1


async def test_bad_frames_and_events_are_counted_and_skipped(conductor, http, publisher_factory):
    base = conductor.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")
    await publisher.send_raw([b"", b"\x00\x00"])  # 2 frames
    await publisher.send_raw([b"", b"\x00\x01", b"x"])  # 2-byte sequence
    await publisher.publish([stored([101], PROMPT[:4])])
    await publisher.send_raw([b"", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
    publisher.next_seq = 2
    await publisher.publish(
        [
            stored([102], PROMPT[4:8], parent=101),
            {"type": "BlockStored", "block_hashes": "oops"},
            {"type": "Nonsense"},
            stored([103], PROMPT[8:], parent=102),
        ]
    )
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    assert await metric(http, base, "conductor_decode_errors_total") == 5
    status, health = await get(http, f"{base}/health")
    assert status == 200 and health["blocks"] == 3


async def test_concurrent_queries_while_events_stream(conductor, http, publisher_factory):
    base = conductor.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")

    async def stream() -> None:
        for i in range(200):
            await publisher.publish([stored([1000 + i], [i] * 4)])
            await asyncio.sleep(0.001)

    async def ask(i: int) -> int:
        return await matched(http, base, [i % 200] * 4, "engine-a")

    results = await asyncio.gather(stream(), *(ask(i) for i in range(50)))
    assert all(n in (0, 4) for n in results[1:])
    await eventually(lambda: matched(http, base, [199] * 4, "engine-a"), lambda n: n == 4)


async def test_shared_pool_and_tiers_answer_cumulatively(served, http, publisher_factory):
    base = served.url
    engine, store = publisher_factory(), publisher_factory(with_replay=False)
    await register_and_connect(http, base, engine, "engine-a")
    await register_and_connect(http, base, store, "store", type="Mooncake")
    await engine.publish([stored(HASHES[:1], PROMPT[:4])])
    await engine.publish([stored(HASHES[1:2], PROMPT[4:8], parent=101, medium="CPU")])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 8)
    await store.publish([stored(HASHES[2:], PROMPT[8:], parent=102, medium="disk")])
    answer = await eventually(
        lambda: query(http, base, PROMPT),
        lambda a: a["default"]["engine-a"]["DISK"] == 12,
    )
    assert answer == {
        "default": {
            "engine-a": {"longest_matched": 12, "DP": {"0": 12}, "GPU": 4, "CPU": 8, "DISK": 12}
        }
    }


async def test_msgpack_requests_get_msgpack_answers(served, http, publisher_factory):
    base = served.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")
    await publisher.publish([stored(HASHES, PROMPT)])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    token_bytes = b"".join(t.to_bytes(4, "little", signed=True) for t in PROMPT)
    body = msgpack.packb({"model": "m", "block_size": 4, "token_ids": token_bytes})
    headers = {"Content-Type": "application/msgpack"}
    async with http.post(f"{base}/query", data=body, headers=headers) as response:
        assert response.content_type == "application/msgpack"
        answer = msgpack.unpackb(await response.read())
    assert answer["instances"]["engine-a"]["gpu"] == 12  # upstream C++'s shape (dialect)


async def test_query_by_hash_matches_query(served, http, publisher_factory):
    base = served.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")
    await publisher.publish([stored(HASHES, PROMPT)])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    body = {"model": "m", "block_size": 4, "seq_hashes": [101, 102, 999]}
    status, answer = await post(http, f"{base}/query_by_hash", body)
    assert status == 200
    assert answer["default"]["engine-a"]["longest_matched"] == 8
    status, answer = await post(http, f"{base}/query_by_hash", {**body, "block_hash": [101]})
    assert status == 200


async def test_engine_process_restart_on_same_ports(conductor, http, publisher_factory):
    """The engine dies and comes back: its lost connection clears the stale blocks, ZMQ
    reconnects, and batches sent while the subscription re-formed come back through replay."""
    base = conductor.url
    old = publisher_factory()
    await register_and_connect(http, base, old, "engine-a")
    for seq in range(3):
        await old.publish([stored([500 + seq], [9, 9, 9, seq])])
    await eventually(lambda: matched(http, base, [9, 9, 9, 2], "engine-a"), lambda n: n == 4)
    pub_port = int(old.endpoint.rsplit(":", 1)[1])
    replay_port = int(old.replay_endpoint.rsplit(":", 1)[1])
    await old.close()

    new = publisher_factory(port=pub_port, replay_port=replay_port)
    await new.publish([stored([101], PROMPT[:4])])  # likely lost: nobody subscribed yet
    await asyncio.sleep(0.5)
    await new.publish([stored([102], PROMPT[4:8], parent=101)])
    await new.publish([stored([103], PROMPT[8:], parent=102)])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    assert await matched(http, base, [9, 9, 9, 2], "engine-a") == 0
    assert await metric(http, base, "conductor_publisher_disconnects_total") == 1


async def test_block_size_mismatch_warns_once_and_degrades_health(
    conductor, http, publisher_factory
):
    base = conductor.url
    wrong, right = publisher_factory(), publisher_factory()
    await register_and_connect(http, base, wrong, "engine-a", block_size=16)
    await register_and_connect(http, base, right, "engine-b")
    for batch in range(3):  # 32-token blocks, as an engine started with --block-size 32
        await wrong.publish([stored([200 + batch], list(range(32)), block_size=32)])
    await right.publish([stored([101], PROMPT[:4])])
    await eventually(lambda: metric(http, base, "conductor_dropped_events_total"), lambda n: n == 3)
    await eventually(lambda: matched(http, base, PROMPT, "engine-b"), lambda n: n == 4)

    warnings = [
        line
        for line in conductor.log().splitlines()
        if "level=WARNING" in line and "block_size_mismatch" in line
    ]
    assert len(warnings) == 1, warnings
    for detail in ("instance_id=engine-a", "dp_rank=0", f"endpoint={wrong.endpoint}"):
        assert detail in warnings[0]
    status, health = await get(http, f"{base}/health")
    reason = "block_size_mismatch: registered 16, events carry 32"
    assert status == 200 and health["status"] == "degraded"
    assert health["streams"] == {
        "engine-a|default|0": {"state": "connected", "degraded": reason},
        "engine-b|default|0": {"state": "connected"},
    }
    assert health["subscribers"] == {"connected": 2} and health["blocks"] == 1

    await wrong.close()  # a lost connection is no fix: the same engine may come back
    await eventually(lambda: metric(http, base, "conductor_publisher_disconnects_total"), bool)
    _, health = await get(http, f"{base}/health")
    assert health["streams"]["engine-a|default|0"]["degraded"] == reason

    await post(http, f"{base}/unregister", {"instance_id": "engine-a"})
    status, health = await get(http, f"{base}/health")
    assert status == 200 and health["status"] == "ok"


async def test_an_idle_publisher_fills_the_index_on_connect(conductor, http, publisher_factory):
    """A conductor started after the engines learns their buffers at once, not at the
    engines' next batch (which may never come)."""
    base = conductor.url
    publisher = publisher_factory()
    await publisher.publish([stored([101], PROMPT[:4])], send=False)
    await publisher.publish([stored([102, 103], PROMPT[4:], parent=101)], send=False)
    await register_and_connect(http, base, publisher, "engine-a")
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    assert publisher.replay_requests == [0]


async def test_a_lost_publisher_is_forgotten_at_once(conductor, http, publisher_factory):
    """A dead engine's cache is gone: its blocks leave the index when its connection does."""
    base = conductor.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "engine-a")
    await publisher.publish([stored(HASHES, PROMPT)])
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
    await publisher.close()
    await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 0, timeout=2)
    assert await metric(http, base, "conductor_publisher_disconnects_total") == 1
    _, services = await get(http, f"{base}/services")
    assert services["services"][0]["State"] == "disconnected"
