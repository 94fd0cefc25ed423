"""PrefixCacheTable: the global prefix index and its /query answer.

The table is pure and synchronous, so every test builds registrations (``StreamSource``),
applies decoded batches and reads the answers directly. Besides the answers, most tests
check the table's internal bookkeeping (``check_invariants``) because a leaked bit or
engine-hash entry is invisible to one query but routes requests to a dead cache later.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import xxhash

from conductor.hashing import chain_hashes, prefix_hashes, salt_root
from conductor.index import (
    EVERY_SLOT,
    STORE_POOL_RANK,
    ApplyStats,
    ContextKey,
    ContextView,
    InstanceMatch,
    PrefixCacheTable,
    PrefixContext,
    StorePoolView,
    StreamSource,
    TierHits,
)
from conductor.wire import decode_batch, pack_batch
from conductor.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    Tier,
)
from publishers.encoding import encode_batch

BS = 4
MODEL = "m"
VECTORS_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "conductor_hash_vectors.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))

Answer = dict[str, tuple[int, int, int]]


# -- helpers ----------------------------------------------------------------------------------
def src(
    instance: str,
    *,
    tenant: str = "default",
    lora: str = "",
    block_size: int = BS,
    dp_rank: int = 0,
    salt: str = "",
    shared_pool: bool = False,
    kv_store: str = "",
) -> StreamSource:
    """A registration; the key follows the service key ``instance|tenant|dp_rank``."""
    return StreamSource(
        key=f"{instance}|{tenant}|{dp_rank}",
        instance_id=instance,
        tenant_id=tenant,
        model_name=MODEL,
        lora_name=lora,
        block_size=block_size,
        dp_rank=dp_rank,
        salt=salt,
        shared_pool=shared_pool,
        kv_store=kv_store,
    )


def ctx(tenant: str = "default", lora: str = "", block_size: int = BS) -> ContextKey:
    return ContextKey(tenant, MODEL, lora, block_size)


def toks(first_block: int, n_blocks: int = 1) -> list[int]:
    """Tokens of blocks ``first_block .. first_block + n_blocks - 1`` of a fixed prompt."""
    return list(range(first_block * BS, (first_block + n_blocks) * BS))


def prompt(n_blocks: int) -> list[int]:
    return toks(0, n_blocks)


def stored(
    hashes: Sequence[int], tokens: Sequence[Any], parent: int | None = None, **kw: Any
) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_hash=parent, token_ids=list(tokens), **kw)


def removed(hashes: Sequence[int], **kw: Any) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), **kw)


def batch(*events: Event, dp_rank: int | None = None) -> EventBatch:
    return EventBatch(timestamp=0.0, events=list(events), dp_rank=dp_rank)


def answer(result: dict[str, InstanceMatch] | None) -> Answer:
    """``{instance: (GPU, CPU, DISK)}`` of a match; an unknown context is an empty answer."""
    return {} if result is None else {i: (m.gpu, m.cpu, m.disk) for i, m in result.items()}


def query(
    table: PrefixCacheTable,
    tokens: Sequence[int],
    key: ContextKey | None = None,
    salt: str = "",
    instance_id: str | None = None,
) -> Answer:
    return answer(table.match_tokens(key or ctx(), tokens, salt, instance_id))


def check_invariants(table: PrefixCacheTable) -> None:
    """Every tier dict is exactly the union of its owners' engine-hash maps; nothing stale.

    A bit set in ``blocks`` must be explained by an engine hash the slot holds, ``extra_refs``
    must count exactly the duplicate engine hashes, and empty contexts must be gone. A pool's
    members are exactly the engine slots whose registrations name its store (every slot for
    a Mooncake pool), and a kv_store pool exists exactly while such a registration does.
    """
    for key, context in table.contexts.items():
        assert context.key == key
        assert not context.is_empty(), f"empty context {key} left behind"
        expected: tuple[dict[int, int], ...] = ({}, {}, {})
        bits: set[int] = set()
        members: dict[int, int] = {}
        for (instance, rank), slot in context.slots.items():
            assert (slot.instance_id, slot.dp_rank) == (instance, rank)
            assert slot.bit == 1 << slot.index and slot.bit not in bits
            bits.add(slot.bit)
            assert slot.streams, "a slot without a stream can never be removed"
            if slot.kv_store:
                assert slot.shared_pool and (instance, rank) == (slot.kv_store, STORE_POOL_RANK)
                assert {table._sources[k].kv_store for k in slot.streams} == {slot.kv_store}
                members.setdefault(slot.bit, 0)
            elif slot.shared_pool:
                members[slot.bit] = EVERY_SLOT
            for tier, holdings in enumerate(slot.holdings):
                counts: dict[int, int] = {}
                for prefix_hash in holdings.by_engine_hash.values():
                    counts[prefix_hash] = counts.get(prefix_hash, 0) + 1
                    expected[tier][prefix_hash] = expected[tier].get(prefix_hash, 0) | slot.bit
                assert holdings.extra_refs == {p: n - 1 for p, n in counts.items() if n > 1}
        for slot in context.slots.values():
            for stream_key in () if slot.shared_pool else slot.streams:
                kv_store = table._sources[stream_key].kv_store
                if kv_store:
                    members[context.slots[(kv_store, STORE_POOL_RANK)].bit] |= slot.bit
        assert context.pool_members == members
        assert context.pool_mask == sum(members)
        assert context._by_index == {slot.index: slot for slot in context.slots.values()}
        assert set(context._free).isdisjoint(context._by_index)  # recycled bits are unused
        cached = context._engine_set()
        context._engines = None  # what a query sees of the slots was rebuilt when they changed
        assert cached == context._engine_set()
        assert all(not m.gpu and not m.cpu and not m.disk for m in cached.zero.values())
        assert context.blocks == expected
        holders: dict[int, int] = {}
        for slot in context.slots.values():
            for holdings in slot.holdings:
                for engine_hash in holdings.by_engine_hash:
                    holders[engine_hash] = holders.get(engine_hash, 0) + 1
        assert set(context.engine_prefix) == holders.keys()  # the O(1) lookup is exact
        assert context._state.engine_refs == {h: n - 1 for h, n in holders.items() if n > 1}
        for stream_key in {s for slot in context.slots.values() for s in slot.streams}:
            assert stream_key in table._stream_slots
    for stream_key, by_rank in table._stream_slots.items():
        assert stream_key in table._sources
        contexts = set()
        for rank, members in by_rank.items():
            for context_key, slot_key in members:
                slot = table.contexts[context_key].slots[slot_key]
                assert stream_key in slot.streams and slot.dp_rank == rank
                contexts.add(context_key)
        assert table._stream_contexts[stream_key] == contexts


def assert_empty(table: PrefixCacheTable) -> None:
    """After every owner left: no context, no registration, no membership, no block."""
    assert table.contexts == {}
    assert table._sources == {}
    assert table._stream_slots == {}
    assert table._stream_contexts == {}
    assert table.block_count() == 0
    assert table.tenants() == set()


def engine_map(context: PrefixContext, tier: Tier = Tier.GPU) -> dict[int, int]:
    """Union of every owner's ``engine hash -> prefix hash`` map on one tier."""
    merged: dict[int, int] = {}
    for slot in context.slots.values():
        merged.update(slot.holdings[tier].by_engine_hash)
    return merged


@pytest.fixture
def table() -> PrefixCacheTable:
    return PrefixCacheTable()


def register(table: PrefixCacheTable, *sources: StreamSource) -> None:
    for source in sources:
        table.add_stream(source)


# -- the Go store scenario, with our fix --------------------------------------------------------
def test_go_store_scenario_with_fixes(table: PrefixCacheTable) -> None:
    """Go's own scenario: steps 1-2 agree with Go, steps 3-4 are the documented fixes.

    Step 3 (``[101, 104]``): 101 is already known; Go does not advance the chain so 104 is
    hashed from the seed. We chain 104 from conductor(101). Step 4 (``[105]``, parent 999):
    Go falls back to the seed and indexes 105 under a wrong chain; we count it as orphaned.
    """
    scenario = VECTORS["store_scenario"]
    steps = scenario["steps"]
    final = {int(k): v for k, v in scenario["final_mapping"].items()}
    register(table, src("vllm-1"))
    key = src("vllm-1").key

    def step(i: int) -> ApplyStats:
        s = steps[i]
        parent = s["parent"] or None  # Go's parent 0 means "no parent"; decoders give None
        return table.apply(key, batch(stored(s["block_hashes"], s["token_ids"], parent)))

    assert step(0).blocks_stored == 2
    assert step(1).blocks_stored == 1
    context = table.contexts[ctx()]
    for engine_hash in (101, 102, 103):
        assert engine_map(context)[engine_hash] == final[engine_hash]

    stats = step(2)
    # 101 again is a second copy (vLLM announces a block each time it caches one), 104 is new
    assert stats.blocks_stored == 2
    fixed_104 = chain_hashes(final[101], steps[2]["token_ids"][BS:], BS)[0]
    assert engine_map(context)[104] == fixed_104 != final[104]
    assert engine_map(context)[101] == final[101]

    stats = step(3)
    assert (stats.orphaned, stats.blocks_stored) == (1, 0)
    assert 105 not in engine_map(context)

    assert prefix_hashes(list(range(1, 13)), BS) == scenario["query_tokens_1_to_12"]
    assert query(table, list(range(1, 13))) == {"vllm-1": (12, 12, 12)}
    assert query(table, [1, 2, 3, 4, 13, 14, 15, 16]) == {"vllm-1": (8, 8, 8)}
    assert context.block_counts() == (4, 0, 0)
    check_invariants(table)


# -- store / query / remove ---------------------------------------------------------------------
def test_store_query_remove_query(table: PrefixCacheTable) -> None:
    """The basic lifecycle; removing a middle block cuts the match there, not at the end."""
    register(table, src("a"))
    stats = table.apply("a|default|0", batch(stored([10, 11, 12], prompt(3))))
    assert (stats.events, stats.blocks_stored) == (1, 3)
    assert query(table, prompt(3)) == {"a": (12, 12, 12)}
    assert query(table, prompt(3) + [99, 99]) == {"a": (12, 12, 12)}  # partial tail ignored
    assert query(table, prompt(2)) == {"a": (8, 8, 8)}
    assert query(table, [7, 7, 7, 7] + toks(1, 2)) == {"a": (0, 0, 0)}

    stats = table.apply("a|default|0", batch(removed([11])))
    assert stats.blocks_removed == 1
    assert query(table, prompt(3)) == {"a": (4, 4, 4)}
    table.apply("a|default|0", batch(removed([10, 12])))
    assert query(table, prompt(3)) == {"a": (0, 0, 0)}
    assert table.block_count() == 0
    check_invariants(table)


def test_remove_of_unknown_or_foreign_hash_is_a_noop(table: PrefixCacheTable) -> None:
    """An owner can only remove what it stored: not another instance's block, nor a ghost."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    stats = table.apply("b|default|0", batch(removed([10, 11, 999])))
    assert stats.blocks_removed == 0
    stats = table.apply("a|default|0", batch(removed([999])))
    assert stats.blocks_removed == 0
    assert query(table, prompt(2)) == {"a": (8, 8, 8), "b": (0, 0, 0)}
    check_invariants(table)


def test_unknown_context_answers_none(table: PrefixCacheTable) -> None:
    """No registration for the model/LoRA/block size: the API turns None into zeros."""
    register(table, src("a"))
    assert table.match_tokens(ctx(lora="nope"), prompt(2)) is None
    assert table.match_tokens(ctx(block_size=16), prompt(4)) is None
    assert table.match_engine_hashes(ctx(tenant="t2"), [1, 2]) is None
    assert query(table, prompt(2)) == {"a": (0, 0, 0)}  # registered: listed with zeros


def test_instance_filter(table: PrefixCacheTable) -> None:
    """A query naming an instance answers for that one only (empty when unknown)."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10], prompt(1))))
    assert query(table, prompt(1), instance_id="a") == {"a": (4, 4, 4)}
    assert query(table, prompt(1), instance_id="b") == {"b": (0, 0, 0)}
    assert query(table, prompt(1), instance_id="zzz") == {}


def test_a_large_fleet_answers_for_every_instance(table: PrefixCacheTable) -> None:
    """Only the instances holding the first block walk the prompt; every other one is listed
    with zeros, and a rank that matched nothing still shows beside its instance's hit."""
    register(table, *(src(f"i{n:03}") for n in range(200)), src("b"), src("b", dp_rank=1))
    table.apply("i007|default|0", batch(stored([70, 71], prompt(2))))
    table.apply("i150|default|0", batch(stored([50], prompt(1))))
    table.apply("b|default|1", batch(stored([80, 81, 82], prompt(3))))
    got = table.match_tokens(ctx(), prompt(3)) or {}
    assert len(got) == 201  # "b" is one instance of two ranks
    assert answer(got) == {
        **{f"i{n:03}": (0, 0, 0) for n in range(200)},
        "i007": (8, 8, 8),
        "i150": (4, 4, 4),
        "b": (12, 12, 12),
    }
    assert got["b"].ranks == {0: (0, 0, 0, 0), 1: (12, 12, 12, 12)}
    assert got["i000"].ranks == {0: (0, 0, 0, 0)}
    # the answers are fresh where something matched: the zero answers stay zero
    assert query(table, toks(9)) == {name: (0, 0, 0) for name in got}
    table.remove_stream("i150|default|0")
    register(table, src("new"))
    assert query(table, prompt(3)).keys() == (got.keys() - {"i150"}) | {"new"}
    check_invariants(table)


def test_a_fleet_of_one_rank_answers_in_instance_id_order_with_shared_answers(
    table: PrefixCacheTable,
) -> None:
    """Every instance one slot of the same DP rank (here 3): each group of instances that
    stopped together gets one shared answer naming that rank; the answer lists instances in
    instance-id order (as Go writes its map) whatever the order they registered in."""
    names = [f"i{n:02}" for n in range(40)]
    register(table, *(src(name, dp_rank=3) for name in reversed(names)))
    for n, name in enumerate(names):  # i00 holds 1 block, i01 2, ... i04 5, i05 1, ...
        depth = n % 5 + 1
        table.apply(
            f"{name}|default|3", batch(stored(range(100 * n, 100 * n + depth), prompt(depth)))
        )
    got = table.match_tokens(ctx(), prompt(4)) or {}
    assert list(got) == names
    assert answer(got) == {name: (min(n % 5 + 1, 4) * BS,) * 3 for n, name in enumerate(names)}
    assert got["i00"] is got["i05"] and got["i03"] is got["i04"]  # 4 blocks: the whole prompt
    assert got["i01"].ranks == {3: (2 * BS,) * 4}
    assert list(table.match_tokens(ctx(), toks(9)) or {}) == names  # nothing held: zeros
    check_invariants(table)


# -- clears and unregistration ------------------------------------------------------------------
def test_all_blocks_cleared_touches_only_that_stream(table: PrefixCacheTable) -> None:
    """An engine's AllBlocksCleared empties its cache, not its peers'; it stays listed."""
    register(table, src("a"), src("b"))
    for key in ("a|default|0", "b|default|0"):
        table.apply(key, batch(stored([10, 11], prompt(2))))
    stats = table.apply("a|default|0", batch(AllBlocksCleared()))
    assert stats.clears == 1
    assert query(table, prompt(2)) == {"a": (0, 0, 0), "b": (8, 8, 8)}
    # the owner may store again after a clear (its engine-hash map was reset too)
    assert table.apply("a|default|0", batch(stored([10], prompt(1)))).blocks_stored == 1
    assert query(table, prompt(2)) == {"a": (4, 4, 4), "b": (8, 8, 8)}
    check_invariants(table)


def test_all_blocks_cleared_only_at_the_batch_dp_rank(table: PrefixCacheTable) -> None:
    """A DP engine clears one rank at a time; the batch's rank says which."""
    register(table, src("a"))
    key = "a|default|0"
    table.apply(key, batch(stored([10, 11], prompt(2)), dp_rank=0))
    table.apply(key, batch(stored([10, 11, 12], prompt(3)), dp_rank=1))
    table.apply(key, batch(AllBlocksCleared(), dp_rank=1))
    result = table.match_tokens(ctx(), prompt(3))
    assert result is not None
    assert result["a"].ranks == {0: (8, 8, 8, 8), 1: (0, 0, 0, 0)}
    # without a batch rank the registration's rank (0) is cleared
    table.apply(key, batch(stored([10, 11, 12], prompt(3)), dp_rank=1))
    table.apply(key, batch(AllBlocksCleared()))
    result = table.match_tokens(ctx(), prompt(3))
    assert result is not None
    assert result["a"].ranks == {0: (0, 0, 0, 0), 1: (12, 12, 12, 12)}
    check_invariants(table)


def test_clear_stream_all_ranks_keeps_membership(table: PrefixCacheTable) -> None:
    """A publisher restart clears every rank of the stream but keeps it listed."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10], prompt(1)), dp_rank=0))
    table.apply("a|default|0", batch(stored([10], prompt(1)), dp_rank=1))
    table.apply("b|default|0", batch(stored([10], prompt(1))))
    assert table.clear_stream("a|default|0") == 2
    assert query(table, prompt(1)) == {"a": (0, 0, 0), "b": (4, 4, 4)}
    assert table.clear_stream("unknown") == 0
    check_invariants(table)


def _populate_everything(table: PrefixCacheTable) -> list[str]:
    """Two engines and a pool with every kind of holding: tiers, ranks, LoRA, extra_refs."""
    a, b = src("a"), src("b", salt="reg-salt")
    pool = src("store", shared_pool=True)
    register(table, a, b, pool)
    table.apply(a.key, batch(stored([10, 11], prompt(2)), stored([12], toks(2), parent=11)))
    table.apply(a.key, batch(stored([20], prompt(1))))  # extra_ref: same prefix as 10
    table.apply(a.key, batch(stored([12], toks(2), parent=11, tier=Tier.CPU)))
    table.apply(a.key, batch(stored([13], toks(3), parent=12, tier=Tier.DISK), dp_rank=1))
    table.apply(a.key, batch(stored([30, 31], prompt(2), lora_name="lora-x")))
    table.apply(b.key, batch(stored([40, 41], prompt(2), salt="req")))
    table.apply(b.key, batch(stored([50, 51], prompt(2))))  # under b's registration salt
    table.apply(pool.key, batch(stored([10, 11], [])))  # token-less, placed via a's hashes
    table.apply(pool.key, batch(stored([12], toks(2), parent=11, tier=Tier.DISK)))
    check_invariants(table)
    assert table.block_count() > 0
    assert ctx(lora="lora-x") in table.contexts
    return [a.key, b.key, pool.key]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_remove_stream_leaves_nothing_behind(
    table: PrefixCacheTable, order: tuple[int, int, int]
) -> None:
    """/unregister drops the owner's blocks; after the last owner the table is empty."""
    keys = _populate_everything(table)
    held = sum(
        len(h.by_engine_hash)
        for context in table.contexts.values()
        for slot in context.slots.values()
        for h in slot.holdings
    )
    dropped = 0
    for i in order:
        dropped += table.remove_stream(keys[i])
        check_invariants(table)
        left = {k for n, k in enumerate(keys) if n in order[order.index(i) + 1 :]}
        assert set(table._sources) == left
        for context in table.contexts.values():
            owners = {s for slot in context.slots.values() for s in slot.streams}
            assert owners <= left
    assert dropped == held
    assert_empty(table)


def test_remove_stream_returns_blocks_dropped_and_is_idempotent(table: PrefixCacheTable) -> None:
    """The count covers every tier and every rank; a second unregister is harmless."""
    register(table, src("a"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    table.apply("a|default|0", batch(stored([10], prompt(1), tier=Tier.CPU), dp_rank=1))
    assert table.remove_stream("a|default|0") == 3
    assert table.remove_stream("a|default|0") == 0
    assert_empty(table)


def test_unregistered_instance_is_not_listed(table: PrefixCacheTable) -> None:
    """A router must never be sent to a dead instance: it disappears from answers."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10], prompt(1))))
    table.remove_stream("a|default|0")
    assert query(table, prompt(1)) == {"b": (0, 0, 0)}
    check_invariants(table)


# -- contexts shared by instances ---------------------------------------------------------------
def test_context_shared_by_instances(table: PrefixCacheTable) -> None:
    """One prefix table per context: two owners of a prefix, each listed with the full match."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    table.apply("b|default|0", batch(stored([10, 11], prompt(2))))
    assert list(table.contexts) == [ctx()]
    assert table.contexts[ctx()].block_counts() == (2, 0, 0)  # shared, not duplicated
    assert query(table, prompt(2)) == {"a": (8, 8, 8), "b": (8, 8, 8)}

    table.remove_stream("a|default|0")
    assert query(table, prompt(2)) == {"b": (8, 8, 8)}
    table.apply("b|default|0", batch(removed([11])))
    assert query(table, prompt(2)) == {"b": (4, 4, 4)}
    check_invariants(table)


def test_parent_known_from_another_owner(table: PrefixCacheTable) -> None:
    """Engine hashes are shared knowledge in a context: b may chain from a's block."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    stats = table.apply("b|default|0", batch(stored([12], toks(2), parent=11)))
    assert (stats.orphaned, stats.blocks_stored) == (0, 1)
    result = table.match_tokens(ctx(), prompt(3))
    assert answer(result) == {"a": (8, 8, 8), "b": (0, 0, 0)}  # b lacks blocks 0-1
    table.apply("b|default|0", batch(stored([10, 11], prompt(2))))
    assert query(table, prompt(3)) == {"a": (8, 8, 8), "b": (12, 12, 12)}


# -- tiers ------------------------------------------------------------------------------------
def _tiered(table: PrefixCacheTable) -> None:
    """Instance a: blocks 0-1 on GPU, 2 on its CPU offload, 3 on DISK."""
    table.apply(
        "a|default|0",
        batch(
            stored([10, 11], prompt(2)),
            stored([12], toks(2), parent=11, tier=Tier.CPU),
            stored([13], toks(3), parent=12, tier=Tier.DISK),
        ),
    )


def test_tiers_are_cumulative(table: PrefixCacheTable) -> None:
    """GPU <= CPU <= DISK: the router reads free, loadable and missing tokens directly."""
    register(table, src("a"))
    _tiered(table)
    assert query(table, prompt(4)) == {"a": (2 * BS, 3 * BS, 4 * BS)}
    assert query(table, prompt(3)) == {"a": (2 * BS, 3 * BS, 3 * BS)}
    # a block lost from the GPU is still loadable from the lower tiers
    table.apply("a|default|0", batch(stored([11], toks(1), parent=10, tier=Tier.CPU)))
    table.apply("a|default|0", batch(removed([11], tier=Tier.GPU)))
    assert query(table, prompt(4)) == {"a": (BS, 3 * BS, 4 * BS)}
    table.apply("a|default|0", batch(removed([12], tier=Tier.CPU)))
    assert query(table, prompt(4)) == {"a": (BS, 2 * BS, 2 * BS)}
    check_invariants(table)


def test_remove_only_touches_the_event_tier(table: PrefixCacheTable) -> None:
    """A GPU eviction keeps the CPU copy of the same engine hash, and vice versa."""
    register(table, src("a"))
    table.apply("a|default|0", batch(stored([10], prompt(1))))
    table.apply("a|default|0", batch(stored([10], prompt(1), tier=Tier.CPU)))
    table.apply("a|default|0", batch(removed([10], tier=Tier.GPU)))
    assert query(table, prompt(1)) == {"a": (0, BS, BS)}
    table.apply("a|default|0", batch(removed([10], tier=Tier.DISK)))
    assert query(table, prompt(1)) == {"a": (0, BS, BS)}
    table.apply("a|default|0", batch(removed([10], tier=Tier.CPU)))
    assert query(table, prompt(1)) == {"a": (0, 0, 0)}
    check_invariants(table)


def test_cpu_block_of_another_instance_does_not_count(table: PrefixCacheTable) -> None:
    """An engine's CPU offload is private: only the shared store is global."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    table.apply("b|default|0", batch(stored([12], toks(2), parent=11, tier=Tier.CPU)))
    table.apply("b|default|0", batch(stored([13], toks(3), parent=12, tier=Tier.DISK)))
    assert query(table, prompt(4)) == {"a": (8, 8, 8), "b": (0, 0, 0)}


def test_cpu_offload_at_another_rank_does_not_count(table: PrefixCacheTable) -> None:
    """cpu(I, r) uses the instance's own offload *at rank r* only."""
    register(table, src("a"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2)), dp_rank=0))
    table.apply("a|default|0", batch(stored([12], toks(2), parent=11, tier=Tier.CPU), dp_rank=1))
    result = table.match_tokens(ctx(), prompt(3))
    assert result is not None
    assert result["a"].ranks == {0: (8, 8, 8, 8), 1: (0, 0, 0, 0)}


def test_shared_pool_counts_for_every_engine_and_is_not_listed(table: PrefixCacheTable) -> None:
    """A Mooncake store pool (default tier CPU) serves every engine instance of the context."""
    register(table, src("a"), src("b"), src("store", shared_pool=True))
    assert src("store", shared_pool=True).default_tier is Tier.CPU
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    table.apply("store|default|0", batch(stored([10, 11, 12], prompt(3))))
    table.apply("store|default|0", batch(stored([13], toks(3), parent=12, tier=Tier.DISK)))
    assert query(table, prompt(5)) == {"a": (8, 12, 16), "b": (0, 12, 16)}
    assert query(table, prompt(4), instance_id="b") == {"b": (0, 12, 16)}

    table.apply("store|default|0", batch(removed([12])))  # default tier CPU for the pool too
    assert query(table, prompt(4)) == {"a": (8, 8, 8), "b": (0, 8, 8)}
    table.remove_stream("store|default|0")
    assert query(table, prompt(4)) == {"a": (8, 8, 8), "b": (0, 0, 0)}
    check_invariants(table)


def test_shared_pool_alone_lists_nobody(table: PrefixCacheTable) -> None:
    """A context with only a store pool has no engine to route to."""
    register(table, src("store", shared_pool=True))
    table.apply("store|default|0", batch(stored([10], prompt(1))))
    assert table.match_tokens(ctx(), prompt(1)) == {}


# -- kv_store pools -----------------------------------------------------------------------------
STORE, OTHER_STORE = "10.0.0.9:50051", "10.0.0.8:50051"


def _kv_fleet(table: PrefixCacheTable) -> None:
    """a and b save to STORE, c to no store, d to OTHER_STORE; a computed prompt(3) and
    saved it to STORE (vLLM's MooncakeStoreConnector: the same hashes, medium "cpu")."""
    register(
        table,
        src("a", kv_store=STORE),
        src("b", kv_store=STORE),
        src("c"),
        src("d", kv_store=OTHER_STORE),
    )
    table.apply("a|default|0", batch(stored([10, 11, 12], prompt(3))))
    table.apply("a|default|0", batch(stored([10, 11, 12], prompt(3), tier=Tier.CPU)))


def test_kv_store_pool_counts_for_its_members_only(table: PrefixCacheTable) -> None:
    """Blocks saved to a store are CPU hits of every instance registered with that store,
    including one that never computed them; not of others, nor listing the pool itself."""
    _kv_fleet(table)
    assert query(table, prompt(3)) == {
        "a": (12, 12, 12),
        "b": (0, 12, 12),
        "c": (0, 0, 0),
        "d": (0, 0, 0),
    }
    assert query(table, prompt(3), instance_id="b") == {"b": (0, 12, 12)}
    context = table.contexts[ctx()]
    assert context.block_counts() == (3, 3, 0)
    pool = context.slots[(STORE, STORE_POOL_RANK)]
    assert pool.holdings[Tier.CPU].count() == 3
    assert context.slots[("a", 0)].holdings[Tier.CPU].count() == 0  # not the engine's own
    assert context.store_pools() == (  # sorted by store
        StorePoolView(OTHER_STORE, 0, ("d",)),
        StorePoolView(STORE, 3, ("a", "b")),
    )
    assert table.store_blocks() == {STORE: 3, OTHER_STORE: 0}
    check_invariants(table)


def test_the_read_api_shows_counts_owners_and_pools_never_slots(table: PrefixCacheTable) -> None:
    """What /global_view, /health and the metrics read: frozen views in creation order."""
    _kv_fleet(table)
    table.add_stream(src("pool", shared_pool=True))
    table.apply("a|default|0", batch(stored([40], prompt(1), lora_name="x")))
    views = table.context_views()
    assert [view.key for view in views] == [ctx(), ctx(lora="x")]
    assert views[0] == ContextView(
        ctx(),
        (3, 3, 0),
        {"a": (0,), "b": (0,), "c": (0,), "d": (0,), "pool": (0,)},  # no kv_store pool
        (StorePoolView(OTHER_STORE, 0, ("d",)), StorePoolView(STORE, 3, ("a", "b"))),
    )
    pool_of_a = StorePoolView(STORE, 0, ("a",))  # a's store serves a in every context
    assert views[1] == ContextView(ctx(lora="x"), (1, 0, 0), {"a": (0,)}, (pool_of_a,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        views[0].blocks = (0, 0, 0)  # type: ignore[misc]
    held = list(table.held_hashes(ctx()))  # the engine's GPU copies, then the store's
    mappings = set(zip([10, 11, 12], prefix_hashes(prompt(3), BS), strict=True))
    assert set(held[:3]) == set(held[3:]) == mappings and len(held) == 6
    assert list(table.held_hashes(ctx(tenant="nobody"))) == []
    assert table.context_count() == 2 and table.store_blocks() == {STORE: 3, OTHER_STORE: 0}


def test_kv_store_pool_removal_needs_a_cpu_medium(table: PrefixCacheTable) -> None:
    """A CPU removal on a member's stream leaves the pool; a removal without medium is the
    engine's own eviction and leaves the store's copy alone."""
    _kv_fleet(table)
    assert table.apply("a|default|0", batch(removed([12], tier=Tier.CPU))).blocks_removed == 1
    assert query(table, prompt(3)) == {
        "a": (12, 12, 12),
        "b": (0, 8, 8),
        "c": (0, 0, 0),
        "d": (0, 0, 0),
    }
    assert table.apply("a|default|0", batch(removed([11]))).blocks_removed == 1
    # a: block 0 on GPU, 1 only in the pool, 2 on GPU again
    assert query(table, prompt(3), instance_id="a") == {"a": (4, 12, 12)}
    assert query(table, prompt(3), instance_id="b") == {"b": (0, 8, 8)}
    # any member's CPU removal reaches the shared pool, at any DP rank
    assert table.apply("b|default|0", batch(removed([11], tier=Tier.CPU), dp_rank=1)).blocks_removed
    assert query(table, prompt(3), instance_id="b") == {"b": (0, 4, 4)}
    # a member of another store cannot remove from this one
    assert not table.apply("d|default|0", batch(removed([10], tier=Tier.CPU))).blocks_removed
    check_invariants(table)


def test_kv_store_pool_survives_clears_restarts_and_unregisters(table: PrefixCacheTable) -> None:
    """The store holds the blocks, not the engine: only the last registration naming the
    store in the context takes the pool with it."""
    _kv_fleet(table)
    table.apply("a|default|0", batch(AllBlocksCleared()))
    assert query(table, prompt(3), instance_id="a") == {"a": (0, 12, 12)}
    assert table.clear_stream("a|default|0") == 0  # restart or lost connection
    assert table.remove_stream("a|default|0") == 0
    assert query(table, prompt(3)) == {"b": (0, 12, 12), "c": (0, 0, 0), "d": (0, 0, 0)}
    check_invariants(table)

    table.remove_stream("b|default|0")
    assert (STORE, STORE_POOL_RANK) not in table.contexts[ctx()].slots
    assert table.contexts[ctx()].block_counts() == (0, 0, 0)
    register(table, src("b", kv_store=STORE))  # a new pool starts empty
    assert query(table, prompt(3), instance_id="b") == {"b": (0, 0, 0)}
    check_invariants(table)


def test_kv_store_pool_keeps_copies_saved_by_two_engines(table: PrefixCacheTable) -> None:
    """One pool entry per block; each engine's save is a copy, so one engine's removal does
    not hide the block the other one saved (under the same or another engine hash)."""
    _kv_fleet(table)
    table.apply("b|default|0", batch(stored([10, 11], prompt(2), tier=Tier.CPU)))
    table.apply("b|default|0", batch(stored([22], toks(2), parent=11, tier=Tier.CPU)))
    assert table.contexts[ctx()].block_counts() == (3, 3, 0)
    table.apply("a|default|0", batch(removed([10, 11, 12], tier=Tier.CPU)))
    assert query(table, prompt(3), instance_id="b") == {"b": (0, 12, 12)}
    table.apply("b|default|0", batch(removed([11], tier=Tier.CPU)))
    assert query(table, prompt(3), instance_id="b") == {"b": (0, 4, 4)}
    check_invariants(table)


def test_clear_store_empties_that_store_in_every_context(table: PrefixCacheTable) -> None:
    """A restarted master lost every block: its pools empty in every context, the engines'
    own blocks, other stores and the memberships stay."""
    _kv_fleet(table)
    register(table, src("e", tenant="t2", kv_store=STORE))
    table.apply("e|t2|0", batch(stored([30, 31], prompt(2), tier=Tier.CPU)))
    table.apply("a|default|0", batch(stored([40], prompt(1), tier=Tier.CPU, lora_name="x")))
    table.apply("d|default|0", batch(stored([10], prompt(1), tier=Tier.CPU)))
    assert table.clear_store(STORE) == 3 + 2 + 1
    assert query(table, prompt(3)) == {
        "a": (12, 12, 12),
        "b": (0, 0, 0),
        "c": (0, 0, 0),
        "d": (0, 4, 4),
    }
    assert query(table, prompt(2), ctx(tenant="t2")) == {"e": (0, 0, 0)}
    assert query(table, prompt(1), ctx(lora="x")) == {"a": (0, 0, 0)}
    assert table.clear_store(STORE) == 0
    assert table.clear_store("nowhere:1") == 0
    table.apply("a|default|0", batch(stored([10], prompt(1), tier=Tier.CPU)))
    assert query(table, prompt(1), instance_id="b") == {"b": (0, 4, 4)}
    check_invariants(table)


def test_store_check_drops_what_the_store_lacks_unless_announced_during_it(
    table: PrefixCacheTable,
) -> None:
    """The store evicts without an event: a check's key list drops every pool block it
    lacks (all copies of it), except blocks announced after the check began, which the
    list may predate. Engines' own blocks and other stores are not touched."""
    _kv_fleet(table)
    table.apply("b|default|0", batch(stored([10], prompt(1), tier=Tier.CPU)))  # a copy
    table.apply("d|default|0", batch(stored([10], prompt(1), tier=Tier.CPU)))
    table.begin_store_check(STORE)
    # while the answer travels, b saves block 3 and a saves block 1 again
    table.apply("b|default|0", batch(stored([13], toks(3), parent=12, tier=Tier.CPU)))
    table.apply("a|default|0", batch(stored([11], toks(1), parent=10, tier=Tier.CPU)))
    assert sum(table.reconcile_store(STORE, {11, 999})) == 2  # 10 (both copies) and 12
    table.end_store_check(STORE)
    pool = table.contexts[ctx()].slots[(STORE, STORE_POOL_RANK)].holdings[Tier.CPU]
    assert set(pool.by_engine_hash) == {11, 13} and pool.copies == {11: 1}
    assert query(table, prompt(4)) == {
        "a": (12, 16, 16),  # its GPU blocks 0-2, then block 3 from the store
        "b": (0, 0, 0),
        "c": (0, 0, 0),
        "d": (0, 4, 4),
    }
    check_invariants(table)
    table.begin_store_check(STORE)  # announced before this check: judged by its answer
    assert sum(table.reconcile_store(STORE, {11}, step=1)) == 1
    table.end_store_check(STORE)
    assert set(pool.by_engine_hash) == {11}
    check_invariants(table)


def test_store_check_yields_and_keeps_what_is_announced_between_its_steps(
    table: PrefixCacheTable,
) -> None:
    """A check of a big pool runs in steps the service interleaves with events: a block
    saved again between two steps is kept, one removed between them is not counted, and a
    pool whose last registration left ends the check."""
    _kv_fleet(table)
    table.begin_store_check(STORE)
    steps = table.reconcile_store(STORE, set(), step=1)
    assert next(steps) == 1  # block 10
    table.apply("a|default|0", batch(stored([11], toks(1), parent=10, tier=Tier.CPU)))
    table.apply("a|default|0", batch(removed([12], tier=Tier.CPU)))
    assert list(steps) == [0, 0]  # 11 was saved again while the check ran, 12 is gone
    table.end_store_check(STORE)
    pool = table.contexts[ctx()].slots[(STORE, STORE_POOL_RANK)].holdings[Tier.CPU]
    assert set(pool.by_engine_hash) == {11}
    check_invariants(table)

    table.begin_store_check(STORE)
    steps = table.reconcile_store(STORE, set(), step=1)
    assert next(steps) == 1
    table.remove_stream("a|default|0")
    table.remove_stream("b|default|0")
    assert list(steps) == []
    check_invariants(table)


def test_store_down_empties_its_pools_and_drops_its_cpu_events(table: PrefixCacheTable) -> None:
    """A failed check: the store may be gone or restart empty. Its pools are emptied, its
    members' CPU blocks dropped (counted) until a check answers; GPU blocks and other
    stores go on. The last registration naming the store takes the down state with it."""
    _kv_fleet(table)
    assert table.store_down(STORE) == 3
    assert query(table, prompt(3)) == {
        "a": (12, 12, 12),
        "b": (0, 0, 0),
        "c": (0, 0, 0),
        "d": (0, 0, 0),
    }
    stats = table.apply("b|default|0", batch(stored([10, 11], prompt(2), tier=Tier.CPU)))
    assert (stats.blocks_stored, stats.dropped) == (0, {"kv_store_down": 1})
    assert table.apply("b|default|0", batch(stored([10], prompt(1)))).blocks_stored == 1
    assert table.apply("d|default|0", batch(stored([10], prompt(1), tier=Tier.CPU))).blocks_stored
    assert sum(table.reconcile_store(STORE, set())) == 0  # it answers again
    assert table.apply("a|default|0", batch(stored([10], prompt(1), tier=Tier.CPU))).blocks_stored
    assert query(table, prompt(1), instance_id="c") == {"c": (0, 0, 0)}
    assert query(table, prompt(3), instance_id="b") == {"b": (4, 4, 4)}
    check_invariants(table)

    table.store_down(STORE)
    table.remove_stream("a|default|0")
    assert table.stores_down == {STORE}  # b still names it
    table.remove_stream("b|default|0")
    assert table.stores_down == set()
    register(table, src("b", kv_store=STORE))
    assert table.apply("b|default|0", batch(stored([10], prompt(1), tier=Tier.CPU))).blocks_stored
    check_invariants(table)


def test_kv_store_pool_and_mooncake_pool_combine(table: PrefixCacheTable) -> None:
    """A Mooncake pool still serves everybody; a block in both pools counts once each."""
    _kv_fleet(table)
    register(table, src("store", shared_pool=True))
    table.apply("store|default|0", batch(stored([10, 11, 12, 13], prompt(4), tier=Tier.DISK)))
    table.apply("store|default|0", batch(stored([10, 11], [])))  # CPU, held by both pools
    assert query(table, prompt(4)) == {
        "a": (12, 12, 16),
        "b": (0, 12, 16),
        "c": (0, 8, 16),
        "d": (0, 8, 16),
    }
    check_invariants(table)


def test_kv_store_pool_membership_is_per_slot(table: PrefixCacheTable) -> None:
    """Every DP rank of a member sees the pool, a recycled bit inherits no membership, and
    an engine's blocks may chain from a block only the pool holds."""
    _kv_fleet(table)
    table.apply("b|default|0", batch(stored([10], prompt(1)), dp_rank=1))
    result = table.match_tokens(ctx(), prompt(3))
    assert result is not None
    assert result["b"].ranks == {0: (0, 0, 12, 12), 1: (4, 4, 12, 12)}  # the pool: shared
    freed = {table.contexts[ctx()].slots[("b", rank)].index for rank in (0, 1)}
    table.remove_stream("b|default|0")
    register(table, src("f"))
    assert table.contexts[ctx()].slots[("f", 0)].index in freed
    assert query(table, prompt(3), instance_id="f") == {"f": (0, 0, 0)}
    table.apply("a|default|0", batch(AllBlocksCleared()))
    stats = table.apply("c|default|0", batch(stored([13], toks(3), parent=12)))
    assert (stats.orphaned, stats.blocks_stored) == (0, 1)
    check_invariants(table)


# -- DP ranks -----------------------------------------------------------------------------------
def test_batch_dp_rank_overrides_registration(table: PrefixCacheTable) -> None:
    """Per-rank values and the max over ranks; removal follows the batch rank too."""
    register(table, src("a", dp_rank=0))
    key = "a|default|0"
    table.apply(key, batch(stored([10], prompt(1))))  # registration rank 0
    table.apply(key, batch(stored([10, 11, 12], prompt(3)), dp_rank=1))
    table.apply(key, batch(stored([10, 11], prompt(2), tier=Tier.CPU), dp_rank=2))
    result = table.match_tokens(ctx(), prompt(3))
    assert result is not None
    match = result["a"]
    assert match.ranks == {0: (4, 4, 4, 4), 1: (12, 12, 12, 12), 2: (0, 8, 8, 8)}
    assert (match.gpu, match.cpu_local, match.cpu, match.disk) == (12, 12, 12, 12)

    assert table.apply(key, batch(removed([11]), dp_rank=0)).blocks_removed == 0
    assert table.apply(key, batch(removed([11]), dp_rank=1)).blocks_removed == 1
    result = table.match_tokens(ctx(), prompt(3))
    assert result is not None
    assert result["a"].ranks == {0: (4, 4, 4, 4), 1: (4, 4, 4, 4), 2: (0, 8, 8, 8)}
    assert answer(result) == {"a": (4, 8, 8)}
    check_invariants(table)


def test_registration_dp_rank_is_the_default(table: PrefixCacheTable) -> None:
    """A stream registered at rank 3 stores at rank 3 when the batch says nothing."""
    register(table, src("a", dp_rank=3))
    table.apply("a|default|3", batch(stored([10], prompt(1))))
    result = table.match_tokens(ctx(), prompt(1))
    assert result is not None
    assert result["a"].ranks == {3: (4, 4, 4, 4)}


# -- salts, tenants, LoRA -----------------------------------------------------------------------
def test_event_salt_overrides_registration_salt(table: PrefixCacheTable) -> None:
    """A per-request salt roots the chain; the query's cache_salt selects that root."""
    register(table, src("a", salt="reg"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2), salt="req")))
    assert query(table, prompt(2), salt="req") == {"a": (8, 8, 8)}
    assert query(table, prompt(2), salt="reg") == {"a": (0, 0, 0)}
    assert query(table, prompt(2)) == {"a": (0, 0, 0)}
    context = table.contexts[ctx()]
    assert engine_map(context)[10] == chain_hashes(salt_root("req"), prompt(1), BS)[0]


def test_registration_salt_roots_unsalted_events(table: PrefixCacheTable) -> None:
    """An event without its own salt uses the registration's additionalsalt."""
    register(table, src("a", salt="reg"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    assert query(table, prompt(2), salt="reg") == {"a": (8, 8, 8)}
    assert query(table, prompt(2)) == {"a": (0, 0, 0)}
    # the chain continues from the parent's mapping, whatever the continuation's salt says
    table.apply("a|default|0", batch(stored([12], toks(2), parent=11, salt="other")))
    assert query(table, prompt(3), salt="reg") == {"a": (12, 12, 12)}


def test_cache_salt_matches_only_its_chain(table: PrefixCacheTable) -> None:
    """Two requests with different salts share no block even with identical tokens."""
    register(table, src("a"), src("b"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2), salt="s1")))
    table.apply("b|default|0", batch(stored([20, 21], prompt(2), salt="s2")))
    assert query(table, prompt(2), salt="s1") == {"a": (8, 8, 8), "b": (0, 0, 0)}
    assert query(table, prompt(2), salt="s2") == {"a": (0, 0, 0), "b": (8, 8, 8)}
    assert query(table, prompt(2)) == {"a": (0, 0, 0), "b": (0, 0, 0)}


def test_tenants_are_isolated(table: PrefixCacheTable) -> None:
    """Same tokens under tenant A are invisible to tenant B (Go forces 'default': bug)."""
    register(table, src("a", tenant="A"), src("b", tenant="B"))
    table.apply("a|A|0", batch(stored([10, 11], prompt(2))))
    assert query(table, prompt(2), ctx(tenant="A")) == {"a": (8, 8, 8)}
    assert query(table, prompt(2), ctx(tenant="B")) == {"b": (0, 0, 0)}
    assert table.tenants() == {"A", "B"}
    # the engine hashes of A are not usable by B either (no cross-tenant parent)
    stats = table.apply("b|B|0", batch(stored([12], toks(2), parent=11)))
    assert stats.orphaned == 1
    assert table.apply("b|B|0", batch(stored([10], []))).dropped == {
        "unknown_block_without_tokens": 1
    }


def test_same_instance_in_two_tenants(table: PrefixCacheTable) -> None:
    """One instance registered for two tenants holds two independent memberships."""
    register(table, src("a", tenant="A"), src("a", tenant="B"))
    table.apply("a|A|0", batch(stored([10], prompt(1))))
    assert query(table, prompt(1), ctx(tenant="B")) == {"a": (0, 0, 0)}
    table.remove_stream("a|A|0")
    assert list(table.contexts) == [ctx(tenant="B")]
    check_invariants(table)


def test_lora_event_uses_the_lora_context(table: PrefixCacheTable) -> None:
    """An event's lora_name places its blocks in (tenant, model, that LoRA, block size)."""
    register(table, src("a"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2), lora_name="lora-x")))
    assert query(table, prompt(2), ctx(lora="lora-x")) == {"a": (8, 8, 8)}
    assert query(table, prompt(2)) == {"a": (0, 0, 0)}
    # the LoRA's removal reaches the LoRA context through the stream's membership
    assert table.apply("a|default|0", batch(removed([11]))).blocks_removed == 1
    assert query(table, prompt(2), ctx(lora="lora-x")) == {"a": (4, 4, 4)}
    table.apply("a|default|0", batch(AllBlocksCleared()))
    assert query(table, prompt(2), ctx(lora="lora-x")) == {"a": (0, 0, 0)}
    table.remove_stream("a|default|0")
    assert_empty(table)


def test_registration_lora_is_the_default(table: PrefixCacheTable) -> None:
    """A stream registered for a LoRA indexes unlabelled events under that LoRA."""
    register(table, src("a", lora="lora-y"))
    table.apply("a|default|0", batch(stored([10], prompt(1))))
    assert query(table, prompt(1), ctx(lora="lora-y")) == {"a": (4, 4, 4)}
    assert table.match_tokens(ctx(), prompt(1)) is None


# -- orphans, known blocks, duplicate engine hashes ----------------------------------------------
def test_orphan_parent_is_counted_not_indexed(table: PrefixCacheTable) -> None:
    """An unknown parent would put the block under a wrong chain: count it, index nothing."""
    register(table, src("a"))
    stats = table.apply(
        "a|default|0",
        batch(stored([12, 13], toks(2, 2), parent=11), stored([10], prompt(1))),
    )
    assert (stats.events, stats.orphaned, stats.blocks_stored) == (2, 1, 1)
    assert 12 not in engine_map(table.contexts[ctx()])
    # once the parent is known, the same event is placed under the right chain
    table.apply("a|default|0", batch(stored([11], toks(1), parent=10)))
    table.apply("a|default|0", batch(stored([12, 13], toks(2, 2), parent=11)))
    assert query(table, prompt(4)) == {"a": (16, 16, 16)}
    check_invariants(table)


def test_removed_parent_makes_an_orphan(table: PrefixCacheTable) -> None:
    """A parent no owner holds any more is unknown: the mapping dies with the last owner."""
    register(table, src("a"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2)), removed([11])))
    stats = table.apply("a|default|0", batch(stored([12], toks(2), parent=11)))
    assert stats.orphaned == 1


def test_restoring_known_blocks_counts_copies_and_advances_the_chain(
    table: PrefixCacheTable,
) -> None:
    """Go's stale-parent bug: a new block after known ones must chain from the last known.
    A block stored again is a second physical copy (vLLM announces each one and evicts each
    one alone), so it stays indexed until every copy is removed."""
    register(table, src("a"))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    context = table.contexts[ctx()]
    before = (dict(engine_map(context)), context.block_counts())
    stats = table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    assert stats.blocks_stored == 2
    assert (engine_map(context), context.block_counts()) == before

    stats = table.apply("a|default|0", batch(stored([10, 11, 12], prompt(3))))
    assert stats.blocks_stored == 3
    assert engine_map(context)[12] == prefix_hashes(prompt(3), BS)[2]
    assert query(table, prompt(3)) == {"a": (12, 12, 12)}
    # block 11 was stored three times: it goes only with its third removal
    for removals in range(1, 4):
        table.apply("a|default|0", batch(removed([11])))
        expected = (12, 12, 12) if removals < 3 else (4, 4, 4)
        assert query(table, prompt(3)) == {"a": expected}
    check_invariants(table)


def test_same_prefix_under_two_engine_hashes(table: PrefixCacheTable) -> None:
    """extra_refs: the block stays while either engine hash of the owner still holds it."""
    register(table, src("a"))
    key = "a|default|0"
    assert table.apply(key, batch(stored([10], prompt(1)))).blocks_stored == 1
    assert table.apply(key, batch(stored([20], prompt(1)))).blocks_stored == 1
    context = table.contexts[ctx()]
    assert context.block_counts() == (1, 0, 0)
    holdings = context.slots[("a", 0)].holdings[Tier.GPU]
    assert holdings.extra_refs == {prefix_hashes(prompt(1), BS)[0]: 1}
    check_invariants(table)

    table.apply(key, batch(removed([10])))
    assert query(table, prompt(1)) == {"a": (4, 4, 4)}
    assert holdings.extra_refs == {}
    table.apply(key, batch(removed([20])))
    assert query(table, prompt(1)) == {"a": (0, 0, 0)}
    assert holdings.by_engine_hash == {} and holdings.extra_refs == {}
    assert context.blocks == ({}, {}, {})
    # the reverse order and a third alias behave the same
    table.apply(key, batch(stored([10], prompt(1)), stored([20], prompt(1))))
    table.apply(key, batch(stored([30], prompt(1))))
    assert holdings.extra_refs == {prefix_hashes(prompt(1), BS)[0]: 2}
    table.apply(key, batch(removed([30, 20])))
    assert query(table, prompt(1)) == {"a": (4, 4, 4)}
    table.apply(key, batch(removed([10])))
    assert context.blocks == ({}, {}, {})
    check_invariants(table)


def test_clear_with_extra_refs_leaves_nothing(table: PrefixCacheTable) -> None:
    """AllBlocksCleared resets the duplicate counts too, so later stores start fresh."""
    register(table, src("a"))
    key = "a|default|0"
    table.apply(key, batch(stored([10], prompt(1)), stored([20], prompt(1))))
    table.apply(key, batch(AllBlocksCleared()))
    holdings = table.contexts[ctx()].slots[("a", 0)].holdings[Tier.GPU]
    assert holdings.by_engine_hash == {} and holdings.extra_refs == {}
    table.apply(key, batch(stored([10], prompt(1))))
    table.apply(key, batch(removed([10])))
    assert query(table, prompt(1)) == {"a": (0, 0, 0)}
    check_invariants(table)


# -- token-less events --------------------------------------------------------------------------
def test_tokenless_event_placed_through_known_engine_hashes(table: PrefixCacheTable) -> None:
    """A store tier that sends only hashes: placed where an engine indexed them with tokens."""
    register(table, src("a"), src("store", shared_pool=True))
    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    table.apply("a|default|0", batch(removed([11])))  # a keeps block 0 on GPU only
    table.apply("a|default|0", batch(stored([11], toks(1), parent=10, tier=Tier.DISK)))
    stats = table.apply("store|default|0", batch(stored([10, 11], [])))
    assert (stats.blocks_stored, stats.dropped) == (2, {})
    assert query(table, prompt(2)) == {"a": (4, 8, 8)}


def test_tokenless_event_with_unknown_hash_is_dropped(table: PrefixCacheTable) -> None:
    """Never guess a chain: unknown first hash drops the event, a later one stops placement."""
    register(table, src("a"), src("store", shared_pool=True))
    stats = table.apply("store|default|0", batch(stored([10], [])))
    assert (stats.blocks_stored, stats.dropped) == (0, {"unknown_block_without_tokens": 1})

    table.apply("a|default|0", batch(stored([10, 11], prompt(2))))
    stats = table.apply("store|default|0", batch(stored([10, 99, 11], [])))
    assert stats.blocks_stored == 1
    assert stats.dropped == {"unknown_block_without_tokens": 1}
    context = table.contexts[ctx()]
    assert engine_map(context, Tier.CPU) == {10: prefix_hashes(prompt(1), BS)[0]}
    check_invariants(table)


# -- malformed events ---------------------------------------------------------------------------
def test_block_size_mismatch_dropped(table: PrefixCacheTable) -> None:
    """An event of another block size cannot be placed in this context."""
    register(table, src("a"))
    stats = table.apply("a|default|0", batch(stored([10], toks(0, 4), block_size=16)))
    assert stats.dropped == {"block_size_mismatch": 1}
    assert stats.foreign_block_size == 16  # for the service's warning and /health
    stats = table.apply("a|default|0", batch(stored([10], prompt(1), block_size=BS)))
    assert stats.blocks_stored == 1  # an explicit, equal block size is fine
    assert stats.foreign_block_size is None
    assert ctx(block_size=16) not in table.contexts


@pytest.mark.parametrize("n_tokens", [1, BS - 1, BS + 1, 2 * BS])
def test_token_count_mismatch_dropped(table: PrefixCacheTable, n_tokens: int) -> None:
    """Tokens must cover exactly the stored blocks (Go panics or silently truncates)."""
    register(table, src("a"))
    stats = table.apply("a|default|0", batch(stored([10], list(range(n_tokens)))))
    assert stats.dropped == {"token_count_mismatch": 1}
    assert table.block_count() == 0


def test_secondary_kv_group_ignored(table: PrefixCacheTable) -> None:
    """group_idx != 0 (sliding window etc.) is no reusable prefix; group 0/None is."""
    register(table, src("a"))
    stats = table.apply("a|default|0", batch(stored([10], prompt(1), group_idx=1)))
    assert (stats.ignored, stats.blocks_stored) == (1, 0)
    assert table.apply("a|default|0", batch(stored([10], prompt(1), group_idx=0))).blocks_stored
    stats = table.apply("a|default|0", batch(removed([10], group_idx=1)))
    assert (stats.ignored, stats.blocks_removed) == (1, 0)
    assert query(table, prompt(1)) == {"a": (4, 4, 4)}


def test_empty_store_ignored(table: PrefixCacheTable) -> None:
    register(table, src("a"))
    stats = table.apply("a|default|0", batch(stored([], [])))
    assert (stats.ignored, stats.blocks_stored) == (1, 0)


@pytest.mark.parametrize(
    "bad_tokens",
    [
        ["x", 1, 2, 3],
        [1, 2, 3, None],
        [1.5, 2, 3, 4],
        [2**40, "x", 3, 4],  # the int32-wrap fallback must fail cleanly too
        [b"ab", 2, 3, 4],
    ],
)
def test_bad_token_types_cannot_make_an_event(bad_tokens: list[Any]) -> None:
    """An event holds its tokens as int32 values, so one with anything else cannot reach the
    index: it is refused where it is made (the decoders reject and count such an event and
    apply the rest of its batch: test_wire.py)."""
    with pytest.raises(TypeError, match="token ids must be integers"):
        stored([11, 12], bad_tokens + toks(2), parent=10)


def test_dropped_event_leaves_no_trace(table: PrefixCacheTable) -> None:
    """A malformed event must not create a context nor list the instance for its LoRA."""
    register(table, src("a"))
    bad_event = stored([10], [1, 2, 3], lora_name="bogus")  # token_count_mismatch
    stats = table.apply("a|default|0", batch(bad_event))
    assert sum(stats.dropped.values()) == 1
    assert table.match_tokens(ctx(lora="bogus"), prompt(1)) is None
    assert list(table.contexts) == [ctx()]


# -- match by engine hashes ---------------------------------------------------------------------
def test_match_engine_hashes_equals_match_tokens(table: PrefixCacheTable) -> None:
    """/query_by_hash and /query answer the same for the same prompt."""
    register(table, src("a"), src("b"), src("store", shared_pool=True))
    _tiered(table)
    table.apply("b|default|0", batch(stored([10], prompt(1))))
    table.apply("store|default|0", batch(stored([10, 11, 12], [])))
    engine = [10, 11, 12, 13]
    for n in range(5):
        by_hash = table.match_engine_hashes(ctx(), engine[:n])
        by_tokens = table.match_tokens(ctx(), prompt(n))
        assert by_hash == by_tokens
    assert answer(table.match_engine_hashes(ctx(), engine)) == {
        "a": (8, 12, 16),
        "b": (4, 12, 12),
    }
    # an unknown hash stops the walk exactly like an unknown prompt block
    assert answer(table.match_engine_hashes(ctx(), [10, 999, 12])) == {
        "a": (4, 4, 4),
        "b": (4, 4, 4),
    }
    assert answer(table.match_engine_hashes(ctx(), engine, instance_id="b")) == {"b": (4, 12, 12)}


# -- randomized model check ---------------------------------------------------------------------
MC_BS = 2
MC_BLOCKS = 4
MC_ENGINES = ("i0", "i1", "i2")
MC_POOL = "pool"
MC_STORES = ("", "s1:1", "s2:2")  # an engine registers with no store or one of two
Prefix = tuple[tuple[int, ...], ...]


def mc_engine_hash(prefix: Prefix, variant: int) -> int:
    """Deterministic engine hash of a token prefix; two variants exercise extra_refs."""
    return xxhash.xxh64_intdigest(repr((prefix, variant)).encode(), seed=12345)


@dataclass
class ReferenceModel:
    """Naive index: (instance, rank, tier) -> {engine hash: token prefix}, nothing clever.

    ``ranks`` are the (instance, DP rank) pairs the conductor knows: the registration's rank
    and every rank a batch stored at, until the stream is unregistered. ``stores`` is each
    registered engine's kv_store; the CPU blocks it saves are held under ``store_key``,
    except while that store is ``down``. ``announced`` collects, per store key, the blocks
    saved since the store's running check began.
    """

    registered: set[str] = field(default_factory=set)
    stores: dict[str, str] = field(default_factory=dict)
    ranks: set[tuple[str, int]] = field(default_factory=set)
    held: dict[tuple[str, int, Tier], dict[int, Prefix]] = field(default_factory=dict)
    copies: Counter[tuple[str, int, Tier, int]] = field(default_factory=Counter)
    down: set[str] = field(default_factory=set)
    announced: dict[tuple[str, int, Tier], set[int]] = field(default_factory=dict)

    def hold(self, key: tuple[str, int, Tier], engine_hash: int, prefix: Prefix) -> None:
        """A block stored again is one more copy of it."""
        if key in self.announced:
            self.announced[key].add(engine_hash)
        holdings = self.held.setdefault(key, {})
        if engine_hash in holdings:
            self.copies[(*key, engine_hash)] += 1
        else:
            holdings[engine_hash] = prefix

    @staticmethod
    def store_key(kv_store: str) -> tuple[str, int, Tier]:
        return (f"store {kv_store}", -1, Tier.CPU)

    def drops(self, instance: str, tier: Tier) -> bool:
        """A CPU block of a member of a store that is down is not indexed."""
        return tier is Tier.CPU and self.stores.get(instance, "") in self.down

    def target(self, instance: str, rank: int, tier: Tier) -> tuple[str, int, Tier]:
        """Where a stored block goes: CPU blocks of a store's member into the store."""
        kv_store = self.stores.get(instance, "")
        return self.store_key(kv_store) if tier is Tier.CPU and kv_store else (instance, rank, tier)

    def all_held(self) -> dict[int, Prefix]:
        merged: dict[int, Prefix] = {}
        for holdings in self.held.values():
            merged.update(holdings)
        return merged

    def store_prefixes(self, instance: str) -> set[Prefix]:
        """What the instance's kv_store holds (nothing without one)."""
        kv_store = self.stores.get(instance, "")
        return set(self.held.get(self.store_key(kv_store), {}).values()) if kv_store else set()

    def prefixes(self, instance: str, rank: int, tiers: Iterable[Tier]) -> set[Prefix]:
        return {p for t in tiers for p in self.held.get((instance, rank, t), {}).values()}

    def pool_prefixes(self, tiers: Iterable[Tier]) -> set[Prefix]:
        tiers = tuple(tiers)
        return {
            p
            for (instance, _, tier), holdings in self.held.items()
            if instance == MC_POOL and tier in tiers
            for p in holdings.values()
        }

    def store(
        self,
        instance: str,
        rank: int,
        tier: Tier,
        blocks: list[tuple[int, Prefix]],
        parent_hash: int | None,
    ) -> bool:
        """A parent engine hash no owner holds makes an orphan: returns False, stores nothing
        (and, being rejected, does not make the rank known)."""
        if parent_hash is not None and parent_hash not in self.all_held():
            return False
        self.ranks.add((instance, rank))
        for engine_hash, prefix in blocks:
            self.hold(self.target(instance, rank, tier), engine_hash, prefix)
        return True

    def store_tokenless(
        self, instance: str, rank: int, tier: Tier, engine_hashes: list[int]
    ) -> int:
        known = self.all_held()
        placed = 0
        for engine_hash in engine_hashes:
            if engine_hash not in known:
                break
            self.hold(self.target(instance, rank, tier), engine_hash, known[engine_hash])
            placed += 1
        if placed:
            self.ranks.add((instance, rank))
        return placed

    def remove(self, instance: str, rank: int, tier: Tier | None, engine_hashes: list[int]) -> None:
        """A removal that names no medium removes the block from every tier of the engine
        (not from its store: only a CPU medium reaches that)."""
        keys = [(instance, rank, t) for t in Tier] if tier is None else []
        for key in keys or [self.target(instance, rank, tier)]:
            holdings = self.held.get(key, {})
            for engine_hash in engine_hashes:
                if self.copies[(*key, engine_hash)] > 0:
                    self.copies[(*key, engine_hash)] -= 1
                else:
                    holdings.pop(engine_hash, None)

    def clear(self, instance: str, rank: int | None) -> None:
        for (i, r, _), holdings in self.held.items():
            if i == instance and (rank is None or r == rank):
                holdings.clear()
        for key in [k for k in self.copies if k[0] == instance and rank in (None, k[1])]:
            del self.copies[key]

    def clear_store(self, kv_store: str) -> None:
        key = self.store_key(kv_store)
        self.held.pop(key, None)
        for copy in [c for c in self.copies if c[:3] == key]:
            del self.copies[copy]

    def reconcile(self, kv_store: str, present: set[int]) -> int:
        """A check answered: blocks neither in its key list nor announced since it began go
        (every copy); the store is up."""
        key = self.store_key(kv_store)
        keep = present | self.announced.get(key, set())
        holdings = self.held.get(key, {})
        gone = [h for h in holdings if h not in keep]
        for engine_hash in gone:
            del holdings[engine_hash]
            self.copies.pop((*key, engine_hash), None)
        self.down.discard(kv_store)
        return len(gone)

    def register(self, instance: str, kv_store: str) -> None:
        self.registered.add(instance)
        self.stores[instance] = kv_store
        self.ranks.add((instance, 0))

    def unregister(self, instance: str) -> None:
        """A store's blocks go with the last registration naming it."""
        self.clear(instance, None)
        self.registered.discard(instance)
        kv_store = self.stores.pop(instance)
        if kv_store and kv_store not in self.stores.values():
            self.clear_store(kv_store)
            self.down.discard(kv_store)
            self.announced.pop(self.store_key(kv_store), None)
        self.ranks = {(i, r) for i, r in self.ranks if i != instance}

    def answer(self, query: list[Prefix | None]) -> dict[str, dict[int, TierHits]]:
        """Per engine instance and rank, the cumulative (GPU, own CPU, any CPU, DISK) match
        in tokens."""

        def run(available: set[Prefix]) -> int:
            n = 0
            for prefix in query:
                if prefix is None or prefix not in available:
                    break
                n += 1
            return n * MC_BS

        pool_cpu = self.pool_prefixes([Tier.CPU])
        pool_disk = self.pool_prefixes([Tier.CPU, Tier.DISK])
        result: dict[str, dict[int, TierHits]] = {}
        for instance, rank in self.ranks:
            if instance == MC_POOL:
                continue
            gpu = self.prefixes(instance, rank, [Tier.GPU])
            own_cpu = gpu | self.prefixes(instance, rank, [Tier.CPU])
            cpu = own_cpu | self.store_prefixes(instance) | pool_cpu
            disk = cpu | self.prefixes(instance, rank, [Tier.DISK]) | pool_disk
            hits = (run(gpu), run(own_cpu), run(cpu), run(disk))
            result.setdefault(instance, {})[rank] = hits
        return result


def _compare(
    got: dict[str, InstanceMatch] | None,
    want: dict[str, dict[int, TierHits]],
    where: str,
) -> None:
    got = got or {}
    assert set(got) == set(want), where
    for instance, ranks in want.items():
        match = got[instance]
        assert match.ranks == ranks, where
        best = tuple(max(v[t] for v in ranks.values()) for t in range(4))
        assert (match.gpu, match.cpu_local, match.cpu, match.disk) == best, where
        assert match.gpu <= match.cpu_local <= match.cpu <= match.disk, where


def _mc_prompts(rng: random.Random, count: int) -> list[Prefix]:
    """Prompts over a tiny block alphabet, so prefixes are shared often."""
    alphabet = [tuple(rng.randrange(1000) for _ in range(MC_BS)) for _ in range(3)]
    return [tuple(rng.choice(alphabet) for _ in range(MC_BLOCKS)) for _ in range(count)]


def _flat(blocks: Iterable[tuple[int, ...]]) -> list[int]:
    return [t for block in blocks for t in block]


class ModelCheck:
    """Drives the table and the reference model with the same random operations."""

    ENGINE_TIERS = (None, Tier.GPU, Tier.GPU, Tier.CPU, Tier.DISK)  # GPU most often
    POOL_TIERS = (None, Tier.CPU, Tier.DISK)  # a pool's GPU blocks have no defined meaning
    OPS = ("store", "tokenless", "remove", "clear", "toggle", "clear_store", "restart", "check")
    OP_WEIGHTS = (45, 10, 30, 5, 5, 2, 2, 5)

    def __init__(self, seed: int, lane: bool = False, fillers: int = 0) -> None:
        self.seed = seed
        self.lane = lane
        self.rng = random.Random(seed)
        self.prompts = _mc_prompts(self.rng, 8)
        self.table = PrefixCacheTable()
        self.model = ReferenceModel()
        self.context_key = ContextKey("default", MODEL, "", MC_BS)
        self.sources = {
            i: StreamSource(f"{i}|default|0", i, "default", MODEL, "", MC_BS, 0, "", i == MC_POOL)
            for i in (*MC_ENGINES, MC_POOL)
        }
        # engines that hold nothing, registered first: the others' bits are high (wide masks)
        self.fillers = [
            StreamSource(f"filler{n:02d}|default|0", f"filler{n:02d}", "default", MODEL, "", MC_BS)
            for n in range(fillers)
        ]
        for filler in self.fillers:
            self.table.add_stream(filler)
            self.model.register(filler.instance_id, "")
        self.seen: Counter[str] = Counter()  # proves the run reached the interesting cases

    # -- one random operation ---------------------------------------------------------------
    def step(self, saver: str | None = None) -> str:
        """One random operation; ``saver`` (during a store check) makes it a save of that
        registered instance to its store half of the time."""
        rng = self.rng
        instance = rng.choice(list(self.sources))
        op = rng.choices(self.OPS, self.OP_WEIGHTS)[0]
        saving = saver is not None and rng.random() < 0.5
        if saving:
            instance, op = saver, "store"
        if instance not in self.model.registered or op == "toggle":
            self.toggle(instance)
            return "toggle"
        if op == "check":
            if saver is not None:  # one check at a time per store
                return self.step(saver)
            self.check_store(rng.choice(MC_STORES[1:]))
            return op
        if op == "clear_store":
            kv_store = rng.choice(MC_STORES[1:])
            self.seen["clear_store"] += bool(self.table.clear_store(kv_store))
            self.model.clear_store(kv_store)
            return op
        if op == "restart":  # or a lost connection: every rank of the stream is cleared
            self.table.clear_stream(self.sources[instance].key)
            self.model.clear(instance, None)
            return op
        is_pool = instance == MC_POOL
        batch_rank = None if is_pool else rng.choice([None, 0, 1])
        rank = 0 if batch_rank is None else batch_rank
        tier_choice = rng.choice(self.POOL_TIERS if is_pool else self.ENGINE_TIERS)
        if saving:
            tier_choice = Tier.CPU
        tier = tier_choice if tier_choice is not None else (Tier.CPU if is_pool else Tier.GPU)
        p = rng.choice(self.prompts)
        start = rng.randrange(MC_BLOCKS)
        end = rng.randrange(start + 1, MC_BLOCKS + 1)
        variant = rng.randrange(2)
        blocks = [(mc_engine_hash(p[: j + 1], variant), p[: j + 1]) for j in range(start, end)]
        hashes = [h for h, _ in blocks]
        key = self.sources[instance].key
        if op in ("store", "tokenless") and self.model.drops(instance, tier):
            event = stored(hashes, _flat(p[start:end]), tier=tier_choice)
            stats = self.apply(key, batch(event, dp_rank=batch_rank))
            assert (stats.blocks_stored, stats.dropped) == (0, {"kv_store_down": 1}), op
            self.seen["dropped_store_down"] += 1
        elif op == "store":
            parent_hash = mc_engine_hash(p[:start], rng.randrange(2)) if start else None
            placed = self.model.store(instance, rank, tier, blocks, parent_hash)
            event = stored(hashes, _flat(p[start:end]), parent_hash, tier=tier_choice)
            stats = self.apply(key, batch(event, dp_rank=batch_rank))
            assert stats.orphaned == (0 if placed else 1), self.where(op)
            self.seen["orphan" if not placed else "store"] += 1
        elif op == "tokenless":
            placed_n = self.model.store_tokenless(instance, rank, tier, hashes)
            event = stored(hashes, [], None, tier=tier_choice)
            stats = self.apply(key, batch(event, dp_rank=batch_rank))
            assert stats.dropped == (
                {} if placed_n == len(hashes) else {"unknown_block_without_tokens": 1}
            ), self.where(op)
            self.seen["tokenless_placed" if placed_n else "tokenless_dropped"] += 1
        elif op == "remove":
            picked = [h for h in hashes if rng.random() < 0.7]
            self.model.remove(instance, rank, tier_choice, picked)
            self.apply(key, batch(removed(picked, tier=tier_choice), dp_rank=batch_rank))
        else:
            self.model.clear(instance, rank)
            self.apply(key, batch(AllBlocksCleared(), dp_rank=batch_rank))
        return op

    def apply(self, key: str, events: EventBatch) -> ApplyStats:
        """The batch as the service applies it: with ``lane``, encoded as a vLLM engine
        sends it and offered to the C lane first; the decoders take what it declines."""
        if not self.lane:
            return self.table.apply(key, events)
        layout = self.rng.choice(("vllm", "vllm-legacy"))
        payload = encode_batch(events.events, 0.0, events.dp_rank, layout)
        stats = ApplyStats()
        packed = pack_batch(payload, b"", MC_BS)
        if packed is not None and self.table.apply_packed(key, packed, 0, stats) == len(packed):
            self.seen["lane_removal" if packed.removals else "lane_store"] += 1
            return stats
        return self.table.apply(key, decode_batch(payload), stats)

    def check_store(self, kv_store: str) -> None:
        """A store check: its key list is taken, up to three operations happen while it
        travels (often saves to that store by its members), then it is applied (or, one
        time in five, the check fails)."""
        key = self.model.store_key(kv_store)
        present = {h for h in self.model.held.get(key, {}) if self.rng.random() < 0.7}
        self.table.begin_store_check(kv_store)
        self.model.announced[key] = set()
        members = [i for i in sorted(self.model.registered) if self.model.stores[i] == kv_store]
        for _ in range(self.rng.randrange(4) if members else 0):
            self.check(self.step(saver=self.rng.choice(members)))
        if self.rng.random() < 0.2:
            self.table.store_down(kv_store)
            self.model.clear_store(kv_store)
            self.model.down.add(kv_store)
            self.seen["store_down"] += 1
        else:
            announced = self.model.announced.get(key, set())
            kept = announced - present
            dropped = self.model.reconcile(kv_store, present)
            steps = self.table.reconcile_store(kv_store, present, step=2)
            assert sum(steps) == dropped, self.where("check")
            self.seen["evicted"] += dropped > 0
            self.seen["announced_kept"] += bool(kept & set(self.model.held.get(key, {})))
        self.table.end_store_check(kv_store)
        self.model.announced.pop(key, None)

    def toggle(self, instance: str) -> None:
        """Unregister a registered stream, register an unregistered one."""
        if instance in self.model.registered:
            self.table.remove_stream(self.sources[instance].key)
            kv_store = self.model.stores[instance]
            self.model.unregister(instance)
            self.seen["store_outlives_member"] += bool(
                kv_store and self.model.held.get(self.model.store_key(kv_store))
            )
        else:
            kv_store = "" if instance == MC_POOL else self.rng.choice(MC_STORES)
            self.sources[instance] = replace(self.sources[instance], kv_store=kv_store)
            self.table.add_stream(self.sources[instance])
            self.model.register(instance, kv_store)

    # -- checks -----------------------------------------------------------------------------
    def where(self, op: str) -> str:
        return f"seed {self.seed} op {op} seen {dict(self.seen)}"

    def check(self, op: str) -> None:
        check_invariants(self.table)
        known = self.model.all_held()
        for p in self.prompts:
            full = [p[: j + 1] for j in range(MC_BLOCKS)]
            where = f"{self.where(op)} prompt {p}"
            got = self.table.match_tokens(self.context_key, _flat(p))
            _compare(got, self.model.answer(full), where)
            self.note(got)
            self.note_stores(got)
            engine = [mc_engine_hash(prefix, self.rng.randrange(2)) for prefix in full]
            by_hash = [known.get(h) for h in engine]
            got = self.table.match_engine_hashes(self.context_key, engine)
            _compare(got, self.model.answer(by_hash), where)
        context = self.table.contexts.get(self.context_key)
        if context is not None and any(
            h.extra_refs for slot in context.slots.values() for h in slot.holdings
        ):
            self.seen["extra_refs"] += 1

    def note(self, got: dict[str, InstanceMatch] | None) -> None:
        for match in (got or {}).values():
            self.seen["cpu_beyond_gpu"] += match.cpu > match.gpu
            self.seen["disk_beyond_cpu"] += match.disk > match.cpu
            self.seen["full_gpu"] += match.gpu == MC_BLOCKS * MC_BS
            self.seen["rank1_hit"] += match.ranks.get(1, (0, 0, 0, 0))[3] > 0

    def note_stores(self, got: dict[str, InstanceMatch] | None) -> None:
        """A CPU hit of an instance that holds nothing itself, with no Mooncake pool around:
        only its kv_store can explain it."""
        if self.model.pool_prefixes(Tier):
            return
        for instance, match in (got or {}).items():
            own = any(held for (i, _, _), held in self.model.held.items() if i == instance)
            self.seen["store_only_hit"] += match.cpu > 0 and not own


@pytest.mark.parametrize(
    ("seed", "lane", "fillers"),
    [(1, False, 0), (2, False, 0), (3, False, 0), (4, True, 0), (5, True, 0), (6, False, 66)],
    ids=["1", "2", "3", "4-lane", "5-lane", "6-wide-masks"],
)
def test_randomized_against_reference_model(seed: int, lane: bool, fillers: int) -> None:
    """Random store/remove/clear/unregister sequences on 3 engines and a store pool; each
    engine registers with no kv_store or one of two, so kv_store pools come and go, and
    the stores are checked (blocks evicted, blocks saved during a check, failed checks).

    After every step each prompt is queried by tokens and by engine hashes, and the answer
    must equal the naive model's; the table's internal bookkeeping must stay exact. At the
    end every stream is unregistered and nothing may be left behind. With ``lane`` every
    batch is encoded and offered to the C lane first, as the service does.
    """
    mc = ModelCheck(seed, lane, fillers)
    for _ in range(2000):
        mc.check(mc.step())
    for case in (
        *(("lane_store", "lane_removal") if lane else ()),
        "store",
        "orphan",
        "tokenless_placed",
        "tokenless_dropped",
        "extra_refs",
        "cpu_beyond_gpu",
        "disk_beyond_cpu",
        "full_gpu",
        "rank1_hit",
        "store_only_hit",
        "store_outlives_member",
        "clear_store",
        "evicted",
        "announced_kept",
        "store_down",
        "dropped_store_down",
    ):
        assert mc.seen[case] > 0, f"the random run never reached {case!r}: {dict(mc.seen)}"
    for filler in mc.fillers:
        mc.table.remove_stream(filler.key)
        mc.model.unregister(filler.instance_id)
    for instance in list(mc.model.registered):
        mc.table.remove_stream(mc.sources[instance].key)
    assert_empty(mc.table)


def test_removal_fast_path_and_general_path_agree(table: PrefixCacheTable) -> None:
    """``release_many`` removes inline while the owner has no copies or duplicate prefixes,
    else block by block; an event with a copy (an engine hash twice), blocks another owner
    holds and a prefix this owner holds under another engine hash must end exactly as the
    bookkeeping says (``check_invariants`` checks the rest)."""
    table.add_stream(src("a"))
    table.add_stream(src("b"))
    table.apply(src("b").key, batch(stored([10, 11], prompt(2))))
    table.apply(src("a").key, batch(stored([20], prompt(1))))  # prefix 0 under another hash
    tokens = [*prompt(3), *toks(2), *toks(3)]
    p = chain_hashes(salt_root(""), tokens, BS)
    stats = table.apply(src("a").key, batch(stored([10, 11, 11, 12, 13], tokens)))
    assert stats.blocks_stored == 5
    context = table.contexts[ctx()]
    gpu = context.slots[("a", 0)].holdings[Tier.GPU]
    assert gpu.by_engine_hash == {20: p[0], 10: p[0], 11: p[1], 12: p[3], 13: p[4]}
    assert (gpu.copies, gpu.extra_refs) == ({11: 1}, {p[0]: 1})
    assert context._state.engine_refs == {10: 1, 11: 1}
    check_invariants(table)
    stats = table.apply(src("a").key, batch(removed([11, 13, 99, 10, 11, 12, 20])))
    assert stats.blocks_removed == 6  # 99 was never held
    check_invariants(table)
    assert query(table, prompt(2)) == {"a": (0, 0, 0), "b": (2 * BS, 2 * BS, 2 * BS)}
    assert table.apply(src("b").key, batch(removed([10, 11]))).blocks_removed == 2
    assert context.engine_prefix == {} and context.blocks == ({}, {}, {})
