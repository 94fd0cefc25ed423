"""The simulator's KV block manager: vLLM 0.33's caching decisions and its exact events.

The conductor's index is only right if a simulated engine announces what a real one would,
so events are checked field by field against vLLM's own (the hash vectors' BlockPool events
and the wire captures of a real vLLM 0.33 BlockPool, byte for byte).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from conductor.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from conductor.wire.vllm import decode_map_event
from publishers.encoding import WireEvent, encode_batch
from publishers.engine.block_hash import BlockHasher, LoraAdapter, event_hash
from publishers.engine.block_manager import BlockManager, CacheStats, CapacityError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PROFILES: list[dict[str, Any]] = json.loads((FIXTURES / "vllm_hash_vectors.json").read_text())[
    "profiles"
]
CASES = [(profile, case) for profile in PROFILES for case in profile["cases"]]
WIRE = {case["name"]: case for case in json.loads((FIXTURES / "wire_fixtures.json").read_text())}
SEED0 = BlockHasher("sha256", "0")
MEDIA = {Tier.GPU: "GPU", Tier.CPU: "CPU"}


def vllm_event(wire: WireEvent) -> dict[str, Any]:
    """vLLM 0.33's event as a plain dict (keys in declaration order, None defaults omitted)."""
    event = wire.event
    if isinstance(event, BlockStored):
        fields = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": wire.lora_id,
            "medium": MEDIA[event.tier],
            "lora_name": event.lora_name,
            "extra_keys": json.loads(json.dumps(wire.extra_keys)),
            "group_idx": event.group_idx,
        }
    elif isinstance(event, BlockRemoved):
        fields = {"type": "BlockRemoved", "block_hashes": event.block_hashes}
        fields |= {"medium": MEDIA[event.tier], "group_idx": event.group_idx}
    else:
        fields = {"type": "AllBlocksCleared"}
    return fields


def kinds(events: list[WireEvent]) -> list[tuple[str, str | None, list[int]]]:
    """(type, medium, hashes) of each event: enough to read a scenario at a glance."""
    summary = []
    for wire in events:
        event = wire.event
        medium = MEDIA.get(getattr(event, "tier", None))
        hashes = getattr(event, "block_hashes", [])
        summary.append((type(event).__name__, medium, hashes))
    return summary


def hashes_of(tokens: list[int], block_size: int = 4, **keys: Any) -> list[int]:
    return [event_hash(d) for d in SEED0.block_digests(tokens, block_size, **keys)]


def manager(num_gpu_blocks: int = 8, **options: Any) -> BlockManager:
    return BlockManager(num_gpu_blocks, 4, hasher=SEED0, **options)


# -- exactly vLLM's events ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "case"),
    CASES,
    ids=[f"{p['algorithm']}-seed={p['PYTHONHASHSEED']}-{c['name']}" for p, c in CASES],
)
def test_stored_event_matches_vllm(profile: dict[str, Any], case: dict[str, Any]) -> None:
    """The BlockStored of a fresh prompt equals BlockPool's event for the vectors' request."""
    lora_request = case["lora_request"]
    lora = None
    if lora_request is not None:
        lora = LoraAdapter(
            lora_request["lora_name"], lora_request["lora_int_id"], lora_request["lora_path"]
        )
    blocks = BlockManager(
        16, case["block_size"], hasher=BlockHasher(profile["algorithm"], profile["PYTHONHASHSEED"])
    )
    allocation = blocks.allocate("r", case["token_ids"], lora=lora, cache_salt=case["cache_salt"])
    assert allocation is not None
    assert list(allocation.block_hashes) == case["event_block_hashes"]
    [event] = blocks.take_events()
    assert list(vllm_event(event).items()) == list(case["event_wire_decoded"].items())
    assert event.extra_keys is not None
    assert json.loads(json.dumps(event.extra_keys)) == case["event_extra_keys"]


def test_consumers_read_back_lora_and_salt() -> None:
    """Encoded and decoded by the conductor, the event names the salt the chain is rooted in."""
    blocks = manager()
    blocks.allocate("r", list(range(9)), lora=LoraAdapter("a", 1, "/p"), cache_salt="t")
    [wire] = blocks.take_events()
    payload = msgpack.unpackb(encode_batch([wire], 0.0, 0))
    assert decode_map_event(payload[1][0]) == wire.event
    assert wire.event.salt == "t" and wire.event.lora_name == "a"


def replay_fixture(name: str, events: list[WireEvent]) -> None:
    fixture = WIRE[name]
    payload = encode_batch(events, fixture["decoded"][0], fixture["dp_rank"])
    assert payload == base64.b64decode(fixture["payload_b64"])


def test_real_vllm_captures_byte_for_byte() -> None:
    """Replays the real BlockPool steps captured in wire_fixtures.json (sha256, seed "0")."""
    blocks = BlockManager(3, 4, hasher=SEED0)
    blocks.allocate("a", list(range(1, 9)))
    blocks.free("a")
    replay_fixture("v033_stored_gpu_no_parent", blocks.take_events())

    allocation = blocks.allocate("b", list(range(1, 13)))  # prefix hit on 2 blocks
    assert allocation is not None and allocation.num_cached_tokens == 8
    blocks.free("b")
    replay_fixture("v033_stored_gpu_with_parent", blocks.take_events())

    blocks.allocate("c", [1])  # reuses the LRU block: block 3 of the chain
    replay_fixture("v033_removed_single_from_eviction", blocks.take_events())


def test_real_vllm_mixed_step_byte_for_byte() -> None:
    """Store, evict both blocks (tail first), reset: one step's events, in order."""
    blocks = BlockManager(2, 4, hasher=SEED0)
    blocks.allocate("a", list(range(21, 29)))
    blocks.free("a")
    blocks.allocate("b", [1])
    blocks.allocate("c", [2])
    blocks.free("b")
    blocks.free("c")
    assert blocks.reset()
    replay_fixture("v033_mixed_stored_removed_cleared", blocks.take_events())


# -- prefix caching ----------------------------------------------------------------------


def test_hits_misses_and_stats() -> None:
    blocks = manager()
    tokens = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = blocks.allocate("a", tokens)
    assert first is not None
    assert (first.num_cached_tokens, first.num_new_tokens) == (0, 10)
    assert first.block_hashes == tuple(hashes_of(tokens))
    second = blocks.allocate("b", tokens[:8] + [7, 7, 7])  # shares 2 blocks while a runs
    assert second is not None
    assert (second.num_cached_tokens, second.num_cpu_loaded_tokens) == (8, 0)
    assert second.num_new_tokens == 3
    assert blocks.stats == CacheStats(requests=2, query_tokens=21, gpu_hit_tokens=8)
    # b's complete blocks were all hits: nothing new to announce
    assert kinds(blocks.take_events()) == [("BlockStored", "GPU", hashes_of(tokens))]


def test_event_for_a_prefix_hit_starts_after_it() -> None:
    blocks = manager()
    blocks.allocate("a", list(range(8)))
    blocks.free("a")
    blocks.take_events()
    blocks.allocate("b", list(range(16)))
    [stored] = blocks.take_events()
    chain = hashes_of(list(range(16)))
    assert stored.event.block_hashes == chain[2:]
    assert stored.event.parent_hash == chain[1]
    assert list(stored.event.token_ids) == list(range(8, 16))
    assert stored.extra_keys == [None, None]


def test_last_token_is_always_recomputed() -> None:
    """vLLM caps a hit at len(prompt) - 1 tokens: a fully cached prompt recomputes its last
    block, caches it again as a duplicate and announces it again; evicting one copy is
    announced while the other keeps serving hits."""
    blocks = manager()
    tokens = list(range(8))
    chain = fill(blocks, "a", 0, 2)
    allocation = blocks.allocate("b", tokens)
    assert allocation is not None and allocation.num_cached_tokens == 4
    assert kinds(blocks.take_events()) == [("BlockStored", "GPU", chain[1:])]
    assert blocks.allocate("c", list(range(500, 524))) is not None  # every free block
    assert kinds(blocks.take_events())[0] == ("BlockRemoved", "GPU", [chain[1]])
    blocks.free("c")
    again = blocks.allocate("d", tokens + [9])
    assert again is not None and again.num_cached_tokens == 8


def test_salt_and_lora_isolate_caches() -> None:
    blocks = manager(16)
    tokens = list(range(12))
    blocks.allocate("a", tokens)
    salted = blocks.allocate("b", tokens, cache_salt="tenant")
    adapted = blocks.allocate("c", tokens, lora=LoraAdapter("x", 3, "/x"))
    assert salted is not None and salted.num_cached_tokens == 0
    assert adapted is not None and adapted.num_cached_tokens == 0
    again = blocks.allocate("d", tokens, cache_salt="tenant")
    assert again is not None and again.num_cached_tokens == 8


def test_decode_caches_blocks_it_fills() -> None:
    """A block completed by decoding is announced with its parent, LoRA and extra keys;
    a request shorter than a block gets its salt on the block decoding completes."""
    lora = LoraAdapter("x", 3, "/x")
    blocks = manager()
    blocks.allocate("r", [1, 2], lora=lora, cache_salt="s")
    assert blocks.take_events() == []
    assert blocks.append_tokens("r", [3])
    assert blocks.take_events() == []
    assert blocks.append_tokens("r", [4, 5, 6, 7, 8, 9])
    [stored] = blocks.take_events()
    chain = hashes_of(list(range(1, 10)), lora=lora, cache_salt="s")
    assert stored.event.block_hashes == chain
    assert stored.event.parent_hash is None
    assert list(stored.event.token_ids) == list(range(1, 9))
    assert (stored.event.salt, stored.event.lora_name, stored.lora_id) == ("s", "x", 3)
    assert stored.extra_keys == [("x", "s"), ("x",)]
    assert blocks.append_tokens("r", [10, 11, 12])
    [stored] = blocks.take_events()
    assert stored.event.parent_hash == chain[1] and stored.event.salt is None
    assert stored.extra_keys == [("x",)]


# -- eviction ----------------------------------------------------------------------------


def fill(blocks: BlockManager, request_id: str, first_token: int, num_blocks: int) -> list[int]:
    """Run and finish a request of ``num_blocks`` full blocks; returns its chain."""
    tokens = list(range(first_token, first_token + 4 * num_blocks))
    assert blocks.allocate(request_id, tokens) is not None
    blocks.free(request_id)
    blocks.take_events()
    return hashes_of(tokens)


def test_eviction_is_lru_and_tail_first() -> None:
    blocks = manager(4)
    old = fill(blocks, "old", 100, 2)
    new = fill(blocks, "new", 200, 2)
    blocks.allocate("x", [1])
    blocks.allocate("y", [2])
    blocks.allocate("z", [3])
    assert kinds(blocks.take_events()) == [
        ("BlockRemoved", "GPU", [old[1]]),
        ("BlockRemoved", "GPU", [old[0]]),
        ("BlockRemoved", "GPU", [new[1]]),
    ]


def test_a_hit_refreshes_recency() -> None:
    blocks = manager(4)
    old = fill(blocks, "old", 100, 2)
    new = fill(blocks, "new", 200, 2)
    assert blocks.allocate("again", list(range(100, 109))) is not None  # hits old, evicts new[1]
    blocks.free("again")
    for request_id in "wxyz":
        blocks.allocate(request_id, [1])
    removed = [hashes for _, _, hashes in kinds(blocks.take_events())]
    assert removed == [[new[1]], [new[0]], [old[1]], [old[0]]]


def test_blocks_in_use_are_never_evicted() -> None:
    blocks = manager(4)
    assert blocks.allocate("a", list(range(8))) is not None
    assert blocks.allocate("b", list(range(100, 108))) is not None
    assert blocks.allocate("c", [1]) is None
    assert blocks.num_free_blocks == 0 and blocks.usage == 1.0
    blocks.free("a")
    assert blocks.usage == 0.5
    assert blocks.allocate("c", [1]) is not None


def test_shared_blocks_are_reference_counted() -> None:
    blocks = manager(4)
    tokens = list(range(8))
    blocks.allocate("a", tokens + [9])
    blocks.allocate("b", tokens + [10])  # shares 2 blocks, takes 1
    assert blocks.num_free_blocks == 0
    blocks.free("a")
    assert blocks.num_free_blocks == 1  # only a's own last block
    blocks.free("b")
    assert blocks.num_free_blocks == 4


# -- capacity ----------------------------------------------------------------------------


def test_not_now_changes_nothing() -> None:
    blocks = manager(4)
    fill(blocks, "cached", 100, 2)
    blocks.allocate("a", list(range(9)))  # 3 blocks: evicts one cached block
    blocks.take_events()
    before = (blocks.stats, blocks.num_free_blocks)
    assert blocks.allocate("b", list(range(20, 29))) is None
    assert (blocks.stats, blocks.num_free_blocks) == before
    assert blocks.take_events() == []
    assert blocks.allocate("other", [1]) is not None  # the last free block
    blocks.take_events()
    assert blocks.append_tokens("a", [1, 2, 3]) is True  # completes block 3 in place
    assert blocks.append_tokens("a", [4]) is False  # needs a fourth block
    assert kinds(blocks.take_events()) == [
        ("BlockStored", "GPU", [hashes_of(list(range(9)) + [1, 2, 3])[2]])
    ]
    blocks.free("other")
    assert blocks.append_tokens("a", [4]) is True


def test_a_hit_on_free_blocks_counts_them_as_taken() -> None:
    """Cached free blocks that a request hits cannot also serve as its new blocks."""
    blocks = manager(4)
    fill(blocks, "cached", 0, 2)
    blocks.allocate("other", [1])  # 3 blocks left free, 2 of them the cached chain
    assert blocks.allocate("a", list(range(13))) is None  # 2 hits + 2 new
    assert blocks.allocate("a", list(range(12))) is not None  # 2 hits + 1 new


def test_too_long_is_an_error() -> None:
    blocks = manager(4)
    with pytest.raises(CapacityError):
        blocks.allocate("a", list(range(17)))
    blocks.allocate("b", list(range(16)))
    with pytest.raises(CapacityError):
        blocks.append_tokens("b", [1])
    with pytest.raises(ValueError):
        blocks.allocate("b", [1])
    with pytest.raises(ValueError):
        blocks.allocate("c", [])


# -- CPU offload -------------------------------------------------------------------------


def test_evicted_blocks_are_offloaded_and_loaded_back() -> None:
    blocks = manager(4, num_cpu_blocks=8)
    chain = fill(blocks, "a", 0, 3)
    other = list(range(100, 116))
    blocks.allocate("x", other)  # needs all 4 blocks: evicts the chain, tail first
    events = blocks.take_events()
    assert kinds(events) == [
        ("BlockStored", "CPU", [chain[2]]),
        ("BlockRemoved", "GPU", [chain[2]]),
        ("BlockStored", "CPU", [chain[1]]),
        ("BlockRemoved", "GPU", [chain[1]]),
        ("BlockStored", "CPU", [chain[0]]),
        ("BlockRemoved", "GPU", [chain[0]]),
        ("BlockStored", "GPU", hashes_of(other)),
    ]
    offloaded = events[0]
    assert offloaded.event.parent_hash == chain[1]
    assert list(offloaded.event.token_ids) == [8, 9, 10, 11]
    assert (offloaded.event.block_size, offloaded.event.group_idx) == (4, 0)
    assert offloaded.extra_keys == [None]
    blocks.free("x")

    allocation = blocks.allocate("b", list(range(13)))
    assert allocation is not None
    assert (allocation.num_cached_tokens, allocation.num_cpu_loaded_tokens) == (12, 12)
    assert blocks.stats.cpu_hit_tokens == 12 and blocks.stats.gpu_hit_tokens == 0
    events = blocks.take_events()
    assert len(events) == 9  # x's 4 blocks offloaded (stored on CPU, removed from GPU), then:
    assert kinds(events[-1:]) == [("BlockStored", "GPU", chain)]  # loaded back, on the GPU
    assert events[-1].event.parent_hash is None
    assert ("BlockRemoved", "CPU") not in [kind[:2] for kind in kinds(events)]


def test_cpu_tier_evicts_lru() -> None:
    blocks = manager(2, num_cpu_blocks=2)
    first = fill(blocks, "a", 0, 2)
    second_tokens = list(range(100, 108))
    blocks.allocate("b", second_tokens)  # a's blocks go to the CPU, tail first
    blocks.free("b")
    second = hashes_of(second_tokens)
    assert kinds(blocks.take_events()) == [
        ("BlockStored", "CPU", [first[1]]),
        ("BlockRemoved", "GPU", [first[1]]),
        ("BlockStored", "CPU", [first[0]]),
        ("BlockRemoved", "GPU", [first[0]]),
        ("BlockStored", "GPU", second),
    ]
    blocks.allocate("c", [1, 2, 3, 4, 5])  # b's blocks replace a's on the full CPU tier
    assert kinds(blocks.take_events()) == [
        ("BlockRemoved", "CPU", [first[1]]),
        ("BlockStored", "CPU", [second[1]]),
        ("BlockRemoved", "GPU", [second[1]]),
        ("BlockRemoved", "CPU", [first[0]]),
        ("BlockStored", "CPU", [second[0]]),
        ("BlockRemoved", "GPU", [second[0]]),
        ("BlockStored", "GPU", hashes_of([1, 2, 3, 4])),
    ]


def test_hit_continues_from_gpu_into_cpu() -> None:
    """GPU prefix first, then consecutive CPU blocks, loaded into fresh GPU blocks."""
    blocks = manager(4, num_cpu_blocks=8)
    chain = fill(blocks, "a", 0, 3)
    fill(blocks, "x", 100, 2)  # takes a free block and chain[2], which goes to the CPU
    allocation = blocks.allocate("b", list(range(16)))
    assert allocation is not None
    assert (allocation.num_cached_tokens, allocation.num_cpu_loaded_tokens) == (12, 4)
    stored = blocks.take_events()[-1]
    assert kinds([stored]) == [("BlockStored", "GPU", hashes_of(list(range(16)))[2:])]
    assert stored.event.parent_hash == chain[1]


# -- external tier (a KV store the caller loaded from) ------------------------------------


def test_a_store_hit_continues_the_gpu_hit_and_is_announced_on_the_gpu() -> None:
    blocks = manager(8)
    chain = fill(blocks, "a", 0, 1)
    tokens = list(range(17))  # 4 full blocks, the last token always computed
    allocation = blocks.allocate("b", tokens, external=range(1, 4))
    assert allocation is not None
    assert allocation.num_cached_tokens == 16
    assert (allocation.num_external_loaded_tokens, allocation.num_loaded_tokens) == (12, 12)
    assert (blocks.stats.external_query_tokens, blocks.stats.external_hit_tokens) == (13, 12)
    stored = blocks.take_events()[-1]
    assert kinds([stored]) == [("BlockStored", "GPU", hashes_of(tokens)[1:])]
    assert stored.event.parent_hash == chain[0]


def test_a_store_range_past_a_gap_or_the_last_token_is_not_a_hit() -> None:
    blocks = manager(16)
    gap = blocks.allocate("gap", list(range(17)), external=range(1, 4))  # block 0 is missing
    assert gap is not None and gap.num_cached_tokens == 0
    assert blocks.stats.external_query_tokens == 17
    capped = blocks.allocate("capped", list(range(100, 108)), external=range(0, 2))
    assert capped is not None and capped.num_external_loaded_tokens == 4  # not the last block
    plain = blocks.allocate("plain", list(range(50, 60)))
    assert plain is not None and blocks.stats.external_query_tokens == 17 + 8  # no store


def test_the_gpu_prefix_of_digests_is_read_without_changing_anything() -> None:
    blocks = manager(8)
    fill(blocks, "a", 0, 2)
    digests = blocks.prompt_digests(list(range(13)))
    assert len(digests) == 3 and blocks.num_gpu_prefix_blocks(digests) == 2
    assert not blocks.take_events() and blocks.stats.requests == 1


# -- reset and independence --------------------------------------------------------------


def test_reset() -> None:
    blocks = manager(4, num_cpu_blocks=4)
    blocks.allocate("a", list(range(9)))
    assert blocks.reset() is False
    blocks.free("a")
    blocks.take_events()
    assert blocks.reset() is True
    assert [type(e.event) for e in blocks.take_events()] == [AllBlocksCleared]
    allocation = blocks.allocate("b", list(range(9)))
    assert allocation is not None and allocation.num_cached_tokens == 0
    assert blocks.num_free_blocks == 1


def test_free_is_idempotent() -> None:
    blocks = manager()
    blocks.free("never-allocated")
    blocks.allocate("a", [1])
    blocks.free("a")
    blocks.free("a")
    assert blocks.num_free_blocks == 8


def test_data_parallel_ranks_are_independent() -> None:
    """One manager per DP rank: same requests, same events; one rank's state is its own."""
    rank0, rank1 = manager(4), manager(4)
    for blocks in (rank0, rank1):
        blocks.allocate("a", list(range(9)))
    assert [vllm_event(e) for e in rank0.take_events()] == [
        vllm_event(e) for e in rank1.take_events()
    ]
    rank0.free("a")
    rank0.allocate("b", list(range(100, 113)))
    assert rank1.take_events() == [] and rank1.num_free_blocks == 1
    assert rank1.allocate("c", list(range(100, 113))) is None
