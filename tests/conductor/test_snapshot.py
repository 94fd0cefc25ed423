"""Snapshots and recovery over real processes: a conductor restarted from its own snapshot
file or from a peer answers as before, after its publishers' replay buffers rolled over; a
truncated or corrupt snapshot is refused with a clear message and the previous one used."""

from __future__ import annotations

import asyncio
import hashlib
import struct
from pathlib import Path

import aiohttp
import msgpack
import pytest

from conductor.hashing import PrefixHash
from conductor.index import ContextKey, PrefixCacheTable, StreamSource
from conductor.snapshot import (
    OwnerBlocks,
    Snapshot,
    SnapshotError,
    _records,
    parse,
    read_file,
    restore_blocks,
)
from conductor.wire.events import EngineHash, Tier
from tests.support.api import eventually, get, metric, query, register_and_connect
from tests.support.wire_publisher import WirePublisher, removed, stored

PROMPT = list(range(1, 13))  # three blocks of four
OTHER = list(range(100, 108))
LATER = list(range(200, 208))
PROMPTS = (PROMPT, OTHER, LATER, PROMPT[:8] + [99, 99, 99, 99])


async def answers(http: aiohttp.ClientSession, url: str) -> list[dict[str, object]]:
    return [await query(http, url, prompt) for prompt in PROMPTS]


async def indexed_fleet(
    http: aiohttp.ClientSession, url: str, publishers: list[WirePublisher]
) -> list[dict[str, object]]:
    """Two engines with blocks on two tiers, one removal: what the snapshot must carry."""
    first, second = publishers
    await register_and_connect(http, url, first, "engine-a")
    await register_and_connect(http, url, second, "engine-b")
    await first.publish([stored([11, 12, 13], PROMPT)])
    await first.publish([stored([21, 22], OTHER, medium="CPU")])
    await second.publish([stored([11, 12], PROMPT[:8]), stored([31, 32], OTHER)])
    await second.publish([removed([32])])
    expected = {(0, "engine-a"): 12, (0, "engine-b"): 8, (1, "engine-a"): 8, (1, "engine-b"): 4}
    return await eventually(  # every batch applied before the first of the four queries
        lambda: answers(http, url),
        lambda a: all(
            a[prompt]["default"][name]["longest_matched"] == tokens
            for (prompt, name), tokens in expected.items()
        ),
    )


def snapshot_flags(path: Path, *extra: str) -> tuple[str, ...]:
    return ("--snapshot-path", str(path), "--state-file", "", *extra)


async def test_a_conductor_restarted_from_its_file_answers_as_before(
    conductor_factory, http, publisher_factory, tmp_path
):
    path = tmp_path / "index.snapshot"
    first = conductor_factory(*snapshot_flags(path))
    publishers = [publisher_factory(), publisher_factory()]
    before = await indexed_fleet(http, first.url, publishers)
    first.stop()  # SIGTERM: the last snapshot is written
    assert read_file(path).sequences == {"engine-a|default|0": 1, "engine-b|default|0": 1}
    for publisher in publishers:  # rolled over: every block must come from the file
        publisher.buffer.clear()

    second = conductor_factory(*snapshot_flags(path))
    assert await answers(http, second.url) == before
    _, services = await get(http, f"{second.url}/services")
    assert sorted(s["InstanceID"] for s in services["services"]) == ["engine-a", "engine-b"]
    await publishers[0].publish([stored([41, 42], LATER)])  # seq 2 follows the snapshot's
    await eventually(
        lambda: query(http, second.url, LATER),
        lambda a: a["default"]["engine-a"]["longest_matched"] == 8,
    )
    assert await metric(http, second.url, "conductor_sequence_gaps_unrepaired_total") == 0


async def test_a_conductor_started_with_a_peer_answers_like_the_peer(
    conductor_factory, http, publisher_factory
):
    peer = conductor_factory("--state-file", "")
    publishers = [publisher_factory(), publisher_factory()]
    expected = await indexed_fleet(http, peer.url, publishers)
    for publisher in publishers:
        publisher.buffer.clear()

    second = conductor_factory("--state-file", "", "--peers", f"http://127.0.0.1:1,{peer.url}")
    assert await answers(http, second.url) == expected
    assert "unreachable" in second.log()  # the dead peer: a warning, not a failed start
    await publishers[1].publish([stored([51, 52], LATER)])
    for url in (peer.url, second.url):
        await eventually(
            lambda url=url: query(http, url, LATER),
            lambda a: a["default"]["engine-b"]["longest_matched"] == 8,
        )


async def test_peers_that_never_answer_cost_one_timeout_together(
    conductor_factory, http, publisher_factory
):
    """Every source is asked at once: two hung peers before the live one delay the start
    by one ``peer_timeout_s``, not one each."""
    peer = conductor_factory("--state-file", "")
    expected = await indexed_fleet(http, peer.url, [publisher_factory(), publisher_factory()])

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the conductor gives up and closes
        writer.close()

    hung = [await asyncio.start_server(never_answer, "127.0.0.1", 0) for _ in range(2)]
    peers = [f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in hung]
    started = asyncio.get_running_loop().time()
    second = await asyncio.to_thread(
        conductor_factory,
        "--state-file", "", "--peer-timeout-s", "2", "--peers", ",".join([*peers, peer.url]),
    )  # fmt: skip
    assert asyncio.get_running_loop().time() - started < 3.9  # two timeouts would be 4 s
    assert await answers(http, second.url) == expected
    assert second.log().count("unreachable") == 2
    for server in hung:
        server.close()


async def test_batches_the_replay_buffer_lost_are_reported_and_newer_ones_replayed(
    conductor_factory, http, publisher_factory, tmp_path
):
    path = tmp_path / "index.snapshot"
    first = conductor_factory(*snapshot_flags(path))
    publisher = publisher_factory()
    await register_and_connect(http, first.url, publisher, "engine-a")
    await publisher.publish([stored([11, 12, 13], PROMPT)])  # seq 0: in the snapshot
    await eventually(
        lambda: query(http, first.url, PROMPT),
        lambda a: a["default"]["engine-a"]["longest_matched"] == 12,
    )
    first.stop()
    await publisher.publish([stored([21, 22], OTHER)])  # seq 1: lost with the buffer
    await publisher.publish([stored([41, 42], LATER)])  # seq 2: still buffered
    publisher.buffer = publisher.buffer[2:]

    second = conductor_factory(*snapshot_flags(path))
    hits = await eventually(
        lambda: answers(http, second.url),
        lambda a: a[2]["default"]["engine-a"]["longest_matched"] == 8,
    )
    assert hits[0]["default"]["engine-a"]["longest_matched"] == 12  # from the snapshot
    assert hits[1]["default"]["engine-a"]["longest_matched"] == 0  # never seen
    _, health = await get(http, f"{second.url}/health")
    gap = health["streams"]["engine-a|default|0"]["resume_gap"]
    assert "resumed at seq 1 but the publisher's buffer starts at 2" in gap
    assert await metric(http, second.url, "conductor_sequence_gaps_unrepaired_total") == 1


async def test_a_corrupt_snapshot_is_refused_and_the_previous_one_used(
    conductor_factory, http, publisher_factory, tmp_path
):
    path = tmp_path / "index.snapshot"
    first = conductor_factory(*snapshot_flags(path, "--snapshot-interval-s", "0.1"))
    publishers = [publisher_factory(), publisher_factory()]
    before = await indexed_fleet(http, first.url, publishers)
    written = await metric(http, first.url, "conductor_snapshot_written_timestamp_seconds")
    await eventually(  # two writes after the blocks: the previous file has them too
        lambda: metric(http, first.url, "conductor_snapshot_written_timestamp_seconds"),
        lambda at: at > written + 0.15,
    )
    first.stop()
    previous = path.with_name(path.name + ".previous")
    assert read_file(previous).registrations
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    for publisher in publishers:
        publisher.buffer.clear()

    second = conductor_factory(*snapshot_flags(path))
    assert await answers(http, second.url) == before
    assert "checksum mismatch" in second.log() and "truncated or corrupt" in second.log()


async def test_an_unreadable_snapshot_never_stops_a_start(conductor_factory, http, tmp_path):
    path = tmp_path / "index.snapshot"
    path.write_bytes(b"not a snapshot at all, but long enough to have a header and a digest")
    conductor = conductor_factory(*snapshot_flags(path))
    _, health = await get(http, f"{conductor.url}/health")
    assert health["services"] == 0
    assert "not a conductor snapshot (wrong magic bytes)" in conductor.log()
    head = struct.pack(">8sHdH", b"\x89CNDSNP\n", 1, 0.0, 0)
    valid_digest = head + msgpack.packb(["end"])
    valid_digest += hashlib.sha256(valid_digest).digest()
    for broken, reason in (
        (b"", "truncated"),
        (b"\x89CNDSNP\n\x00\x07" + bytes(60), "version 7"),
        (valid_digest, "malformed content: the first record is ['end'], not the meta record"),
    ):
        try:
            parse(broken, "test")
        except SnapshotError as error:
            assert reason in str(error)
        else:
            raise AssertionError(f"{broken!r} parsed")


async def test_the_snapshot_route_serves_what_a_peer_restores(
    conductor_factory, http, publisher_factory
):
    conductor = conductor_factory("--state-file", "")
    publishers = [publisher_factory(), publisher_factory()]
    await indexed_fleet(http, conductor.url, publishers)
    async with http.get(f"{conductor.url}/snapshot") as response:
        assert response.status == 200
        snapshot = parse(await response.read(), "route")
    assert [r.instance_id for r in snapshot.registrations] == ["engine-a", "engine-b"]
    assert snapshot.block_count() == 3 + 2 + 2 + 1  # engine-b's block 32 was removed


async def test_a_conductor_killed_mid_snapshot_restarts_from_the_previous_one(
    conductor_factory, http, publisher_factory, tmp_path
):
    path = tmp_path / "index.snapshot"
    first = conductor_factory(*snapshot_flags(path, "--snapshot-interval-s", "0.02"))
    publisher = publisher_factory()
    await register_and_connect(http, first.url, publisher, "engine-a")
    blocks, per_batch = 60_000, 10_000
    for start in range(0, blocks, per_batch):
        hashes = list(range(start + 1, start + per_batch + 1))
        tokens = [t % 50_000 for t in range(start * 4, (start + per_batch) * 4)]
        await publisher.publish([stored(hashes, tokens, start or None)])
    prompt = list(range(4 * 100))  # the first hundred blocks (a query's tokens are bounded)
    await eventually(
        lambda: metric(http, first.url, "conductor_snapshot_blocks"),
        lambda n: n == blocks,
        timeout=30,
    )
    await asyncio.sleep(0.3)  # writes follow each other: the kill lands in one of them
    first.kill()
    assert read_file(path).block_count() == blocks

    second = conductor_factory(*snapshot_flags(path))
    answer = await query(http, second.url, prompt)
    assert answer["default"]["engine-a"]["longest_matched"] == len(prompt)
    _, health = await get(http, f"{second.url}/health")
    assert health["blocks"] == blocks


async def test_a_snapshot_taken_while_batches_flow_agrees_with_its_sequence_numbers(
    conductor_factory, http, publisher_factory, tmp_path
):
    """Blocks of a batch after the snapshot's sequence number would be stored twice (once
    from the snapshot, once replayed) and outlive their removal. A big engine's blocks,
    written before the churning one's, make the build last many steps."""
    peer = conductor_factory("--state-file", "")
    big, churning = publisher_factory(), publisher_factory()
    await register_and_connect(http, peer.url, big, "engine-big")
    await register_and_connect(http, peer.url, churning, "engine-a")
    static = 400_000
    for start in range(0, static, 10_000):  # one chain, 10,000 blocks a batch
        first = 10**9 + start
        hashes = list(range(first + 1, first + 10_001))
        chunk = [t % 60_000 for t in range(start * 4, (start + 10_000) * 4)]
        await big.publish([stored(hashes, chunk, first if start else None)])
    await eventually(
        lambda: get(http, f"{peer.url}/health"), lambda answer: answer[1]["blocks"] == static
    )
    size, batches = 2_000, 40

    def tokens(batch: int) -> list[int]:
        return list(range(10**6 + batch * size * 4, 10**6 + (batch + 1) * size * 4))

    async def churn() -> None:
        for batch in range(batches):  # each batch replaces the one before
            hashes = list(range(batch * size + 1, (batch + 1) * size + 1))
            gone = [removed([h - size for h in hashes])] if batch else []
            await churning.publish([*gone, stored(hashes, tokens(batch))])
            await asyncio.sleep(0.002)

    flowing = asyncio.create_task(churn())
    await asyncio.sleep(0.08)
    async with http.get(f"{peer.url}/snapshot") as response:
        data = await response.read()
    await flowing
    path = tmp_path / "taken.snapshot"
    path.write_bytes(data)
    assert 0 < read_file(path).sequences["engine-a|default|0"] < batches - 1

    async def held(url: str) -> list[int]:
        answers = [await query(http, url, tokens(batch)[:8]) for batch in range(batches)]
        return [answer["default"]["engine-a"]["longest_matched"] for answer in answers]

    expected = [0] * (batches - 1) + [8]
    await eventually(lambda: held(peer.url), lambda hits: hits == expected)
    second = conductor_factory(*snapshot_flags(path))
    await eventually(lambda: held(second.url), lambda hits: hits == expected)
    await eventually(
        lambda: get(http, f"{second.url}/health"),
        lambda answer: answer[1]["blocks"] == static + size,
    )


# -- a snapshot is untrusted input (a peer's): what parsing and restoring refuse ----------
STREAM = "a|default|0"
OWN = ContextKey("default", "m", "", 4)


def framed(*records: object, created: float = 0.0) -> bytes:
    """A snapshot's bytes around these records, with a valid header and digest."""
    data = struct.pack(">8sHdH", b"\x89CNDSNP\n", 1, created, 0)
    data += b"".join(msgpack.packb(record) for record in records)
    return data + hashlib.sha256(data).digest()


def engine_table(max_dp_ranks: int = 16) -> PrefixCacheTable:
    table = PrefixCacheTable(max_dp_ranks=max_dp_ranks)
    table.add_stream(StreamSource(STREAM, "a", "default", "m", "", 4, kv_store="store:1"))
    return table


def owner(instance_id: str, dp_rank: int, first: int, tier: Tier = Tier.GPU) -> OwnerBlocks:
    blocks = {tier: ([first, first + 1], [first + 100, first + 101])}
    return OwnerBlocks(instance_id, dp_rank, (STREAM,), blocks)


def test_a_restore_takes_only_what_the_streams_events_could_have_stored() -> None:
    table = engine_table(max_dp_ranks=2)
    lora = ContextKey("default", "m", "x", 4)
    contexts = [
        (
            OWN,
            [
                owner("a", 0, 1),
                owner("a", 1, 11),
                owner("a", 2, 21),  # a third DP rank: over the stream's limit
                owner("a", -3, 31),  # no DP rank
                owner("b", 0, 41),  # another instance's slot
                owner("store:1", -1, 51, Tier.GPU),  # a pool holds CPU blocks only
                owner("store:1", -1, 61, Tier.CPU),
            ],
        ),
        (lora, [owner("a", 0, 71)]),  # a LoRA context its events may make
        (ContextKey("other", "m", "", 4), [owner("a", 0, 81)]),  # another tenant's
        (ContextKey("default", "n", "", 4), [owner("a", 0, 91)]),  # another model's
        (ContextKey("default", "m", "", 16), [owner("a", 0, 101)]),  # another block size
    ]
    snapshot = Snapshot(0.0, "peer", "peer", [], {}, contexts)
    assert restore_blocks(table, snapshot, {STREAM}) == 8
    assert set(table.contexts) == {OWN, lora}
    assert table.block_count() == 8
    assert sorted(table.contexts[OWN].slots) == [("a", 0), ("a", 1), ("store:1", -1)]


def test_copies_round_trip_and_bad_counts_are_refused() -> None:
    table = engine_table()
    context, slot = table.restored_slot(OWN, ("a", 0), [STREAM]) or pytest.fail("no slot")
    for _ in range(3):  # one block, two more physical copies
        context.hold(slot, Tier.GPU, [EngineHash(7)], [PrefixHash(107)])
    snapshot = parse(framed(*(msgpack.unpackb(r) for r in _records(table, [], {}))), "test")
    restored = engine_table()
    assert restore_blocks(restored, snapshot, {STREAM}) == 1
    assert restored.contexts[OWN].slots[("a", 0)].holdings[Tier.GPU].count() == 3

    meta = ["meta", {"registrations": [], "sequences": {}}]
    context_record = ["context", "default", "m", "", 4, None]
    for count in (0, -1, 10**9, "2"):
        copies = ["copies", 0, struct.pack("<Q", 7), [count]]
        body = (meta, context_record, ["owner", "a", 0, [STREAM]], copies, ["end"])
        with pytest.raises(SnapshotError, match="copy count"):
            parse(framed(*body), "test")
    with pytest.raises(SnapshotError, match="creation time"):
        parse(framed(meta, ["end"], created=float("inf")), "test")
