"""The C ingest lane (``pack_batch`` + ``PrefixCacheTable.apply_packed``) against the decoders.

The lane must be invisible: whatever batch it takes, the index and the counters end exactly
as if the batch had been decoded and applied event by event; whatever it declines goes the
decoded way. Checked over every captured producer payload, over random batches of both
vLLM layouts (values at the edges of what the lane takes), over arbitrary bytes, and in the
service's manager when the lane hands a batch over half-way. The reference-model check in
test_index.py runs through the lane too.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conductor import _native
from conductor.config import Registration
from conductor.hash_profile import HashProfile
from conductor.index import ApplyStats, ContextKey, PrefixCacheTable, StreamSource
from conductor.kv_store_watch import StoreWatch
from conductor.manager import ServiceManager
from conductor.metrics import ConductorMetrics
from conductor.stream_limits import StreamLimits
from conductor.wire import Message, decode_batch, pack_batch
from conductor.wire.events import DecodeError, Tier
from tests.conductor.test_index import check_invariants

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wire_fixtures.json"
CASES: list[dict[str, Any]] = json.loads(FIXTURES.read_text())
PRIMER_HASH = 2**62 + 12345  # an unrelated block every test table stores first


# upstream C++'s sample profile: the engine hashes are the keys, tokens and parents unread
PROFILE = HashProfile.model_validate(
    {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "0",
     "index_projection": "low64_be"}
)  # fmt: skip
PROFILES = [None, PROFILE]


def stream(block_size: int, key: str = "s", profile: HashProfile | None = None) -> StreamSource:
    return StreamSource(key, "i0", "default", "m", "", block_size, hash_profile=profile)


def primed_table(source: StreamSource, dp_rank: int | None) -> PrefixCacheTable:
    """A table whose stream stored one block at ``dp_rank`` (decoded): the lane only takes
    batches for an engine slot that exists."""
    table = PrefixCacheTable()
    table.add_stream(source)
    primer = [0.0, [["BlockStored", [PRIMER_HASH], None, [0] * source.block_size, None, None]]]
    stats = table.apply(source.key, decode_batch(msgpack.packb([*primer, dp_rank])))
    assert stats.blocks_stored == 1
    return table


def snapshot(table: PrefixCacheTable) -> dict[ContextKey, Any]:
    """Everything the index holds, as plain values."""
    return {
        key: (
            {
                slot_key: [
                    (dict(h.by_engine_hash.items()), dict(h.copies), dict(h.extra_refs))
                    for h in slot.holdings
                ]
                for slot_key, slot in context.slots.items()
            },
            [dict(blocks.items()) for blocks in context.blocks],
            dict(context.engine_prefix.items()),
            dict(context._state.engine_refs),
        )
        for key, context in table.contexts.items()
    }


def through_lane(table: PrefixCacheTable, key: str, payload: bytes, topic: bytes = b"") -> Any:
    """What the service does with a batch: the lane if it takes it, else the decoders.
    Returns (stats, whether the lane took it)."""
    stats = ApplyStats()
    packed = pack_batch(payload, topic, table._sources[key].block_size)
    if packed is not None and table.apply_packed(key, packed, 0, stats) == len(packed):
        return stats, True
    return table.apply(key, decode_batch(payload, topic), stats), False


def decoded(table: PrefixCacheTable, key: str, payload: bytes, topic: bytes = b"") -> ApplyStats:
    return table.apply(key, decode_batch(payload, topic))


# -- captured payloads ------------------------------------------------------------------------
def _block_size(case: dict[str, Any]) -> int:
    for event in case["decoded"][1] if isinstance(case["decoded"], list) else ():
        size = event.get("block_size") if isinstance(event, dict) else None
        if isinstance(event, list) and event[:1] == ["BlockStored"] and len(event) > 4:
            size = event[4]
        if isinstance(size, int) and size > 0:
            return size
    return 16


def _wire(case: dict[str, Any]) -> tuple[bytes, bytes]:
    return base64.b64decode(case["payload_b64"]), bytes.fromhex(case["topic_hex"])


TAKEN = [c for c in CASES if pack_batch(*_wire(c), _block_size(c)) is not None]


def test_the_lane_takes_the_plain_captured_payloads_and_declines_the_rest() -> None:
    """GPU-only vLLM and SGLang batches without LoRA, salt or a clear go through C; CPU
    media, LoRA, salts, clears, digests for hashes and token-less events do not."""
    took = {c["name"] for c in TAKEN}
    assert {"v033_stored_gpu_no_parent", "v0_10_1_stored_small_parent_102"} <= took
    assert {"v0_22_0_removed", "sgl_stored_gpu_no_parent", "v033_topic_stored"} <= took
    for declined in (
        "v033_stored_cpu_lora_salt_no_parent",
        "v033_all_blocks_cleared",
        "v033_bytes_hashes_stored_no_parent",
        "v033_stored_mooncake_store_style_explicit",
        "sgl_stored_cache_salt_session",
        "sgl_removed_cpu_pinned",
        "v0_22_0_stored_lora_all_slots",
    ):
        assert declined not in took


@pytest.mark.parametrize("case", TAKEN, ids=[c["name"] for c in TAKEN])
@pytest.mark.parametrize("profile", PROFILES, ids=["go-hashes", "hash-profile"])
def test_every_captured_payload_the_lane_takes_ends_as_decoded(
    case: dict[str, Any], profile: HashProfile | None
) -> None:
    payload, topic = _wire(case)
    rank = decode_batch(payload, topic).dp_rank  # what the lane takes decodes
    source = stream(_block_size(case), profile=profile)
    lane_table, decoded_table = primed_table(source, rank), primed_table(source, rank)
    packed = pack_batch(payload, topic, source.block_size)
    assert packed is not None
    stats = ApplyStats()
    assert lane_table.apply_packed(source.key, packed, 0, stats) == len(packed)
    assert stats == decoded(decoded_table, source.key, payload, topic)
    assert snapshot(lane_table) == snapshot(decoded_table)
    check_invariants(lane_table)


# -- random batches ----------------------------------------------------------------------------
BS = 2
HASHES = st.sampled_from([1, 2, 3, 5, 8, 0, 2**63, 2**64 - 1, -1, -(2**63), 2**40 + 7])
TOKEN = st.one_of(st.integers(0, 9), st.integers(-(2**63), 2**64 - 1))


@st.composite
def stored_events(draw: st.DrawFn) -> dict[str, Any]:
    hashes = draw(st.lists(HASHES, min_size=0, max_size=4))
    tokens = draw(st.sampled_from([BS * len(hashes), BS * len(hashes) + 1, 0]))
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": draw(st.one_of(st.none(), HASHES)),
        "token_ids": draw(st.lists(TOKEN, min_size=tokens, max_size=tokens)),
        "block_size": draw(st.sampled_from([None, BS, BS, BS + 1])),
        "lora_id": draw(st.sampled_from([None, 0, 3, [1, {"x": b"y"}]])),
        "medium": draw(st.sampled_from([None, "GPU", "gpu", "gPu", "CPU", "disk", "GP"])),
        "lora_name": draw(st.sampled_from([None, None, None, "adapter"])),
        "extra_keys": draw(
            st.sampled_from([None, [], [None, None], [None, ["x"]], [["salt"]], [1], "odd"])
        ),
        "group_idx": draw(st.sampled_from([None, 0, 0, 1, -1])),
    }


@st.composite
def removed_events(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "type": "BlockRemoved",
        "block_hashes": draw(st.lists(HASHES, max_size=4)),
        "medium": draw(st.sampled_from([None, "GPU", "CPU"])),
        "group_idx": draw(st.sampled_from([None, 0, 1])),
    }


def as_array(event: dict[str, Any]) -> list[Any]:
    """The vLLM <= 0.23 positional form, all fields sent."""
    if event["type"] == "BlockRemoved":
        return ["BlockRemoved", event["block_hashes"], event["medium"], event["group_idx"]]
    fields = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
    fields += ("medium", "lora_name", "extra_keys", "group_idx")
    return ["BlockStored", *(event[f] for f in fields)]


@st.composite
def payloads(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(st.one_of(stored_events(), removed_events()), max_size=5))
    if draw(st.booleans()):
        events = [as_array(e) for e in events]
    elif events and draw(st.integers(0, 9)) == 0:
        events[0] = {**events[0], "kv_cache_spec_kind": "full"}  # a field the lane lacks
    timestamp = draw(st.sampled_from([1.5, 1_700_000_000_123, -5, 2**60]))
    batch: list[Any] = [timestamp, events]
    rank = draw(st.sampled_from(["absent", None, 0, 0, 1]))
    if rank != "absent":
        batch.append(rank)
    return msgpack.packb(batch)


@pytest.mark.parametrize("profile", PROFILES, ids=["go-hashes", "hash-profile"])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(payloads(), min_size=1, max_size=4))
def test_random_batches_end_as_decoded(profile: HashProfile | None, batches: list[bytes]) -> None:
    """Batches applied in turn through the lane (declined ones decoded) and all decoded:
    the same counters, the same index; ranks 0 and 1 both exist, the primer made rank 0.
    In a profiled context the engine hashes are the keys."""
    source = stream(BS, profile=profile)
    lane_table, decoded_table = primed_table(source, 0), primed_table(source, 0)
    for payload in batches:
        try:
            expected = decoded(decoded_table, source.key, payload)
        except ValueError:
            assert _native.pack_batch(payload, BS) is None
            continue
        got, _ = through_lane(lane_table, source.key, payload)
        assert got == expected
        assert snapshot(lane_table) == snapshot(decoded_table)
    check_invariants(lane_table)


@settings(max_examples=300, deadline=None)
@given(payloads(), st.data())
def test_any_cut_or_flipped_payload_is_declined_or_decodes_alike(
    payload: bytes, data: st.DataObject
) -> None:
    """A payload cut short or with a byte changed never crashes the lane; whatever it still
    takes, the decoders take whole, with as many events."""
    cut = data.draw(st.integers(0, len(payload)))
    at = data.draw(st.integers(0, len(payload) - 1))
    flipped = bytearray(payload)
    flipped[at] ^= data.draw(st.integers(1, 255))
    for variant in (payload[:cut], bytes(flipped), payload + b"\x00"):
        packed = _native.pack_batch(variant, BS)
        if packed is not None:
            batch = decode_batch(variant)
            assert len(packed) == len(batch.events) and not batch.rejected


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_lane(payload: bytes) -> None:
    packed = _native.pack_batch(payload, BS)
    if packed is not None:
        assert len(packed) == len(decode_batch(payload).events)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=12))
def test_a_skipped_str_passes_the_lane_only_as_strict_utf8(text: bytes) -> None:
    """Python's decoders refuse a batch holding a str that is not strict UTF-8 (undecodable,
    counted as such: a DecodeError, not a crash); the lane, which skips later blocks' extra
    keys unread, must decline it too."""
    event = ["BlockStored", [1], None, [1, 2], None, None, "GPU", None, [None, [text]]]
    payload = msgpack.packb([0.0, [event]], use_bin_type=False)  # bytes as a msgpack str
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        assert _native.pack_batch(payload, BS) is None
        with pytest.raises(DecodeError, match="not msgpack"):
            decode_batch(payload)
    else:
        assert _native.pack_batch(payload, BS) is not None
        assert len(decode_batch(payload).events) == 1


def test_a_deeply_nested_value_is_declined_not_recursed_into() -> None:
    nested = b"\x91" * 100_000 + b"\xc0"  # [[[...[nil]...]]] as lora_id
    head = msgpack.packb(["BlockStored", [1], None, [1, 2], None])
    event = b"\x96" + head[1:] + nested  # the 5 fields, then the sixth
    assert _native.pack_batch(b"\x92\xcb" + bytes(8) + b"\x91" + event, BS) is None
    shallow = b"\x91" * 8 + b"\xc0"
    assert _native.pack_batch(b"\x92\xcb" + bytes(8) + b"\x91\x96" + head[1:] + shallow, BS)


# -- when the lane declines -------------------------------------------------------------------
def stored_payload(hashes: list[int], tokens: list[int], parent: int | None = None) -> bytes:
    event = ["BlockStored", hashes, parent, tokens, None, None, "GPU"]
    return msgpack.packb([0.0, [event], None])


def test_the_lane_waits_for_the_first_stored_event_to_make_the_slot() -> None:
    table = PrefixCacheTable()
    table.add_stream(stream(BS))
    _, took = through_lane(table, "s", stored_payload([1], [5, 6]))
    assert not took  # the slot (and the limits' check) comes from the decoded way
    _, took = through_lane(table, "s", stored_payload([2], [7, 8], parent=1))
    assert took and table.block_count() == 2


def test_removals_are_declined_while_the_slot_holds_other_tiers_or_contexts() -> None:
    """A removal without a medium reaches every tier and LoRA context of the stream's slot
    at that rank: the lane only takes it while the GPU blocks are all there are."""
    table = primed_table(stream(BS), 0)
    removal = msgpack.packb([0.0, [["BlockRemoved", [PRIMER_HASH]]], 0])
    cpu = msgpack.packb([0.0, [["BlockStored", [9], None, [1, 2], None, None, "CPU"]], 0])
    assert decoded(table, "s", cpu).blocks_stored == 1
    stats, took = through_lane(table, "s", removal)
    assert not took and stats.blocks_removed == 1
    table = primed_table(stream(BS), 0)
    lora = ["BlockStored", [9], None, [1, 2], None, None, None, "adapter"]
    assert decoded(table, "s", msgpack.packb([0.0, [lora], 0])).blocks_stored == 1
    assert not through_lane(table, "s", removal)[1]


def test_a_shared_pool_stream_never_takes_the_lane() -> None:
    source = StreamSource("p", "pool", "default", "m", "", BS, shared_pool=True)
    table = primed_table(source, 0)
    no_medium = msgpack.packb([0.0, [["BlockStored", [1], None, [5, 6], None, None]], 0])
    stats, took = through_lane(table, "p", no_medium)
    assert not took and stats.blocks_stored == 1  # on the pool's own tier: CPU
    assert table.contexts[ContextKey("default", "m", "", BS)].block_counts() == (0, 2, 0)


def test_a_stream_registered_again_stores_into_its_new_context() -> None:
    """The table remembers where a stream's events go; a new registration under the same
    key (another model here) must not reuse that."""
    table = primed_table(stream(BS), None)
    table.remove_stream("s")
    table.add_stream(StreamSource("s", "i0", "default", "other-model", "", BS))
    assert decoded(table, "s", stored_payload([1], [5, 6])).blocks_stored == 1
    _, took = through_lane(table, "s", stored_payload([2], [7, 8], parent=1))
    assert took
    assert [c.model_name for c in table.contexts] == ["other-model"]
    assert table.contexts[ContextKey("default", "other-model", "", BS)].block_counts()[0] == 2
    table.add_stream(StreamSource("s", "i0", "default", "third", "", BS))  # no unregister
    assert decoded(table, "s", stored_payload([3], [1, 1])).blocks_stored == 1
    assert table.contexts[ContextKey("default", "third", "", BS)].block_counts()[0] == 1


def test_the_lane_applies_a_batch_in_parts_of_a_block_budget() -> None:
    """Each call applies events until about ``max_blocks`` blocks (at least one event), and
    the parts add up to the whole batch applied at once."""
    events = [["BlockStored", [10 + i, 100 + i], None, [i] * 2 * BS, None, None] for i in range(9)]
    payload = msgpack.packb([0.0, [*events, ["BlockRemoved", [10, 11, 12]]], 0])
    whole, parts = primed_table(stream(BS), 0), primed_table(stream(BS), 0)
    whole_stats, parts_stats = ApplyStats(), ApplyStats()
    packed = pack_batch(payload, b"", BS)
    assert packed is not None
    assert whole.apply_packed("s", packed, 0, whole_stats) == 10
    reached, position = [], 0
    while position < len(packed):
        position = parts.apply_packed("s", packed, position, parts_stats, max_blocks=5) or 0
        reached.append(position)
    assert reached == [2, 4, 6, 8, 10]  # an event of 2 blocks counts 3: two a part
    assert parts_stats == whole_stats and snapshot(parts) == snapshot(whole)
    assert parts.apply_packed("s", packed, 3, ApplyStats(), max_blocks=1) == 4


async def test_the_manager_decodes_the_rest_when_the_lane_stops_half_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between two steps of a batch, the engine's rank-1 stream (whose batches say rank 0,
    so it shares the rank-0 slot) stores a CPU block: the lane stops taking the batch's
    removals, and the manager decodes the batch and applies it from the first event the
    lane did not apply. The counters are the batch's, once."""
    table = PrefixCacheTable()
    metrics = ConductorMetrics(table)
    stores = StoreWatch(table, metrics, str, 2.0)
    manager = ServiceManager(table, metrics, stores, StreamLimits(), ingest_thread=False)
    manager.loop_share.step_s = 0.0  # a step per part: a yield after every 32 events
    monkeypatch.setattr("conductor.manager.BLOCKS_PER_CLOCK_READ", 64)  # 32 of 1 block
    fields = {"type": "vLLM", "modelname": "m", "instance_id": "i0", "block_size": BS}
    engine = Registration.model_validate({**fields, "endpoint": "tcp://127.0.0.1:1"})
    other = Registration.model_validate({**fields, "endpoint": "tcp://127.0.0.1:2", "dp_rank": 1})
    for registration in (engine, other):
        table.add_stream(registration.source())
    assert decoded(table, engine.key, stored_payload([PRIMER_HASH], [0, 0])).blocks_stored == 1
    stores = [["BlockStored", [100 + i], None, [i, i], None, None] for i in range(32)]
    removes = [["BlockRemoved", [100 + i]] for i in range(8)]
    payload = msgpack.packb([0.0, [*stores, *removes], 0])
    steps = manager._ingest(engine, Message(b"", 1, payload), replayed=False)
    next(steps)  # the lane applied the 32 stored events, then yielded
    cpu = msgpack.packb([0.0, [["BlockStored", [7], None, [1, 2], None, None, "CPU"]], 0])
    assert decoded(table, other.key, cpu).blocks_stored == 1
    for _ in steps:
        pass
    slot = table.contexts[ContextKey("default", "m", "", BS)].slots[("i0", 0)]
    assert set(slot.holdings[Tier.GPU].by_engine_hash) == {PRIMER_HASH} | set(range(108, 132))
    counted = {
        name: metrics.sample(f"conductor_{name}_total", {"stream": engine.key})
        for name in ("events_applied", "blocks_stored", "blocks_removed")
    }
    assert counted == {"events_applied": 40, "blocks_stored": 32, "blocks_removed": 8}
    assert metrics.sample("conductor_decoded_batches_total") == 1  # this one, half-way
    check_invariants(table)
    await manager.close()


async def test_the_manager_counts_the_batches_the_lane_leaves_to_python() -> None:
    """A slot's first batch makes the slot (decoded); then a plain batch takes the lane and
    a LoRA one does not: conductor_decoded_batches_total tells an operator how much of a
    fleet's ingest runs the slower way."""
    table = PrefixCacheTable()
    metrics = ConductorMetrics(table)
    manager = ServiceManager(
        table, metrics, StoreWatch(table, metrics, str, 2.0), StreamLimits(), ingest_thread=False
    )
    fields = {"type": "vLLM", "modelname": "m", "instance_id": "i0", "block_size": BS}
    engine = Registration.model_validate({**fields, "endpoint": "tcp://127.0.0.1:1"})
    table.add_stream(engine.source())
    plain = [["BlockStored", [100 + i], None, [i, i], None, None] for i in range(4)]
    lora = [["BlockStored", [200], None, [5, 5], None, None, "GPU", "adapter-a"]]
    counts = []
    for sequence, events in enumerate((plain, plain, lora)):
        payload = msgpack.packb([0.0, events, 0])
        for _ in manager._ingest(engine, Message(b"", sequence, payload), replayed=False):
            pass
        counts.append(metrics.sample("conductor_decoded_batches_total"))
    assert counts == [1, 1, 2]
    await manager.close()


async def test_the_manager_s_ingest_thread_ends_as_the_loop_s_steps() -> None:
    """With ``ingest_thread`` the lane's batches are applied on the thread while the stream
    reads on (a backlog of 4 here, so some batches wait for room): once ``ingest_paused``
    let them finish, the index and the counters are the loop's, batches the lane declines
    (a CPU event) included in order, and an unregistered stream's late answers count
    nothing."""
    fields = {"type": "vLLM", "modelname": "m", "instance_id": "i0", "block_size": BS}
    engine = Registration.model_validate({**fields, "endpoint": "tcp://127.0.0.1:1"})
    payloads = [stored_payload([PRIMER_HASH], [0, 0])]
    for n in range(60):
        events: list[Any] = [["BlockStored", [1000 + n], None, [n, n], None, None]]
        if n % 7 == 3:
            events.append(["BlockRemoved", [1000 + n - 1]])
        if n == 30:
            events = [["BlockStored", [5], None, [1, 2], None, None, "CPU"]]  # decoded
        payloads.append(msgpack.packb([0.0, events, 0]))
    results = []
    for thread in (True, False):
        table = PrefixCacheTable()
        metrics = ConductorMetrics(table)
        stores = StoreWatch(table, metrics, str, 2.0)
        manager = ServiceManager(table, metrics, stores, StreamLimits(), ingest_thread=thread)
        table.add_stream(engine.source())
        manager.registrations[engine.key] = engine
        for seq, payload in enumerate(payloads):
            for waiting in manager._ingest(engine, Message(b"", seq, payload), replayed=False):
                if waiting is not None:
                    await asyncio.wait_for(waiting, 10)
            if thread and manager._lane is not None:
                manager._lane.max_backlog = 4
        async with manager.ingest_paused(10):
            counted = {
                name: metrics.sample(f"conductor_{name}_total", {"stream": engine.key})
                for name in ("events_applied", "blocks_stored", "blocks_removed")
            }
            results.append((snapshot(table), counted))
            check_invariants(table)
        if thread:  # a batch given, then its stream unregistered before it is applied
            late = msgpack.packb([0.0, [["BlockStored", [9], None, [7, 7], None, None]], 0])
            assert next(manager._ingest(engine, Message(b"", 99, late), False), None) is None
            del manager.registrations[engine.key]
            async with manager.ingest_paused(10):
                sample = metrics.sample("conductor_blocks_stored_total", {"stream": engine.key})
                assert sample == counted["blocks_stored"]
        await manager.close()
    assert results[0] == results[1]
    assert results[0][1]["blocks_stored"] == 61
