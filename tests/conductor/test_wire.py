"""Decoding of every producer's KV-event payloads into typed events.

The captured fixtures are checked against an expected view computed here, independently of
the decoder, from the fixture's plain msgpack view; hand-built payloads cover the layouts
no fixture holds (Mooncake RFC #1527 maps, the legacy ``mooncake`` topic) and the failure
modes (one bad event, a bad batch, arbitrary bytes).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Event,
    EventBatch,
    Tier,
    decode_any_layout,
    decode_batch,
    parse_live,
    parse_replay,
)
from conductor.wire.typed import decode_typed_batch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wire_fixtures.json"
CASES: dict[str, dict[str, Any]] = {c["name"]: c for c in json.loads(FIXTURES.read_text())}
U64 = 2**64 - 1

# --------------------------------------------------------------------------- expected view

# Media normalize case-insensitively to three tiers.
EXPECTED_TIER: dict[str | None, Tier | None] = {
    None: None,
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "cpu": Tier.CPU,
    "DISK": Tier.DISK,
    "STORAGE": Tier.DISK,
    "disk": Tier.DISK,
    "EXTERNAL": Tier.DISK,
}

# Positional fields after the tag, in declaration order (a release sends a
# prefix of this list: 0.10.1 stops after lora_id, 0.22+ sends all of it).
ARRAY_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def expected_hash(value: Any) -> int | None:
    """Unsigned 64-bit form: ints wrap (SGLang is signed), digests keep their low 8 bytes."""
    if value is None:
        return None
    if isinstance(value, dict):  # the plain view spells a msgpack bin as {"hex": ...}
        return int.from_bytes(bytes.fromhex(value["hex"])[-8:], "big")
    return value & U64


def expected_salt(fields: dict[str, Any]) -> str | None:
    """SGLang says ``cache_salt``; vLLM puts it in block 0's extra keys, after the LoRA name."""
    if fields.get("cache_salt") is not None:
        return fields["cache_salt"]
    extra_keys = fields.get("extra_keys")
    if not extra_keys or not isinstance(extra_keys[0], list):
        return None
    keys = list(extra_keys[0])
    if keys and fields.get("lora_name") is not None and keys[0] == fields["lora_name"]:
        keys = keys[1:]
    return next((key for key in keys if isinstance(key, str)), None)


def as_fields(event: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """A map event as is; a legacy positional event as the map it stands for."""
    if isinstance(event, dict):
        return event
    kind, *values = event
    return {"type": kind, **dict(zip(ARRAY_FIELDS[kind], values, strict=False))}


def expected_view(event: dict[str, Any] | list[Any]) -> dict[str, Any]:
    """What the typed event must say, computed from the plain msgpack view alone."""
    fields = as_fields(event)
    kind = fields["type"]
    if kind == "AllBlocksCleared":
        return {"kind": kind}
    view: dict[str, Any] = {
        "kind": kind,
        "block_hashes": [expected_hash(h) for h in fields["block_hashes"]],
        "tier": EXPECTED_TIER[fields.get("medium")],
        "group_idx": fields.get("group_idx"),
    }
    if kind == "BlockStored":
        view |= {
            "parent_hash": expected_hash(fields["parent_block_hash"]),
            "token_ids": fields["token_ids"],
            "block_size": fields["block_size"],
            "lora_name": fields.get("lora_name"),
            "salt": expected_salt(fields),
        }
    return view


def actual_view(event: Event) -> dict[str, Any]:
    view = {"kind": type(event).__name__, **dataclasses.asdict(event)}
    if "token_ids" in view:  # decoders give an array('i') of the int32 values
        assert isinstance(view["token_ids"], array), view
        view["token_ids"] = view["token_ids"].tolist()
    return view


# --------------------------------------------------------------------------- fixture plumbing


def fixture_message(case: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """(topic, payload) as the subscriber would get them from the captured frames."""
    if case["kind"] == "encoder_only":  # no wire capture: the encoder's bytes only
        return b"", base64.b64decode(case["payload_b64"])
    frames = [bytes.fromhex(f) for f in case["frames_hex"]]
    message = parse_live(frames) if case["kind"] == "live" else parse_replay(frames)
    if case["kind"] == "replay_end":
        assert message is None
        return None
    assert message is not None
    assert message.topic == bytes.fromhex(case["topic_hex"])
    assert message.seq == case["seq"]
    assert message.payload == base64.b64decode(case["payload_b64"])
    return message.topic, message.payload


def decode_case(name: str) -> EventBatch:
    message = fixture_message(CASES[name])
    assert message is not None
    decoded = decode_batch(message[1], message[0])
    assert decoded.rejected == []
    return decoded


def pack_batch(events: list[Any], *tail: Any, ts: Any = 1_780_000_000.5) -> bytes:
    """A hand-built batch ``[ts, events, *tail]`` (tail: the dp_rank, if any)."""
    return msgpack.packb([ts, events, *tail])


def decode_one(payload: bytes, topic: bytes = b"") -> Event:
    decoded = decode_batch(payload, topic)
    assert decoded.rejected == []
    (event,) = decoded.events
    return event


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fixture_decodes_like_its_plain_view(case: dict[str, Any]) -> None:
    """Every captured payload decodes with nothing rejected, event by event, field by field."""
    message = fixture_message(case)
    if message is None:  # end-of-replay marker: nothing to decode
        assert case["decoded"] is None
        return
    timestamp, events, dp_rank = case["decoded"]
    decoded = decode_batch(message[1], message[0])
    assert decoded.rejected == []
    assert decoded.timestamp == timestamp
    assert decoded.dp_rank == dp_rank
    assert [actual_view(e) for e in decoded.events] == [expected_view(e) for e in events]


def test_fixture_set_is_complete() -> None:
    """The parametrization above covers every captured payload, of every kind."""
    kinds = [c["kind"] for c in CASES.values()]
    assert len(CASES) == 84
    assert {k: kinds.count(k) for k in set(kinds)} == {
        "live": 64,
        "replay_reply": 12,
        "replay_end": 6,
        "encoder_only": 2,
    }


# --------------------------------------------------------------------------- pinned facts


@pytest.mark.parametrize(
    ("name", "salt", "lora_name"),
    [
        ("v033_stored_cpu_lora_salt_no_parent", "tenant-a", "sql-lora"),
        ("v033_stored_all_optional_fields_explicit", "salt-1", "adapter-x"),
        ("sgl_stored_cache_salt_session", "tenant-a", None),
        ("v033_stored_cpu_parent_lora_extra_keys", None, "sql-lora"),
        ("v0_22_0_stored_lora_all_slots", None, "sql-lora"),
        ("v033_stored_gpu_no_parent", None, None),
    ],
)
def test_per_request_salt(name: str, salt: str | None, lora_name: str | None) -> None:
    """The chain root comes from the request's salt, never from the LoRA name."""
    (event,) = decode_case(name).events
    assert isinstance(event, BlockStored)
    assert (event.salt, event.lora_name) == (salt, lora_name)


@pytest.mark.parametrize(
    ("bytes_case", "int_case"),
    [
        ("v033_bytes_hashes_stored_no_parent", "v033_stored_gpu_no_parent"),
        ("v033_bytes_hashes_stored_with_parent", "v033_stored_gpu_with_parent"),
        ("v033_bytes_hashes_removed", "v033_removed_single_from_eviction"),
    ],
)
def test_bytes_hashes_are_the_low_64_bits_of_the_digest(bytes_case: str, int_case: str) -> None:
    """With int hashes off vLLM sends 32-byte digests; their low 8 bytes are the int hashes."""
    raw = msgpack.unpackb(base64.b64decode(CASES[bytes_case]["payload_b64"]))
    raw_event = raw[1][0]
    digests = raw_event["block_hashes"] + [raw_event.get("parent_block_hash")]
    assert all(len(d) == 32 for d in digests if d is not None)
    (from_bytes,) = decode_case(bytes_case).events
    (from_ints,) = decode_case(int_case).events
    assert from_bytes == from_ints


def test_sglang_signed_hashes_wrap_to_unsigned() -> None:
    """SGLang hashes are two's-complement int64: -1 is 2^64-1, -2^63 is 2^63."""
    (event,) = decode_case("sgl_stored_no_medium_int64_edges_explicit").events
    assert event == BlockStored(
        block_hashes=[U64, 2**63, 2**63 - 1],
        parent_hash=U64 - 1,
        token_ids=array("i", range(41, 53)),
        block_size=4,
        tier=None,
    )
    (stored,) = decode_case("sgl_stored_gpu_no_parent").events
    assert stored.block_hashes == [2**64 - 3488128144981237669, 5674439469042975057]


def test_sglang_removed_hashes_match_stored_ones() -> None:
    """A remove must name a block exactly as its store did, sign and all."""
    (stored,) = decode_case("sgl_stored_cpu_pinned").events
    (removed,) = decode_case("sgl_removed_cpu_pinned").events
    assert removed == BlockRemoved(stored.block_hashes, Tier.CPU)


def test_vllm_0_10_1_six_element_block_stored() -> None:
    """The Go decoder panics on this 6-element layout (no medium); we decode it."""
    (event,) = decode_case("v0_10_1_stored_small_parent_102").events
    assert event == BlockStored([103], 102, array("i", [9, 10, 11, 12]), 4, tier=None)
    (removed,) = decode_case("v0_10_1_removed").events
    assert removed == BlockRemoved([8105927037106591648], tier=None)


SMALL_PARENT_CASES = sorted(n for n in CASES if n.endswith("small_parent_102"))


@pytest.mark.parametrize("name", SMALL_PARENT_CASES)
def test_small_parent_hash(name: str) -> None:
    """A parent that msgpack packs as a fixint (Go rejects it) is still a parent."""
    (event,) = decode_case(name).events
    assert isinstance(event, BlockStored)
    assert (event.block_hashes, event.parent_hash, list(event.token_ids)) == (
        [103],
        102,
        [9, 10, 11, 12],
    )


def test_small_parent_cases_span_every_release() -> None:
    """vLLM 0.10.1 to 0.25.0: arrays of 6 to 12 elements, then maps."""
    assert len(SMALL_PARENT_CASES) == 9


@pytest.mark.parametrize(
    "name",
    ["v0_10_2_all_blocks_cleared", "v0_14_0_all_blocks_cleared", "v0_22_0_all_blocks_cleared"],
)
def test_all_blocks_cleared_array(name: str) -> None:
    """``["AllBlocksCleared"]`` clears the owner (Go fails the whole batch on it)."""
    assert decode_case(name).events == [AllBlocksCleared()]


def test_legacy_mixed_batch_keeps_event_order() -> None:
    assert decode_case("v0_22_0_mixed_stored_removed_cleared").events == [
        BlockStored([101, 102], None, array("i", range(1, 9)), 4, Tier.GPU, group_idx=0),
        BlockStored([103], 102, array("i", [9, 10, 11, 12]), 4, Tier.GPU, group_idx=0),
        BlockRemoved([101], Tier.GPU, group_idx=0),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("v033_batch_dp_rank_none_encoder_only", None),
        ("sgl_batch_attn_dp_rank_none_encoder_only", None),
        ("v033_dp_rank2_stored", 2),
        ("sgl_attn_dp_rank1_stored", 1),
    ],
)
def test_batch_dp_rank(name: str, rank: int | None) -> None:
    """A batch whose rank was never filled in says 'unknown' (nil), not rank 0."""
    decoded = decode_case(name)
    assert decoded.dp_rank == rank
    assert len(decoded.events) == 1


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        ("GPU", Tier.GPU),
        ("gpu", Tier.GPU),
        ("NPU", Tier.GPU),
        ("CPU", Tier.CPU),
        ("CPU_PINNED", Tier.CPU),
        ("cpu", Tier.CPU),
        ("DISK", Tier.DISK),
        ("STORAGE", Tier.DISK),
        ("disk", Tier.DISK),
        ("EXTERNAL", Tier.DISK),
        ("External", Tier.DISK),
        (None, None),
    ],
    ids=str,
)
def test_medium_names(medium: str | None, tier: Tier | None) -> None:
    """Every producer's medium spelling lands in one of three tiers."""
    event = {"type": "BlockRemoved", "block_hashes": [1], "medium": medium}
    assert decode_one(pack_batch([event], 0)) == BlockRemoved([1], tier)


def test_mooncake_store_connector_event() -> None:
    """MooncakeConnectorStoreV1 says lowercase 'cpu' and may send no tokens."""
    (event,) = decode_case("v033_stored_mooncake_store_style_explicit").events
    assert event == BlockStored(
        [8105927037106591648], 12472515041799373675, array("i"), 4, Tier.CPU, group_idx=0
    )


# --------------------------------------------------------------------------- Mooncake RFC #1527

MS = 1_780_000_000_123  # the master's batch and event timestamps are int milliseconds
BIG = 2**63 + 5  # a u64 >= 2^63: its legacy int64 cast is negative
BIG_AS_INT64 = BIG - 2**64


def rfc_event(event_type: str = "stored", **overrides: Any) -> dict[str, Any]:
    """An event as Mooncake master ``main`` writes it, keys in wire order."""
    event: dict[str, Any] = {
        "event_id": 1,
        "timestamp": MS,
        "event_type": event_type,
        "type": "BlockStored" if event_type == "stored" else "BlockRemoved",
        "model_name": None,
        "block_size": None,
        "additional_salt": None,
        "lora_name": None,
        "tenant_id": "default",
        "backend_id": "store-0",
        "group_id": None,
        "medium": "cpu",
        "dp_rank": None,
        "object_key": str(BIG),
        "seq_hashes": [BIG],
        "block_hashes": [BIG_AS_INT64],
    }
    if event_type == "stored":
        event |= {"base_block_idx": 0, "parent_hash": None, "token_ids": None}
        event["parent_block_hash"] = None
    else:
        event["base_block_idx"] = None
    return event | overrides


def test_rfc_batch_timestamp_is_milliseconds() -> None:
    decoded = decode_batch(pack_batch([rfc_event()], 0, ts=MS))
    assert decoded.timestamp == pytest.approx(1_780_000_000.123)
    assert decoded.dp_rank == 0


def test_rfc_stored_from_master_main() -> None:
    """No tokens, no parent, nil per-event dp_rank: the block is known by its seq hash."""
    assert decode_one(pack_batch([rfc_event()], 0, ts=MS)) == BlockStored(
        block_hashes=[BIG], parent_hash=None, token_ids=array("i"), block_size=None, tier=Tier.CPU
    )


@pytest.mark.parametrize(
    ("seq_hashes", "block_hashes", "expected"),
    [
        ([7], [8], [7]),  # seq_hashes win when both are present
        ([], [BIG_AS_INT64, -1], [BIG, U64]),  # legacy int64 cast, wrapped back
        (None, [BIG_AS_INT64], [BIG]),
    ],
    ids=["seq_hashes_preferred", "empty_seq_hashes", "nil_seq_hashes"],
)
def test_rfc_hash_source(seq_hashes: Any, block_hashes: list[int], expected: list[int]) -> None:
    event = rfc_event(seq_hashes=seq_hashes, block_hashes=block_hashes)
    assert decode_one(pack_batch([event], 0, ts=MS)).block_hashes == expected


@pytest.mark.parametrize(
    ("medium", "tier"), [("cpu", Tier.CPU), ("disk", Tier.DISK), (None, None)], ids=str
)
def test_rfc_medium(medium: str | None, tier: Tier | None) -> None:
    assert decode_one(pack_batch([rfc_event(medium=medium)], 0, ts=MS)).tier == tier


def test_rfc_removed() -> None:
    event = rfc_event("removed", medium="disk")
    assert decode_one(pack_batch([event], 0, ts=MS)) == BlockRemoved([BIG], Tier.DISK)


def test_rfc_dev_conductor_variant() -> None:
    """The dev/conductor master fills context fields, an int per-event dp_rank and 'cleared'."""
    stored = rfc_event(
        model_name="llama",
        block_size=16,
        additional_salt="salt-x",
        lora_name="sql-lora",
        dp_rank=3,
        block_hashes=[BIG],
        base_block_idx=None,
        parent_hash=12,
        token_ids=list(range(16)),
        connector_block_hash=99,
        tp_rank=0,
    )
    cleared = {"event_id": 3, "timestamp": MS, "event_type": "cleared", "dp_rank": 3}
    decoded = decode_batch(pack_batch([stored, cleared], 0, ts=MS))
    assert decoded.rejected == []
    assert decoded.events == [
        BlockStored([BIG], 12, array("i", range(16)), 16, Tier.CPU, "sql-lora", "salt-x"),
        AllBlocksCleared(),
    ]


# ------------------------------------------------------------------------ legacy "mooncake" topic

MOONCAKE = b"mooncake"
TOKENS = list(range(1, 9))


def store_event(
    hashes: Any = "101, 102", parent: Any = "", replicas: Any = (("memory", "node-a:1"),)
) -> list[Any]:
    """``["BlockStoreEvent", key, replicas, model, block_size, hashes, parent, tokens]``."""
    return [
        "BlockStoreEvent",
        "key-1",
        [list(r) for r in replicas],
        "llama",
        4,
        hashes,
        parent,
        TOKENS,
    ]


def pack_legacy_batch(*events: list[Any]) -> bytes:
    return msgpack.packb([1_780_000_000.5, list(events)])  # 2 elements: no dp_rank


@pytest.mark.parametrize(
    ("hashes", "expected"),
    [
        ("101, 102", [101, 102]),
        ("101,102\t103\n104  105", [101, 102, 103, 104, 105]),
        (" 18446744073709551615 ", [U64]),
        ("0x65, 0X66", [101, 102]),
        ([101, "102", "0x67"], [101, 102, 103]),
        (101, [101]),
        ([-1], [U64]),
    ],
    ids=["decimal", "whitespace", "u64_max", "hex", "mixed_array", "number", "negative"],
)
def test_legacy_mooncake_hash_forms(hashes: Any, expected: list[int]) -> None:
    assert decode_one(pack_legacy_batch(store_event(hashes)), MOONCAKE) == BlockStored(
        expected, None, array("i", TOKENS), 4, Tier.CPU
    )


@pytest.mark.parametrize(
    ("parent", "expected"),
    [("100", 100), (100, 100), ("0", None), ("", None), (None, None)],
    ids=["decimal", "number", "zero", "empty", "nil"],
)
def test_legacy_mooncake_parent(parent: Any, expected: int | None) -> None:
    assert (
        decode_one(pack_legacy_batch(store_event(parent=parent)), MOONCAKE).parent_hash == expected
    )


@pytest.mark.parametrize(
    ("replicas", "tier"),
    [
        ((("memory", "node-a:1"),), Tier.CPU),
        ((), Tier.CPU),
        ((("DISK", "/mnt/kv"),), Tier.DISK),
        ((("memory", "node-a:1"), ("local_disk", "/mnt/kv")), Tier.DISK),
        ((("nvme_ssd", "/dev/nvme0"),), Tier.DISK),
    ],
    ids=["memory", "no_replicas", "disk", "memory_and_disk", "ssd"],
)
def test_legacy_mooncake_replica_tier(replicas: Any, tier: Tier) -> None:
    assert decode_one(pack_legacy_batch(store_event(replicas=replicas)), MOONCAKE).tier == tier


def test_legacy_store_event_is_detected_by_shape() -> None:
    """A BlockStoreEvent on an unexpected topic still decodes (detection by shape)."""
    assert decode_one(pack_legacy_batch(store_event()), b"") == decode_one(
        pack_legacy_batch(store_event()), MOONCAKE
    )


# --------------------------------------------------------------------------- one bad event

GOOD_STORED: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": TOKENS,
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
GOOD_REMOVED: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}
BAD_EVENTS: dict[str, Any] = {
    "unknown_type": {"type": "BlockUpdated", "block_hashes": [1]},
    "no_type": {"block_hashes": [1]},
    "missing_block_hashes": {k: v for k, v in GOOD_STORED.items() if k != "block_hashes"},
    "removed_missing_block_hashes": {"type": "BlockRemoved", "medium": "GPU"},
    "bad_medium": GOOD_STORED | {"medium": "HBM"},
    "medium_not_a_string": GOOD_STORED | {"medium": 1},
    "string_hash": GOOD_STORED | {"block_hashes": [11, "12"]},
    "float_hash": GOOD_STORED | {"block_hashes": [11.5]},
    "nil_hash": GOOD_REMOVED | {"block_hashes": [None]},
    "empty_bytes_hash": GOOD_STORED | {"block_hashes": [b""]},
    "hashes_not_an_array": GOOD_STORED | {"block_hashes": 11},
    "float_parent": GOOD_STORED | {"parent_block_hash": 1.5},
    "token_ids_not_an_array": GOOD_STORED | {"token_ids": "1 2 3 4"},
    "string_token": GOOD_STORED | {"token_ids": ["x", *TOKENS[1:]]},
    "float_token": GOOD_STORED | {"token_ids": [1.5, *TOKENS[1:]]},
    "nil_token": GOOD_STORED | {"token_ids": [*TOKENS[:-1], None]},
    "wide_int_and_string_token": GOOD_STORED | {"token_ids": [2**40, "x", *TOKENS[2:]]},
    "block_size_not_an_int": GOOD_STORED | {"block_size": "4"},
    "lora_name_not_a_string": GOOD_STORED | {"lora_name": 7},
    "cache_salt_not_a_string": GOOD_STORED | {"cache_salt": 7},
    "group_idx_not_an_int": GOOD_REMOVED | {"group_idx": "0"},
    "neither_map_nor_array": 42,
    "array_unknown_type": ["BlockUpdated", [1]],
    "array_empty": [],
    "array_stored_too_short": ["BlockStored", [1], None, [1, 2, 3, 4]],
    "array_removed_without_hashes": ["BlockRemoved"],
    "array_bad_medium": ["BlockRemoved", [1], "HBM"],
    "rfc_unknown_event_type": rfc_event("updated"),
    "rfc_without_hashes": rfc_event(seq_hashes=[], block_hashes=[]),
    "rfc_bad_medium": rfc_event(medium="hbm"),
    "legacy_bad_hash_text": store_event("101, 0xZZ"),
    "legacy_float_hash": store_event([1.5]),
    "legacy_without_hashes": store_event(""),
    "legacy_too_short": store_event()[:6],
}


# `true` is not a uint64: the all-int fast path must not take it as hash 1.
BOOL_HASH = pytest.param(GOOD_STORED | {"block_hashes": [True]}, id="bool_hash")


@pytest.mark.parametrize(
    "bad", [*(pytest.param(v, id=k) for k, v in BAD_EVENTS.items()), BOOL_HASH]
)
def test_one_bad_event_rejects_only_itself(bad: Any) -> None:
    """One bad event is counted and skipped; the rest of its batch is applied."""
    decoded = decode_batch(pack_batch([GOOD_STORED, bad, GOOD_REMOVED], 0))
    assert decoded.events == [
        BlockStored([11, 12], None, array("i", TOKENS), 4, Tier.GPU),
        BlockRemoved([12], Tier.GPU),
    ]
    assert len(decoded.rejected) == 1
    assert decoded.rejected[0].startswith("event 1:")


def test_bad_legacy_event_on_mooncake_topic() -> None:
    """Go fails the whole batch on BlockUpdateEvent; we skip only that event."""
    decoded = decode_batch(
        pack_legacy_batch(store_event(), ["BlockUpdateEvent", "key-1"]), MOONCAKE
    )
    assert len(decoded.events) == 1
    assert len(decoded.rejected) == 1 and decoded.rejected[0].startswith("event 1:")


# --------------------------------------------------------------------------- whole-batch failures

VALID = pack_batch([GOOD_STORED], 0)
BAD_BATCHES: dict[str, bytes] = {
    "empty": b"",
    "not_msgpack": b"\xc1",
    "text": b"not msgpack",
    "truncated": VALID[:-3],
    "trailing_bytes": VALID + b"\x00",
    "map": msgpack.packb({"ts": 1.0, "events": [], "dp_rank": 0}),
    "scalar": msgpack.packb(1.0),
    "one_element": msgpack.packb([1.0]),
    "four_elements": pack_batch([], 0, 0),
    "events_map": msgpack.packb([1.0, {}, 0]),
    "events_nil": msgpack.packb([1.0, None, 0]),
    "timestamp_string": pack_batch([], 0, ts="2026-01-01"),
    "timestamp_nil": pack_batch([], 0, ts=None),
    "timestamp_bool": pack_batch([], 0, ts=True),
    "negative_dp_rank": pack_batch([], -1),
    "string_dp_rank": pack_batch([], "0"),
    "float_dp_rank": pack_batch([], 0.0),
}


# msgpack `true` is no DP rank (a bool is an int subclass in Python).
BOOL_DP_RANK = pytest.param(pack_batch([], True), id="bool_dp_rank")


@pytest.mark.parametrize(
    "payload", [*(pytest.param(v, id=k) for k, v in BAD_BATCHES.items()), BOOL_DP_RANK]
)
def test_unusable_batch_raises_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_empty_batch_is_fine() -> None:
    decoded = decode_batch(pack_batch([], None, ts=0))
    assert (decoded.events, decoded.rejected, decoded.dp_rank) == ([], [], None)


# --------------------------------------------------------------------------- properties

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), U64)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40)
)
msgpack_values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=5)
    ),
    max_leaves=20,
)
# Events close enough to real ones to reach deep into each decoder: known tags and keys,
# field values that are sometimes right (hash lists, media, hash strings) and often wrong.
KEYS = sorted({*GOOD_STORED, *rfc_event(), "cache_salt", "extra_keys", "group_idx"})
TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStoreEvent", "stored", "cleared"]
field_values = (
    leaves
    | st.lists(leaves, max_size=4)
    | st.lists(st.integers(-(2**63), U64), max_size=4)
    | st.sampled_from(["GPU", "cpu", "disk", "HBM", "0x10", "1, 2", ""])
)
near_events = (
    st.builds(
        lambda tag, fields, rfc: fields | ({"event_type": tag} if rfc else {"type": tag}),
        st.sampled_from(TAGS),
        st.dictionaries(st.sampled_from(KEYS), field_values, max_size=10),
        st.booleans(),
    )
    | st.builds(
        lambda tag, rest: [tag, *rest], st.sampled_from(TAGS), st.lists(field_values, max_size=12)
    )
    | msgpack_values
)
TOPICS = st.sampled_from([b"", MOONCAKE])


@settings(max_examples=300, deadline=None)
@given(payload=st.binary(max_size=200), topic=TOPICS)
def test_arbitrary_bytes_only_raise_decode_error(payload: bytes, topic: bytes) -> None:
    """Corrupt input must never escape as another exception (it would kill the subscriber)."""
    with contextlib.suppress(DecodeError):
        decode_batch(payload, topic)


@settings(max_examples=300, deadline=None)
@given(value=msgpack_values, topic=TOPICS)
def test_arbitrary_msgpack_only_raises_decode_error(value: Any, topic: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_batch(msgpack.packb(value), topic)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(near_events, max_size=4),
    ts=st.floats(allow_nan=False) | st.integers(0, U64),
    tail=st.sampled_from([(), (None,), (0,), (7,)]),
    topic=TOPICS,
)
def test_every_event_is_decoded_or_rejected(
    events: list[Any], ts: float | int, tail: tuple[Any, ...], topic: bytes
) -> None:
    """A well-formed batch never fails as a whole: each event is decoded or rejected."""
    decoded = decode_batch(pack_batch(events, *tail, ts=ts), topic)
    assert len(decoded.events) + len(decoded.rejected) == len(events)


# --------------------------------------------------------------------------- the fast path


def test_fast_path_takes_the_captured_vllm_batches_and_agrees() -> None:
    """msgspec's typed decoder takes captured vLLM / SGLang batches whole, all maps (vLLM >=
    0.24, SGLang) or all arrays (vLLM <= 0.23), and decodes them exactly as the every-layout
    decoder does; it refuses the other layouts (Mooncake's, mixed batches)."""
    taken = {dict: 0, list: 0}
    for name, case in CASES.items():
        message = fixture_message(case)
        if message is None:
            continue
        topic, payload = message
        fast = decode_typed_batch(payload)
        if fast is not None:
            shapes = {type(e) for e in msgpack.unpackb(payload)[1]}
            assert len(shapes) <= 1, name
            for shape in shapes:
                taken[shape] += 1
            if list in shapes:
                assert all(e[0] != "BlockStoreEvent" for e in msgpack.unpackb(payload)[1]), name
        assert decode_batch(payload, topic) == decode_any_layout(payload, topic), name
    assert taken[dict] >= 10 and taken[list] >= 3, taken


ARRAY_STORED = ["BlockStored", [11, 12], None, TOKENS, 4, None, "GPU", None, None, 0, None, None]
GOOD_EVENTS = st.sampled_from(
    [
        GOOD_STORED,
        GOOD_REMOVED,
        {"type": "AllBlocksCleared"},
        ARRAY_STORED,
        ARRAY_STORED[:6],  # vLLM 0.10: six elements
        ["BlockStored", [13], 12, TOKENS[:4], 4, 1, "cpu", "sql-lora", ["salt", "sql-lora"], 0],
        ["BlockRemoved", [12], "GPU", None],
        ["BlockRemoved", [12]],
        ["AllBlocksCleared"],
    ]
)


@settings(max_examples=500, deadline=None)
@given(
    events=st.lists(GOOD_EVENTS | near_events, max_size=4),
    ts=st.floats(allow_nan=False) | st.integers(0, U64) | st.booleans(),
    tail=st.sampled_from([(), (None,), (0,), (7,), (-1,), (True,), (0, 1)]),
    topic=TOPICS,
)
def test_fast_path_never_changes_an_answer(
    events: list[Any], ts: Any, tail: tuple[Any, ...], topic: bytes
) -> None:
    """Whatever the batch, decode_batch answers (or refuses) as the every-layout decoder."""
    payload = pack_batch(events, *tail, ts=ts)
    try:
        expected: EventBatch | str = decode_any_layout(payload, topic)
    except DecodeError as error:
        expected = str(error)
    try:
        actual: EventBatch | str = decode_batch(payload, topic)
    except DecodeError as error:
        actual = str(error)
    assert actual == expected
