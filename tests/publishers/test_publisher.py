"""KVEventPublisher: byte-identical to the real producers, vLLM's socket behaviour, and a
real conductor indexing what it publishes.

The captures (``tests/fixtures/wire_fixtures.json``) are rebuilt from typed events written
out here by hand, so the encoder is checked against the real producers, not against this
project's decoder. Every socket is on 127.0.0.1 (or inproc) and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from conductor.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Message,
    Tier,
    decode_batch,
    normalize_hash,
    parse_replay,
    replay_request,
)
from publishers.encoding import Layout, WireEvent, encode_batch
from publishers.publisher import KVEventPublisher, binds, offset_endpoint
from tests.support.api import eventually, matched, register_and_connect

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wire_fixtures.json"
CASES: dict[str, dict[str, Any]] = {c["name"]: c for c in json.loads(FIXTURES.read_text())}
LAYOUT_OF_PRODUCER = {
    "vllm-0.33.0": "vllm",
    "vllm-0.22.0": "vllm-legacy",
    "sglang-0.5.23": "sglang",
}
LOOPBACK = "tcp://127.0.0.1:0"
WAIT_MS = 3000


def tokens(first: int, last: int) -> list[int]:
    return list(range(first, last + 1))


def stored(
    hashes: list[int], token_ids: list[int], parent: int | None = None, **fields: Any
) -> BlockStored:
    fields.setdefault("tier", Tier.GPU)
    return BlockStored(hashes, parent, token_ids, block_size=4, **fields)


def block_pool(
    hashes: list[int], token_ids: list[int], parent: int | None = None, **fields: Any
) -> BlockStored:
    """A BlockStored as vLLM's BlockPool emits it: always for KV-cache group 0."""
    return stored(hashes, token_ids, parent, group_idx=0, **fields)


def evicted(block_hash: int) -> BlockRemoved:
    """BlockPool evicts one block per event."""
    return BlockRemoved([block_hash], Tier.GPU, group_idx=0)


# ------------------------------------------------------------------- the captures' inputs

# vLLM 0.33 event hashes (sha256, PYTHONHASHSEED=0, blocks of 4).
V1, V2, V3 = 10362225831949560093, 12472515041799373675, 8105927037106591648  # tokens 1..12
L1, L2, L3 = 116433854667122578, 862671651757413008, 14288919932309277691  # LoRA + salt
M1, M2 = 2677169762037534881, 14919215712471546652  # tokens 21..28
# SGLang 0.5.23 sends these as signed int64; the conductor's events hold them unsigned.
S1, S2, S3 = map(normalize_hash, (-3488128144981237669, 5674439469042975057, -1307369107475853156))
SL1, SL2 = map(normalize_hash, (4547751747808663626, -6983363293199535932))  # LoRA namespace
SS1, SS2 = 3718046898735569995, 3308615664605479373  # salted chain
G1, G2 = 2598032718828521599, 2682940975668109282  # tokens 31..38

CLEARED: list[Event | WireEvent] = [AllBlocksCleared()]
POOL_1_TO_8: list[Event | WireEvent] = [block_pool([V1, V2], tokens(1, 8))]
SGLANG_1_TO_8: list[Event | WireEvent] = [stored([S1, S2], tokens(1, 8))]

BATCHES: dict[str, list[Event | WireEvent]] = {
    "v033_stored_gpu_no_parent": POOL_1_TO_8,
    "v033_stored_gpu_with_parent": [block_pool([V3], tokens(9, 12), V2)],
    "v033_stored_cpu_lora_salt_no_parent": [
        WireEvent(
            block_pool(
                [L1, L2], tokens(101, 108), tier=Tier.CPU, lora_name="sql-lora", salt="tenant-a"
            ),
            lora_id=7,
        )
    ],
    "v033_stored_cpu_parent_lora_extra_keys": [
        WireEvent(
            block_pool([L3], tokens(109, 112), L2, tier=Tier.CPU, lora_name="sql-lora"), lora_id=7
        )
    ],
    "v033_removed_single_from_eviction": [evicted(V3)],
    "v033_removed_multi_hash_explicit": [BlockRemoved([V1, V2], Tier.CPU)],
    "v033_all_blocks_cleared": CLEARED,
    "v033_mixed_stored_removed_cleared": [
        block_pool([M1, M2], tokens(21, 28)),
        evicted(M2),
        evicted(M1),
        AllBlocksCleared(),
    ],
    "v033_stored_all_optional_fields_explicit": [
        WireEvent(
            stored(
                [1, 2**64 - 1],
                [0, 1, 151643, 2**31 - 1, 5, 6, 7, 8],
                102,
                lora_name="adapter-x",
                group_idx=1,
            ),
            lora_id=3,
            extra_keys=[["adapter-x", ["mm-hash-abc", 0], "salt-1"], None],
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=1024,
            locality="LOCAL",
            ownership="tier-2",
            session_id="sess-42",
            lookahead_token_ids=[[5], [9]],
        )
    ],
    # MooncakeConnectorStoreV1: lowercase "cpu", no tokens, no extra keys
    "v033_stored_mooncake_store_style_explicit": [
        WireEvent(block_pool([V3], [], V2, tier=Tier.CPU), medium="cpu", extra_keys=None)
    ],
    "v033_batch_dp_rank_none_encoder_only": POOL_1_TO_8,
    "v033_dp_rank2_stored": POOL_1_TO_8,
    "v033_dp_rank2_all_blocks_cleared": CLEARED,
    "v033_topic_stored": POOL_1_TO_8,
    "v033_topic_all_blocks_cleared": CLEARED,
    "v0_22_0_stored_no_parent": POOL_1_TO_8,
    "v0_22_0_stored_small_parent_102": [block_pool([103], tokens(9, 12), 102)],
    "v0_22_0_removed": [evicted(V3)],
    "v0_22_0_all_blocks_cleared": CLEARED,
    "v0_22_0_mixed_stored_removed_cleared": [
        block_pool([101, 102], tokens(1, 8)),
        block_pool([103], tokens(9, 12), 102),
        evicted(101),
        AllBlocksCleared(),
    ],
    "v0_22_0_stored_lora_all_slots": [
        WireEvent(
            block_pool([V3], tokens(9, 12), V2, tier=Tier.CPU, lora_name="sql-lora"),
            lora_id=7,
            kv_cache_spec_kind="full_attention",
        )
    ],
    "sgl_stored_gpu_no_parent": SGLANG_1_TO_8,
    "sgl_stored_gpu_with_parent": [stored([S3], tokens(9, 12), S2)],
    "sgl_stored_cpu_pinned": [stored([S1, S2], tokens(1, 8), tier=Tier.CPU)],
    "sgl_stored_lora_name": [stored([SL1, SL2], tokens(1, 8), lora_name="sql-lora")],
    "sgl_stored_cache_salt_session": [
        WireEvent(stored([SS1, SS2], tokens(1, 8), salt="tenant-a"), session_id="sess-1")
    ],
    "sgl_stored_no_medium_int64_edges_explicit": [
        stored([2**64 - 1, 2**63, 2**63 - 1], tokens(41, 52), 2**64 - 2, tier=None)
    ],
    "sgl_removed_gpu": [BlockRemoved([S3], Tier.GPU)],
    "sgl_removed_cpu_pinned": [BlockRemoved([S1, S2], Tier.CPU)],
    "sgl_all_blocks_cleared": CLEARED,
    "sgl_mixed_stored_removed_cleared": [
        stored([G1, G2], tokens(31, 38)),
        BlockRemoved([G1, G2], Tier.GPU),
        AllBlocksCleared(),
    ],
    "sgl_attn_dp_rank1_stored": SGLANG_1_TO_8,
    "sgl_batch_attn_dp_rank_none_encoder_only": SGLANG_1_TO_8,
}


def captured_frames(name: str) -> list[bytes]:
    return [bytes.fromhex(frame) for frame in CASES[name]["frames_hex"]]


def timestamp(name: str) -> float:
    return CASES[name]["decoded"][0]


@pytest.mark.parametrize("name", BATCHES)
def test_payload_is_byte_identical_to_the_capture(name: str) -> None:
    case = CASES[name]
    layout = LAYOUT_OF_PRODUCER[case["producer"]]
    encoded = encode_batch(BATCHES[name], timestamp(name), case["decoded"][2], layout)
    assert encoded == base64.b64decode(case["payload_b64"])


def test_timestamp_is_always_float64() -> None:
    """msgspec encodes ``ts: float`` as float64 (0xcb) even when it is integral."""
    expected = b"\x93\xcb" + struct.pack(">d", 1780000000.0) + b"\x90\x00"
    assert encode_batch([], 1780000000, 0) == expected


# ------------------------------------------------------------------------ socket helpers


@contextmanager
def subscriber(endpoint: str) -> Iterator[zmq.Socket]:
    """A SUB that has completed its handshake, so the first published batch reaches it."""
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        socket.connect(endpoint)
        assert monitor.poll(WAIT_MS), "SUB handshake did not complete"
        socket.disable_monitor()
        time.sleep(0.1)  # the subscription itself travels after the handshake
        yield socket
    finally:
        monitor.close(0)
        socket.close(0)


def receive(socket: zmq.Socket) -> list[bytes]:
    assert socket.poll(WAIT_MS), "nothing arrived in time"
    return socket.recv_multipart()


def replay(endpoint: str | None, start: int) -> list[list[bytes]]:
    """What a conductor's DEALER receives for a replay from ``start``, end marker last."""
    assert endpoint is not None
    with zmq.Context.instance().socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart(replay_request(start))
        replies = [receive(dealer)]
        while parse_replay(replies[-1]) is not None:
            replies.append(receive(dealer))
        return replies


def replayed(endpoint: str | None, start: int) -> list[Message]:
    """The batches of a replay from ``start`` (the end marker checked and dropped)."""
    *batches, end = [parse_replay(frames) for frames in replay(endpoint, start)]
    assert end is None and None not in batches
    return batches  # type: ignore[return-value]


def loopback_publisher(**options: Any) -> KVEventPublisher:
    return KVEventPublisher(LOOPBACK, LOOPBACK, bind=True, **options)


# ------------------------------------------------------------- whole captured streams


@dataclass(frozen=True)
class CapturedStream:
    """Consecutive live batches of one real publisher, and its answer to one replay."""

    live: list[str]
    replay_start: int
    replies: list[str]
    options: dict[str, Any] = field(default_factory=dict)


STREAMS = {
    "vllm-0.33": CapturedStream(
        [
            "v033_stored_gpu_no_parent",
            "v033_stored_gpu_with_parent",
            "v033_stored_cpu_lora_salt_no_parent",
            "v033_stored_cpu_parent_lora_extra_keys",
            "v033_removed_single_from_eviction",
            "v033_removed_multi_hash_explicit",
            "v033_all_blocks_cleared",
            "v033_mixed_stored_removed_cleared",
            "v033_stored_all_optional_fields_explicit",
            "v033_stored_mooncake_store_style_explicit",
        ],
        7,
        [
            "v033_replay_reply_seq7",
            "v033_replay_reply_seq8",
            "v033_replay_reply_seq9",
            "v033_replay_end_marker",
        ],
    ),
    "vllm-0.33-topic": CapturedStream(
        ["v033_topic_stored", "v033_topic_all_blocks_cleared"],
        0,
        [
            "v033_topic_replay_reply_seq0",
            "v033_topic_replay_reply_seq1",
            "v033_topic_replay_end_marker",
        ],
        {"topic": "kv@model-a"},
    ),
    "vllm-0.33-dp-rank-2": CapturedStream(
        ["v033_dp_rank2_stored", "v033_dp_rank2_all_blocks_cleared"],
        1000,  # beyond the buffer: only the end marker
        ["v033_replay_nothing_to_replay_end_marker_only"],
        {"data_parallel_rank": 2},
    ),
    "vllm-0.22-legacy-replay": CapturedStream(
        [
            "v0_22_0_stored_no_parent",
            "v0_22_0_stored_small_parent_102",
            "v0_22_0_removed",
            "v0_22_0_all_blocks_cleared",
            "v0_22_0_mixed_stored_removed_cleared",
            "v0_22_0_stored_lora_all_slots",
        ],
        4,
        ["v0_22_0_replay_reply_seq4", "v0_22_0_replay_reply_seq5", "v0_22_0_replay_end_marker"],
        {"layout": "vllm-legacy", "legacy_replay": True},
    ),
    "sglang-0.5.23": CapturedStream(
        [
            "sgl_stored_gpu_no_parent",
            "sgl_stored_gpu_with_parent",
            "sgl_stored_cpu_pinned",
            "sgl_stored_lora_name",
            "sgl_stored_cache_salt_session",
            "sgl_stored_no_medium_int64_edges_explicit",
            "sgl_removed_gpu",
            "sgl_removed_cpu_pinned",
            "sgl_all_blocks_cleared",
            "sgl_mixed_stored_removed_cleared",
        ],
        8,
        ["sgl_replay_reply_seq8", "sgl_replay_reply_seq9", "sgl_replay_end_marker"],
        {"layout": "sglang"},
    ),
    "sglang-attn-dp-rank-1": CapturedStream(
        ["sgl_attn_dp_rank1_stored"],
        1,
        ["sgl_replay_end_marker"],
        {"layout": "sglang", "data_parallel_rank": 1},
    ),
}


@pytest.mark.parametrize("stream", STREAMS.values(), ids=STREAMS.keys())
def test_live_frames_and_replays_are_byte_identical_to_the_capture(stream: CapturedStream) -> None:
    """Topic, sequence and payload frames on the SUB, then the ROUTER's replay answer (4 or,
    for vLLM <= 0.25, 3 frames) exactly as the real publisher sent them."""
    with loopback_publisher(**stream.options) as publisher, subscriber(publisher.endpoint) as sub:
        sequences = [
            publisher.publish(BATCHES[name], timestamp=timestamp(name)) for name in stream.live
        ]
        assert sequences == list(range(len(stream.live)))
        for name in stream.live:
            assert receive(sub) == captured_frames(name), name
        assert publisher.flush()
        assert replay(publisher.replay_endpoint, stream.replay_start) == [
            captured_frames(name) for name in stream.replies
        ]


# ---------------------------------------------------------------------- replay behaviour


def publish_numbered(publisher: KVEventPublisher, count: int) -> None:
    """Batch ``i`` stores block ``i``, so a replayed payload names its own batch."""
    for i in range(count):
        publisher.publish([stored([i], [i] * 4)])
    assert publisher.flush()


@pytest.mark.parametrize(
    ("start", "expected"), [(0, [0, 1, 2, 3, 4]), (3, [3, 4]), (4, [4]), (5, []), (10**6, [])]
)
def test_replay_from_any_sequence(start: int, expected: list[int]) -> None:
    with loopback_publisher() as publisher:
        publish_numbered(publisher, 5)
        messages = replayed(publisher.replay_endpoint, start)
    assert [m.seq for m in messages] == expected
    assert [decode_batch(m.payload).events[0].block_hashes for m in messages] == [
        [seq] for seq in expected
    ]


def test_replay_buffer_keeps_only_the_newest_batches() -> None:
    with loopback_publisher(buffer_steps=3) as publisher:
        publish_numbered(publisher, 5)
        assert [m.seq for m in replayed(publisher.replay_endpoint, 0)] == [2, 3, 4]


@pytest.mark.parametrize(
    "request_frames",
    [
        [(0).to_bytes(8, "big")],  # the Go conductor's single-frame request
        [b"", (0).to_bytes(8, "big"), b"extra"],
    ],
    ids=["one-frame", "three-frames"],
)
def test_invalid_replay_request_gets_no_answer(
    request_frames: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with loopback_publisher() as publisher, zmq.Context.instance().socket(zmq.DEALER) as dealer:
        publish_numbered(publisher, 2)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        with caplog.at_level(logging.WARNING, logger="publishers.publisher"):
            dealer.send_multipart(request_frames)
            deadline = time.monotonic() + 5  # the publisher's thread may be slow to get to it
            while "invalid replay request" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            assert "invalid replay request" in caplog.text
            assert not dealer.poll(300), "an invalid request was answered"
        dealer.send_multipart(replay_request(1))  # the publisher still serves valid ones
        assert parse_replay(receive(dealer)).seq == 1  # type: ignore[union-attr]


# ---------------------------------------------------------------- endpoints and ranks


@pytest.mark.parametrize(
    ("endpoint", "bound"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://[::1]:5557", True),
        ("ipc:///tmp/kv-events", True),
        ("inproc://kv-events", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://conductor.local:5557", False),
    ],
)
def test_pub_binds_wildcard_ipv6_and_local_endpoints_and_connects_otherwise(
    endpoint: str, bound: bool
) -> None:
    assert binds(endpoint) is bound


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
        ("tcp://127.0.0.1:0", 3, "tcp://127.0.0.1:0"),
        ("inproc://kv", 1, "inproc://kv_dp1"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
    ],
)
def test_dp_rank_offsets_the_endpoint(endpoint: str, rank: int, expected: str) -> None:
    assert offset_endpoint(endpoint, rank) == expected


def test_dp_rank_cannot_offset_an_ipc_endpoint() -> None:
    with pytest.raises(ValueError):
        offset_endpoint("ipc:///tmp/kv", 1)


def first_delivery(publisher: KVEventPublisher, sub: zmq.Socket) -> list[bytes]:
    """Publish until the SUB gets a batch: without a handshake event to wait for, this is
    how to know the subscription has reached the PUB."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the PUB never delivered"
        publisher.publish(CLEARED)
    return sub.recv_multipart()


def test_inproc_endpoint_binds_with_the_dp_suffix() -> None:
    with (
        KVEventPublisher("inproc://kv-test", data_parallel_rank=3) as publisher,
        zmq.Context.instance().socket(zmq.SUB) as sub,
    ):
        assert publisher.endpoint == "inproc://kv-test_dp3"
        assert publisher.replay_endpoint is None
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publisher.endpoint)
        _, _, body = first_delivery(publisher, sub)
    assert decode_batch(body).dp_rank == 3


def test_pub_connects_to_a_bound_subscriber() -> None:
    with zmq.Context.instance().socket(zmq.SUB) as sub:
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind(LOOPBACK)
        endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        with KVEventPublisher(endpoint) as publisher:  # no wildcard: vLLM connects
            assert publisher.endpoint == endpoint
            topic, _, body = first_delivery(publisher, sub)
    assert (topic, decode_batch(body).events) == (b"", [AllBlocksCleared()])


# ------------------------------------------------------------------ conductor decoding

ROUND_TRIP: dict[Layout, list[Event]] = {
    "vllm": [
        stored([V1, V2], tokens(1, 8), lora_name="sql-lora", salt="tenant-a", group_idx=0),
        stored([V3], tokens(9, 12), V2, tier=Tier.CPU, salt="s", group_idx=1),
        stored([2**64 - 1], tokens(13, 16), V3, tier=Tier.DISK, lora_name="x"),
        stored([7], [], tier=None),
        BlockRemoved([V1, 2**63], Tier.CPU, group_idx=0),
        BlockRemoved([V2], Tier.DISK),
        AllBlocksCleared(),
    ],
    "sglang": [
        stored([2**64 - 1, 2**63, 5], tokens(1, 12), lora_name="sql-lora", salt="tenant-a"),
        stored([V3], tokens(13, 16), 2**63 + 1, tier=Tier.CPU),
        stored([7], tokens(17, 20), 7, tier=Tier.DISK),
        stored([8], [], tier=None),
        BlockRemoved([V1, 2**63], Tier.CPU),
        BlockRemoved([V2]),
        AllBlocksCleared(),
    ],
}
ROUND_TRIP["vllm-legacy"] = ROUND_TRIP["vllm"]


@pytest.mark.parametrize("layout", ROUND_TRIP)
def test_conductor_decodes_every_layout_into_the_same_events(layout: Layout) -> None:
    events = ROUND_TRIP[layout]
    decoded = decode_batch(encode_batch(events, 1780000000.5, 3, layout))
    assert decoded == EventBatch(1780000000.5, events, 3)


# ------------------------------------------------------------- concurrency and lifecycle


def test_publish_from_many_threads_keeps_one_contiguous_sequence() -> None:
    with loopback_publisher() as publisher:

        def work(thread: int) -> None:
            for i in range(50):
                publisher.publish([stored([thread * 1000 + i], [i] * 4)])

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(5)
        assert publisher.flush()
        messages = replayed(publisher.replay_endpoint, 0)
    assert [m.seq for m in messages] == list(range(200))
    hashes = [decode_batch(m.payload).events[0].block_hashes[0] for m in messages]
    for thread in range(4):  # each thread's batches keep their order
        own = [h for h in hashes if h // 1000 == thread]
        assert own == sorted(own) and len(own) == 50


async def test_publishing_inside_a_running_loop_keeps_it_responsive(
    zmq_context: zmq.asyncio.Context,
) -> None:
    lags: list[float] = []

    async def heartbeat() -> None:
        while True:
            started = time.monotonic()
            await asyncio.sleep(0.005)
            lags.append(time.monotonic() - started - 0.005)

    with loopback_publisher() as publisher:
        beat = asyncio.create_task(heartbeat())
        for i in range(2000):
            publisher.publish([stored([i], [i] * 4)])
            if i % 100 == 0:
                await asyncio.sleep(0)
        assert await asyncio.to_thread(publisher.flush)
        with zmq_context.socket(zmq.DEALER) as dealer:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(publisher.replay_endpoint)
            await dealer.send_multipart(replay_request(0))
            sequences = []
            while (
                message := parse_replay(await asyncio.wait_for(dealer.recv_multipart(), 5))
            ) is not None:
                sequences.append(message.seq)
        beat.cancel()
    assert sequences == list(range(2000))
    assert lags and max(lags) < 0.25


def test_close_is_bounded_idempotent_and_frees_the_ports() -> None:
    publisher = loopback_publisher()
    publish_numbered(publisher, 3)
    started = time.monotonic()
    publisher.close()
    publisher.close()
    assert time.monotonic() - started < 1.5
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(CLEARED)

    deadline = time.monotonic() + 3  # ZMQ releases a closed socket's port asynchronously
    while True:
        try:
            with KVEventPublisher(publisher.endpoint, publisher.replay_endpoint, bind=True):
                return
        except zmq.ZMQError as error:
            assert error.errno == zmq.EADDRINUSE and time.monotonic() < deadline
            time.sleep(0.02)


def test_bad_input_fails_in_the_caller() -> None:
    with pytest.raises(ValueError, match="layout"):
        KVEventPublisher(LOOPBACK, bind=True, layout="vllm-0.10")  # type: ignore[arg-type]
    with loopback_publisher() as publisher:
        with pytest.raises(TypeError):
            publisher.publish([{"type": "AllBlocksCleared"}])  # type: ignore[list-item]
        assert publisher.publish(CLEARED) == 0  # nothing was queued for the bad batch


# --------------------------------------------------------------- end to end: conductor

PROMPT = tokens(1, 12)  # three blocks of 4


async def test_conductor_indexes_stored_and_removed_blocks(conductor, http) -> None:
    base = conductor.url
    with loopback_publisher() as publisher:
        await register_and_connect(http, base, publisher, "engine-a")
        publisher.publish([block_pool([101, 102, 103], PROMPT)])
        await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 12)
        publisher.publish([evicted(102)])
        await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 4)


@pytest.mark.parametrize(
    "options",
    [
        {"layout": "vllm"},
        {"layout": "vllm-legacy", "legacy_replay": True},
        {"layout": "sglang"},
    ],
    ids=["vllm-0.33", "vllm-0.22-legacy-replay", "sglang"],
)
async def test_conductor_joining_late_replays_what_it_missed(conductor, http, options) -> None:
    """Batch 0 goes out before anyone subscribed (it is only buffered); the conductor first
    sees batch 1, replays from 0 and so learns the prefix batch 0 stored."""
    base = conductor.url
    kind = "SGLang" if options["layout"] == "sglang" else "vLLM"
    with loopback_publisher(**options) as publisher:
        publisher.publish([block_pool([101], PROMPT[:4])])
        assert await asyncio.to_thread(publisher.flush)
        await register_and_connect(http, base, publisher, "engine-a", type=kind)
        publisher.publish([block_pool([102], PROMPT[4:8], 101)])
        await eventually(lambda: matched(http, base, PROMPT, "engine-a"), lambda n: n == 8)
