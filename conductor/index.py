"""The global prefix index: which owner holds which prefix block, on which tier.

Pure and synchronous: every call applies events or walks a query whole, nothing awaits
inside one (the service applies a large batch in a few calls, between which queries run).
Its invariants and its place in the data flow: docs/architecture.md.

Layout, chosen for memory (three 16-byte map entries per block and tier in the common case,
no int object per hash) and for a fast /query walk. The blocks are kept in C: a context's in
a ``_native.ContextBlocks``, each owner's on each tier in a ``_native.Holdings``; their maps
(``HashMap``: uint64 -> uint64, ``MaskMap``: uint64 -> int) read as dicts, without an
object per key, and change only through ContextBlocks' methods, which keep the counts below
consistent.

* A ``PrefixContext`` per (tenant, model, LoRA, block size) holds three MaskMaps, one per
  tier, ``prefix hash -> bitmask of slots``. A *slot* is one (instance, DP rank); its bit is
  recycled when the slot leaves.
* Each slot keeps, per tier, its own ``engine hash -> prefix hash`` map. Removals, clears
  and unregisters therefore touch only what that owner stored, and leave nothing behind.
* The context keeps one ``engine hash -> prefix hash`` map over all its owners, counted
  (``/query_by_hash`` and parent lookups are one map lookup per hash, whatever the number
  of owners): one more entry per distinct engine hash, and one in ``engine_refs`` for a
  hash held more than once (another tier, another owner).
* A stream's slots are indexed by DP rank: clearing a rank touches that rank's slots only,
  so clearing N ranks is linear. ``max_dp_ranks`` and ``max_lora_contexts`` bound the
  slots and contexts one registration's events may create (a publisher controls both).
* Pools are slots whose CPU/DISK blocks count for their *member* slots too. A Mooncake
  store registration's pool serves every instance of the context. A ``kv_store`` pool holds
  the CPU blocks that engines registered with that store's master address saved to it; its
  members are the engine slots of those registrations, and it lives as long as one of them
  is registered (an engine's clear, restart or unregister leaves the store's blocks alone).
  The store evicts without an event: ``kv_store_watch`` checks its key list and calls
  ``reconcile_store`` (blocks announced since the check began are kept) or ``store_down``.

Readers outside this module (``/global_view``, ``/health``, the metrics) see the index
through frozen views (``ContextView``, ``StorePoolView``) and counts, never its slots.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ._native import ContextBlocks, HashMap, MaskMap, PackedBatch
from .hash_profile import HashProfile
from .hashing import PrefixHash, chain_hashes, prefix_hashes, salt_root
from .wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    Tier,
)

if TYPE_CHECKING:
    from .ingest_thread import Applied, IngestLane, OnApplied

TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
STORE_POOL_RANK = -1  # a kv_store pool's slot key is (address, -1): DP ranks are never < 0
EVERY_SLOT = -1  # the member mask of a Mooncake pool: all bits set
# pool blocks a store check looks at between two yields (bench.kv_store_check_bench)
RECONCILE_STEP = 5_000
UNKNOWN_PREFIX = PrefixHash(-1)  # an engine hash nobody published: no block has it
SlotKey = tuple[str, int]  # (instance id, DP rank); a kv_store pool: (address, -1)
# Cumulative hits of one DP rank, in walk order: GPU; GPU or the engine's own CPU offload
# (upstream's later "cpu_local"); CPU of either kind, own or through a pool it can load
# from ("cpu", later "cpu_share"); any tier ("disk")
TierHits = tuple[int, int, int, int]
_Stop = tuple[list[int], TierHits]  # slot indices, blocks matched per tier


@dataclass(frozen=True, slots=True)
class ContextKey:
    tenant_id: str
    model_name: str
    lora_name: str
    block_size: int


@dataclass(frozen=True, slots=True)
class StreamSource:
    """What a registration says about the blocks its event stream carries."""

    key: str
    instance_id: str
    tenant_id: str
    model_name: str
    lora_name: str
    block_size: int
    dp_rank: int = 0
    salt: str = ""
    shared_pool: bool = False
    kv_store: str = ""  # the Mooncake store master (host:port) its CPU blocks are saved to
    # how the engine hashes blocks (upstream C++'s registrations): its events' hashes are
    # then the index's keys, and a query's tokens are hashed so; None: the Go prefix hash
    hash_profile: HashProfile | None = None

    @property
    def default_tier(self) -> Tier:
        return Tier.CPU if self.shared_pool else Tier.GPU

    def context_key(self, lora_name: str | None = None) -> ContextKey:
        lora = self.lora_name if lora_name is None else lora_name
        return ContextKey(self.tenant_id, self.model_name, lora, self.block_size)


@dataclass(slots=True)
class ApplyStats:
    """What one batch did; the shell turns these into metrics and, for a stream whose
    events carry another block size than registered, into a warning and a degraded health."""

    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    orphaned: int = 0
    ignored: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    foreign_block_size: int | None = None  # what mismatched events carry (the last one seen)

    def drop(self, reason: str, events: int = 1) -> None:
        if events:
            self.dropped[reason] = self.dropped.get(reason, 0) + events


@dataclass(frozen=True, slots=True)
class StorePoolView:
    """A kv_store pool of one context: its CPU blocks and the instances it serves."""

    kv_store: str
    blocks: int
    instances: tuple[str, ...]  # sorted


@dataclass(frozen=True, slots=True)
class ContextView:
    """What one context holds, as ``/global_view`` and the metrics show it."""

    key: ContextKey
    blocks: tuple[int, int, int]  # distinct prefix blocks on GPU, CPU, DISK
    # each instance's DP ranks (sorted), instances in the order they joined; a Mooncake
    # store's pool is listed as an instance, a kv_store pool is not (see ``store_pools``)
    instances: Mapping[str, tuple[int, ...]]
    store_pools: tuple[StorePoolView, ...]  # sorted by kv_store


@dataclass(slots=True)
class InstanceMatch:
    """Cumulative matched tokens of one instance: GPU <= own CPU <= any CPU <= DISK (see
    ``TierHits``), per DP rank too."""

    gpu: int = 0
    cpu_local: int = 0
    cpu: int = 0
    disk: int = 0
    ranks: dict[int, TierHits] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlainFleet:
    """A context's engine slots as the plain query (``conductor.plain_query``) answers
    them. It lasts as long as the context's slots do (a slot coming or going makes a new
    one)."""

    blocks: ContextBlocks
    pool_members: dict[int, int]  # the context's own (a pool's members change in place)
    profile: HashProfile | None  # the engines' hashes key the blocks; else Go prefix hashes
    key: ContextKey
    names: tuple[str, ...]  # the instances, in instance-id order
    ranks: tuple[tuple[int, ...], ...]  # the DP ranks of each, in order
    bits: tuple[tuple[int, ...], ...]  # the slot index of each of those ranks
    name_set: frozenset[str]  # the names again, to look up
    # what conductor.plain_query made of it, by dialect: dropped with it
    plans: dict[object, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Engines:
    """A context's engine slots as queries see them."""

    mask: int  # every engine slot's bit
    masks: dict[str, int]  # instance id -> its slots' bits
    # instance id -> its answer when nothing matched (shared), in instance-id order
    zero: dict[str, InstanceMatch]
    # slot index -> (instance id, DP rank) of each instance with one engine slot: its answer
    # is that slot's alone
    single: dict[int, tuple[str, int]]
    # when every instance has one engine slot and all have the same DP rank (most fleets):
    # that rank, and each slot index's instance id ("": no engine slot)
    uniform_rank: int | None
    names: list[str]
    plain: PlainFleet


class _Slot:
    """One owner of blocks: an engine (instance, DP rank) or a pool (``shared_pool``).

    ``kv_store`` is set on a kv_store pool only: the store master's address it stands for.
    """

    __slots__ = (
        "instance_id",
        "dp_rank",
        "shared_pool",
        "kv_store",
        "index",
        "bit",
        "holdings",
        "streams",
    )

    def __init__(
        self,
        instance_id: str,
        dp_rank: int,
        shared_pool: bool,
        index: int,
        state: ContextBlocks,
        kv_store: str = "",
    ) -> None:
        self.instance_id = instance_id
        self.dp_rank = dp_rank
        self.shared_pool = shared_pool
        self.kv_store = kv_store
        self.index = index
        self.bit = 1 << index
        self.holdings = state.owner(self.bit)  # its blocks on each tier
        self.streams: set[str] = set()


class PrefixContext:
    """All blocks of one (tenant, model, LoRA, block size), shared by its owners.

    A context whose registrations carry a hash profile keys its blocks by the engines' own
    hashes (prefix hash = engine hash), and hashes a query's tokens as the engines do.
    """

    def __init__(self, key: ContextKey, profile: HashProfile | None = None) -> None:
        self.key = key
        self.profile = profile
        self._state = ContextBlocks(key.block_size)
        # per tier, prefix hash -> the bits of the slots holding it (read here, changed by
        # self._state's methods, as are the maps below)
        self.blocks: tuple[MaskMap[PrefixHash], ...] = self._state.blocks
        self.slots: dict[SlotKey, _Slot] = {}
        self._by_index: dict[int, _Slot] = {}
        self._free: list[int] = []
        # pool bit -> bits of the engine slots its blocks count for (EVERY_SLOT: Mooncake)
        self.pool_members: dict[int, int] = {}
        self.pool_mask = 0  # every pool's bit: 0 keeps the walk free of pool lookups
        # engine hash -> prefix hash over every owner and tier (the first holder's mapping:
        # engine hashes of one context agree); the state counts the holders beyond one
        self.engine_prefix: HashMap[EngineHash, PrefixHash] = self._state.engine_prefix
        self._engines: _Engines | None = None  # what queries need of the slots, kept whole
        # told before a slot comes or goes, or a pool's members change (conductor.
        # query_thread: its plans wait)
        self.on_slots_change: Callable[[ContextKey], None] | None = None

    # -- slots ---------------------------------------------------------------------------
    def slot(self, instance_id: str, dp_rank: int, shared_pool: bool, kv_store: str = "") -> _Slot:
        slot = self.slots.get((instance_id, dp_rank))
        if slot is None:
            self._slots_changing()
            index = self._free.pop() if self._free else len(self.slots)
            slot = _Slot(instance_id, dp_rank, shared_pool, index, self._state, kv_store)
            self.slots[(instance_id, dp_rank)] = slot
            self._by_index[index] = slot
            if shared_pool:
                self.pool_members[slot.bit] = 0 if kv_store else EVERY_SLOT
                self.pool_mask |= slot.bit
        return slot

    def store_pool(self, kv_store: str) -> _Slot:
        """The pool of the store whose master is at ``kv_store`` (created empty)."""
        return self.slot(kv_store, STORE_POOL_RANK, True, kv_store)

    def set_membership(self, engine: _Slot, kv_stores: set[str]) -> None:
        """Make ``engine`` a member of exactly these stores' pools (which must exist)."""
        self._slots_changing()
        for pool_bit, members in self.pool_members.items():
            if members != EVERY_SLOT:
                self.pool_members[pool_bit] = members & ~engine.bit
        for kv_store in kv_stores:
            self.pool_members[self.slots[(kv_store, STORE_POOL_RANK)].bit] |= engine.bit

    def drop_slot(self, slot: _Slot) -> None:
        self._slots_changing()
        self.clear_slot(slot)
        del self.slots[(slot.instance_id, slot.dp_rank)]
        del self._by_index[slot.index]
        if slot.shared_pool:
            del self.pool_members[slot.bit]
            self.pool_mask &= ~slot.bit
        else:  # its bit will be recycled: it must not inherit this slot's memberships
            self.set_membership(slot, set())
        self._free.append(slot.index)

    def _slots_changing(self) -> None:
        """Before a slot comes or goes, or a pool's members change: what queries see of the
        slots is made again, and a reader outside the loop is told first (it must not answer
        from the old slots)."""
        self._engines = None
        if self.on_slots_change is not None:
            self.on_slots_change(self.key)

    # -- blocks --------------------------------------------------------------------------
    def hold(
        self,
        slot: _Slot,
        tier: Tier,
        engine_hashes: Sequence[EngineHash],
        prefix_hashes: Sequence[PrefixHash],
    ) -> int:
        """Record that ``slot`` holds these blocks on ``tier``; returns how many were stored
        (one call per stored event off the C lane)."""
        return self._state.hold(slot.holdings[tier], engine_hashes, prefix_hashes)

    def release(self, slot: _Slot, tier: Tier, engine_hash: EngineHash) -> bool:
        return self.release_many(slot, tier, (engine_hash,)) == 1

    def release_many(self, slot: _Slot, tier: Tier, engine_hashes: Sequence[EngineHash]) -> int:
        """One copy fewer of each block ``slot`` holds on ``tier``; returns how many it held."""
        return self._state.release(slot.holdings[tier], engine_hashes)

    def apply_packed(
        self, slot: _Slot, packed: PackedBatch, start: int, max_blocks: int, root: int | None
    ) -> Applied:
        """Events of a packed batch from ``start`` on, about ``max_blocks`` blocks' worth,
        for ``slot``'s GPU blocks, chained from ``root``: (the first event not applied,
        blocks stored, blocks removed, events orphaned, events whose token count does not
        fit their hashes)."""
        return self._state.apply_packed(packed, slot.holdings, start, max_blocks, root)

    def submit_packed(
        self,
        lane: IngestLane,
        slot: _Slot,
        packed: PackedBatch,
        root: int | None,
        on_applied: OnApplied,
    ) -> None:
        """``apply_packed`` of the whole batch, on the ingest thread."""
        lane.apply(self._state, slot.holdings, packed, root, on_applied)

    def evict(self, slot: _Slot, tier: Tier, engine_hashes: Sequence[EngineHash]) -> None:
        """Forget every copy of these blocks (their keys left the store, whoever saved them)."""
        self._state.evict(slot.holdings[tier], engine_hashes)

    def clear_slot(self, slot: _Slot) -> int:
        """Forget every block of ``slot``; returns how many engine blocks it held (one C
        loop: unregistering a big engine holds queries briefly; bench.index_bench)."""
        return sum(self._state.clear(holdings) for holdings in slot.holdings)

    def prefix_of(self, engine_hash: EngineHash, owner: SlotKey | None = None) -> PrefixHash | None:
        """The prefix hash an engine hash was indexed under, by any owner of the context.

        ``owner`` (instance, DP rank) is asked first: its own chain wins where owners with
        other salts map one engine hash differently.
        """
        slot = self.slots.get(owner) if owner is not None else None
        if slot is not None:
            for holdings in slot.holdings:
                prefix_hash = holdings.by_engine_hash.get(engine_hash)
                if prefix_hash is not None:
                    return prefix_hash
        return self.engine_prefix.get(engine_hash)

    def block_counts(self) -> tuple[int, int, int]:
        return len(self.blocks[0]), len(self.blocks[1]), len(self.blocks[2])

    def prefix_count(self) -> int:
        """Distinct prefix blocks some owner holds on some tier: the GPU count, plus each
        CPU and disk block no lower tier holds (a walk over those two tiers, linear in their
        blocks; nothing for a GPU-only context)."""
        gpu, cpu, disk = self.blocks
        count = len(gpu)
        if cpu:
            count += sum(1 for block in cpu if block not in gpu)
        if disk:
            count += sum(1 for block in disk if block not in gpu and block not in cpu)
        return count

    def store_pools(self) -> tuple[StorePoolView, ...]:
        """Each kv_store pool: its CPU blocks and the instances it serves."""
        pools = []
        for pool in self.slots.values():
            if pool.kv_store:
                members = self.pool_members[pool.bit]
                served = {s.instance_id for s in self.slots.values() if s.bit & members}
                blocks = pool.holdings[Tier.CPU].prefix_count()
                pools.append(StorePoolView(pool.kv_store, blocks, tuple(sorted(served))))
        return tuple(sorted(pools, key=lambda pool: pool.kv_store))

    def view(self) -> ContextView:
        instances: dict[str, list[int]] = {}
        for slot in self.slots.values():
            if not slot.kv_store:
                instances.setdefault(slot.instance_id, []).append(slot.dp_rank)
        ranks = {name: tuple(sorted(dp_ranks)) for name, dp_ranks in instances.items()}
        return ContextView(self.key, self.block_counts(), ranks, self.store_pools())

    def held_hashes(self) -> Iterator[tuple[EngineHash, PrefixHash]]:
        """Every owner's engine hash -> prefix hash mappings, owner by owner, tier by tier
        (within one, in no particular order)."""
        for slot in self.slots.values():
            for holdings in slot.holdings:
                yield from holdings.by_engine_hash.items()

    def is_empty(self) -> bool:
        return not self.slots and not any(self.blocks)

    # -- matching ------------------------------------------------------------------------
    def query_hashes(self, token_ids: Sequence[int] | bytes, salt: str) -> list[PrefixHash]:
        """A prompt's keys in this context: the Go prefix hashes of its complete blocks; in
        a profiled context the engines' block hashes (LoRA name on every block, ``salt``
        as vLLM's cache salt), hashed only up to the first block no owner holds, where
        every walk stops anyway (a SHA-256 and a serialization per block)."""
        if self.profile is None:
            return prefix_hashes(token_ids, self.key.block_size, salt)
        gpu, cpu, disk = self.blocks
        held: list[PrefixHash] = []
        for key in self.profile.block_keys(
            token_ids, self.key.block_size, self.key.lora_name, salt
        ):
            if key not in gpu and key not in cpu and key not in disk:
                break
            held.append(PrefixHash(key))
        return held

    def match(
        self, hashes: Sequence[PrefixHash], instance_id: str | None = None
    ) -> dict[str, InstanceMatch]:
        """Every engine instance's cumulative match (one, given ``instance_id``).

        Only the slots holding the first block walk the query's hashes: in a large fleet
        most hold none of a prompt. Answers are shared where they are equal (the zeros of
        instances with the same ranks; one-slot instances that stopped at the same block),
        so the result is read-only. It lists the instances in instance-id order.
        """
        engines = self._engine_set()
        if instance_id is None:
            interest, matches = engines.mask, dict(engines.zero)
        else:
            zero = engines.zero.get(instance_id)
            interest = engines.masks.get(instance_id, 0)
            matches = {} if zero is None else {instance_id: zero}
        if hashes:
            interest &= self._holders(hashes[0])
        if not interest or not hashes:
            return matches
        gpu_blocks, cpu_blocks, disk_blocks = self.blocks
        if not cpu_blocks and not disk_blocks:  # GPU-only context: one walk serves all tiers
            stops = self._walk_gpu(hashes, interest)
        else:
            stops = self._walk_tiers(hashes, interest)
        size = self.key.block_size
        alike: dict[tuple[int, TierHits], InstanceMatch] = {}
        groups: dict[TierHits, InstanceMatch] = {}  # by blocks, for one rank
        single, uniform_rank, names = engines.single, engines.uniform_rank, engines.names
        for indices, blocks in stops:
            if uniform_rank is not None:  # one answer for the group, one store per instance
                match = groups.get(blocks)
                if match is None:
                    tokens = _tokens(blocks, size)
                    match = groups[blocks] = InstanceMatch(*tokens, {uniform_rank: tokens})
                for index in indices:
                    matches[names[index]] = match
                continue
            gpu, cpu_local, cpu, disk = tokens = _tokens(blocks, size)
            for index in indices:
                owner = single.get(index)
                if owner is not None:  # its answer is this slot's alone
                    name, rank = owner
                    match = alike.get((rank, tokens))  # shared: most stop where others do
                    if match is None:
                        match = alike[rank, tokens] = InstanceMatch(*tokens, {rank: tokens})
                    matches[name] = match
                    continue
                slot = self._by_index[index]
                match = matches[slot.instance_id]
                if match is engines.zero[slot.instance_id]:  # the first of its slots to match
                    match = matches[slot.instance_id] = InstanceMatch(ranks=dict(match.ranks))
                match.ranks[slot.dp_rank] = tokens
                match.gpu = max(match.gpu, gpu)
                match.cpu_local = max(match.cpu_local, cpu_local)
                match.cpu = max(match.cpu, cpu)
                match.disk = max(match.disk, disk)
        return matches

    def _walk_gpu(self, hashes: Sequence[PrefixHash], interest: int) -> list[_Stop]:
        """The walk of a GPU-only context: slots stop together, in groups (in C, on the
        masks as machine words, where Python allocates a big int per block; bench.index_bench
        measures the query)."""
        return self._state.walk(hashes, interest)

    def _engine_set(self) -> _Engines:
        """The engine slots as queries see them; rebuilt after a slot came or went."""
        if self._engines is None:
            masks: dict[str, int] = {}
            engine_slots: dict[str, list[tuple[int, int]]] = {}  # (DP rank, slot index)
            for slot in self.slots.values():
                if not slot.shared_pool:
                    masks[slot.instance_id] = masks.get(slot.instance_id, 0) | slot.bit
                    engine_slots.setdefault(slot.instance_id, []).append((slot.dp_rank, slot.index))
            for its_slots in engine_slots.values():
                its_slots.sort()
            ranks = {
                name: [rank for rank, _ in its_slots] for name, its_slots in engine_slots.items()
            }
            zeros: dict[tuple[int, ...], InstanceMatch] = {}
            zero = {}
            for instance_id, its_ranks in sorted(ranks.items()):
                key = tuple(its_ranks)
                if key not in zeros:
                    zeros[key] = InstanceMatch(ranks=dict.fromkeys(key, (0, 0, 0, 0)))
                zero[instance_id] = zeros[key]
            mask = 0
            for bits in masks.values():
                mask |= bits
            single = {
                slot.index: (slot.instance_id, slot.dp_rank)
                for slot in self.slots.values()
                if not slot.shared_pool and len(ranks[slot.instance_id]) == 1
            }
            single_ranks = {rank for _, rank in single.values()}
            uniform = len(single) == len(ranks) and len(single_ranks) == 1
            names: list[str] = []  # read in the uniform case only
            if uniform:
                names = [""] * (max(single) + 1)
                for index, (instance_id, _) in single.items():
                    names[index] = instance_id
            rank = single_ranks.pop() if uniform else None
            plain = self._plain(engine_slots)
            self._engines = _Engines(mask, masks, zero, single, rank, names, plain)
        return self._engines

    def plain_fleet(self) -> PlainFleet:
        return self._engine_set().plain

    def _plain(self, engine_slots: dict[str, list[tuple[int, int]]]) -> PlainFleet:
        """The plain query's view: each instance's (DP rank, slot index) pairs, sorted."""
        names = tuple(sorted(engine_slots))
        ranks = tuple(tuple(rank for rank, _ in engine_slots[name]) for name in names)
        bits = tuple(tuple(index for _, index in engine_slots[name]) for name in names)
        return PlainFleet(
            self._state, self.pool_members, self.profile, self.key, names, ranks, bits,
            frozenset(names),
        )  # fmt: skip

    def _holders(self, prefix_hash: PrefixHash) -> int:
        """The bits of the slots that hold this block on some tier, through a pool too."""
        held = 0
        for tier_blocks in self.blocks:
            held |= tier_blocks.get(prefix_hash, 0)
        pools = held & self.pool_mask
        if pools:
            held |= self.pool_members.get(pools) or self._members(pools)
        return held

    def _walk_tiers(self, hashes: Sequence[PrefixHash], interest: int) -> list[_Stop]:
        """The general walk: GPU, then the slot's own CPU, then CPU through a pool, then
        DISK (own or a pool's); each slot stops on its own, on each tier (in C, on the
        masks as machine words: in Python each tier of each block made owner-wide ints)."""
        return self._state.walk_tiers(hashes, interest, self.pool_members)

    def _members(self, pools: int) -> int:
        """The engine slots served by several pools that hold the same block."""
        members = 0
        while pools:
            low = pools & -pools
            members |= self.pool_members[low]
            pools ^= low
        return members


def _members(
    by_rank: dict[int, set[tuple[ContextKey, SlotKey]]],
) -> list[tuple[ContextKey, SlotKey]]:
    """Every (context, slot key) of a stream, whatever its rank."""
    return [member for members in by_rank.values() for member in members]


def _tokens(blocks: TierHits, block_size: int) -> TierHits:
    return (
        blocks[0] * block_size,
        blocks[1] * block_size,
        blocks[2] * block_size,
        blocks[3] * block_size,
    )


def count_packed(stats: ApplyStats, start: int, applied: Applied) -> int:
    """An answer of ``apply_packed`` from event ``start`` on, counted into ``stats``;
    returns the first event not applied."""
    reached, stored, removed, orphaned, mismatched = applied
    stats.events += reached - start
    stats.blocks_stored += stored
    stats.blocks_removed += removed
    stats.orphaned += orphaned
    stats.drop("token_count_mismatch", mismatched)
    return reached


class PrefixCacheTable:
    """Every context, every stream's membership, and the operations the service needs."""

    def __init__(self, max_dp_ranks: int = 16, max_lora_contexts: int = 64) -> None:
        self.contexts: dict[ContextKey, PrefixContext] = {}
        self._sources: dict[str, StreamSource] = {}
        # stream -> DP rank (STORE_POOL_RANK: its kv_store pools) -> (context, slot key)
        self._stream_slots: dict[str, dict[int, set[tuple[ContextKey, SlotKey]]]] = {}
        self._stream_contexts: dict[str, set[ContextKey]] = {}
        self.max_dp_ranks = max_dp_ranks  # the engine ranks one stream may own
        self.max_lora_contexts = max_lora_contexts  # the contexts one stream may own blocks in
        # kv_store -> engine hashes its pools received since its running check began
        self._store_checks: dict[str, set[EngineHash]] = {}
        self.stores_down: set[str] = set()  # their CPU events are dropped, their pools empty
        # (stream, DP rank, event LoRA) -> the context and engine slot its stored events go
        # to, once they went there: what _store would look up again for every event. Only
        # remove_stream drops slots and contexts; it (and a new registration) empties it.
        self._targets: dict[tuple[str, int, str | None], tuple[PrefixContext, _Slot]] = {}
        self._on_slots_change: Callable[[ContextKey], None] | None = None

    def watch_slots(self, listener: Callable[[ContextKey], None] | None) -> None:
        """``listener`` is told a context's key before any of its slots comes or goes (the
        context itself too) or a pool's members change (conductor.query_thread)."""
        self._on_slots_change = listener
        for context in self.contexts.values():
            context.on_slots_change = listener

    # -- membership ----------------------------------------------------------------------
    def add_stream(self, source: StreamSource) -> None:
        """Make ``source``'s instance a member of its context (listed, zero hits)."""
        self._sources[source.key] = source
        self._targets.clear()
        self._stream_slots.setdefault(source.key, {})
        self._stream_contexts.setdefault(source.key, set())
        self._slot_for(source, source.context_key(), source.dp_rank)

    def remove_stream(self, key: str) -> int:
        """Unregister: drop every block the stream's owners held. Returns blocks dropped.

        A kv_store pool is no owner of the stream: its blocks stay in the store, so it keeps
        them while another registration names that store in the context.
        """
        source = self._sources.pop(key, None)
        self._targets.clear()
        kv_store = source.kv_store if source else ""
        if kv_store and all(s.kv_store != kv_store for s in self._sources.values()):
            self.stores_down.discard(kv_store)  # the last one naming it: nothing is kept
            self.end_store_check(kv_store)
        dropped = 0
        self._stream_contexts.pop(key, None)
        for context_key, slot_key in _members(self._stream_slots.pop(key, {})):
            context = self.contexts[context_key]
            slot = context.slots[slot_key]
            slot.streams.discard(key)
            if not slot.streams:
                dropped += sum(h.count() for h in slot.holdings)
                context.drop_slot(slot)
            elif not slot.kv_store:
                dropped += context.clear_slot(slot)
                if not slot.shared_pool:
                    context.set_membership(slot, self._kv_stores(slot))
            if context.is_empty():
                del self.contexts[context_key]
        return dropped

    def clear_stream(self, key: str, dp_rank: int | None = None) -> int:
        """A publisher restart, lost connection or AllBlocksCleared: forget the owners'
        blocks, stay listed. kv_store pools keep theirs: the store still holds them."""
        by_rank = self._stream_slots.get(key, {})
        members = _members(by_rank) if dp_rank is None else by_rank.get(dp_rank, ())
        dropped = 0
        for context_key, slot_key in members:
            slot = self.contexts[context_key].slots[slot_key]
            if not slot.kv_store:
                dropped += self.contexts[context_key].clear_slot(slot)
        return dropped

    def clear_store(self, kv_store: str) -> int:
        """The store's master restarted: its pool is empty in every context (the engines'
        own blocks and the pool memberships stay). Returns how many blocks were dropped."""
        dropped = 0
        for context in self.contexts.values():
            pool = context.slots.get((kv_store, STORE_POOL_RANK))
            if pool is not None:
                dropped += context.clear_slot(pool)
        return dropped

    # -- kv_store checks (the store evicts without an event) -----------------------------
    def begin_store_check(self, kv_store: str) -> None:
        """Remember from now on which blocks the store's pools receive: the key list the
        check is about to fetch may predate them, and they must not be taken for evicted."""
        self._store_checks[kv_store] = set()

    def end_store_check(self, kv_store: str) -> None:
        self._store_checks.pop(kv_store, None)

    def reconcile_store(
        self, kv_store: str, present: AbstractSet[EngineHash], step: int = RECONCILE_STEP
    ) -> Iterator[int]:
        """A check of the store answered: ``present`` holds the engine hash of each of its
        keys. Every pool block it lacks that was not announced since the check began was
        evicted, and goes; the store's CPU events are indexed again at once.

        Yields the blocks dropped after each ``step`` pool blocks looked at, so that with a
        million of them the caller can let queries and events run in between (a block
        announced meanwhile is kept like any other announced during the check).
        """
        self.stores_down.discard(kv_store)
        pool_key = (kv_store, STORE_POOL_RANK)
        for context_key in [k for k, c in self.contexts.items() if pool_key in c.slots]:
            context, pool = self._pool(context_key, pool_key)
            held = list(pool.holdings[Tier.CPU].by_engine_hash) if pool else []
            for start in range(0, len(held), step):
                context, pool = self._pool(context_key, pool_key)
                if context is None or pool is None:  # its last registration left meanwhile
                    break
                holds = pool.holdings[Tier.CPU].by_engine_hash
                announced = self._store_checks.get(kv_store, ())
                gone = [
                    engine_hash
                    for engine_hash in held[start : start + step]
                    if engine_hash not in present
                    and engine_hash not in announced
                    and engine_hash in holds
                ]
                context.evict(pool, Tier.CPU, gone)
                yield len(gone)

    # -- snapshots ----------------------------------------------------------------------
    def restored_slot(
        self, context_key: ContextKey, slot_key: SlotKey, streams: Iterable[str]
    ) -> tuple[PrefixContext, _Slot] | None:
        """The slot a snapshot's owner is restored into, made and linked to its registered
        ``streams`` as their stored events made and linked it; None when none of them is
        registered, or when none of them could have stored it: a slot of another instance,
        a context of another tenant, model or block size, a DP rank < 0, one slot or
        context more than the stream's limits, a context keyed by another hash profile (a
        snapshot may come from a peer, and is held to what ``_store`` allows). A kv_store
        pool is made by the engine slots saving to it: they are restored first."""
        instance_id, dp_rank = slot_key
        if dp_rank == STORE_POOL_RANK:
            context = self.contexts.get(context_key)
            pool = context.slots.get(slot_key) if context is not None else None
            return (context, pool) if context is not None and pool is not None else None
        if dp_rank < 0:
            return None
        target = None
        for key in streams:
            source = self._sources.get(key)
            if (
                source is None
                or source.instance_id != instance_id
                or source.context_key(context_key.lora_name) != context_key
                or self._over_limit(source, context_key, dp_rank)
            ):
                continue
            known = self.contexts.get(context_key)
            if known is not None and known.profile != source.hash_profile:
                return None
            target = self._slot_for(source, context_key, dp_rank)
        return target

    def _pool(
        self, context_key: ContextKey, pool_key: SlotKey
    ) -> tuple[PrefixContext | None, _Slot | None]:
        context = self.contexts.get(context_key)
        return context, context.slots.get(pool_key) if context else None

    def store_down(self, kv_store: str) -> int:
        """A check failed: the store may be gone or restart empty, so its pools are emptied
        and its CPU events dropped until a check answers. Returns the blocks dropped."""
        self.stores_down.add(kv_store)
        return self.clear_store(kv_store)

    def _slot_for(
        self, source: StreamSource, context_key: ContextKey, dp_rank: int
    ) -> tuple[PrefixContext, _Slot]:
        """The stream's engine slot in a context, linked (with its kv_store's pool) once."""
        context = self.contexts.get(context_key)
        if context is None:
            context = PrefixContext(context_key, source.hash_profile)
            context.on_slots_change = self._on_slots_change
            self.contexts[context_key] = context
        slot = context.slot(source.instance_id, dp_rank, source.shared_pool)
        if source.key not in slot.streams:
            self._link(source.key, context, slot)
            if source.kv_store:
                self._link(source.key, context, context.store_pool(source.kv_store))
                context.set_membership(slot, self._kv_stores(slot))
        return context, slot

    def _link(self, key: str, context: PrefixContext, slot: _Slot) -> None:
        slot.streams.add(key)
        rank = STORE_POOL_RANK if slot.kv_store else slot.dp_rank
        slot_key = (slot.instance_id, slot.dp_rank)
        self._stream_slots[key].setdefault(rank, set()).add((context.key, slot_key))
        self._stream_contexts[key].add(context.key)

    def _over_limit(self, source: StreamSource, context_key: ContextKey, dp_rank: int) -> str:
        """Why a stored event would create one slot or context too many ("" = it may)."""
        ranks = self._stream_slots[source.key]
        if dp_rank not in ranks and len(ranks.keys() - {STORE_POOL_RANK}) >= self.max_dp_ranks:
            return "dp_rank_limit"
        contexts = self._stream_contexts[source.key]
        if context_key not in contexts and len(contexts) >= self.max_lora_contexts:
            return "lora_limit"
        return ""

    def _kv_stores(self, slot: _Slot) -> set[str]:
        """The stores an engine slot's registrations save to: the pools it is a member of."""
        return {self._sources[k].kv_store for k in slot.streams} - {""}

    # -- ingestion -----------------------------------------------------------------------
    def apply(self, key: str, batch: EventBatch, stats: ApplyStats | None = None) -> ApplyStats:
        """Apply one decoded batch of the stream ``key`` in order, in one step; what it did
        is added to ``stats`` when given."""
        return self.apply_events(key, batch.events, batch.dp_rank, stats)

    def apply_events(
        self,
        key: str,
        events: Iterable[Event],
        dp_rank: int | None = None,
        stats: ApplyStats | None = None,
    ) -> ApplyStats:
        """``apply`` for some of a batch's events (``dp_rank`` is the batch's): the manager
        applies a batch in steps."""
        source = self._sources[key]
        rank = source.dp_rank if dp_rank is None else dp_rank
        stats = ApplyStats() if stats is None else stats
        for event in events:
            stats.events += 1
            if isinstance(event, BlockStored):
                self._store(source, rank, event, stats)
            elif isinstance(event, BlockRemoved):
                self._remove(source, rank, event, stats)
            elif isinstance(event, AllBlocksCleared):
                self.clear_stream(key, rank)
                stats.clears += 1
        return stats

    def apply_packed(
        self,
        key: str,
        packed: PackedBatch,
        start: int,
        stats: ApplyStats,
        max_blocks: int = sys.maxsize,
    ) -> int | None:
        """``apply_events`` for a batch the C lane read, from event ``start`` on until about
        ``max_blocks`` blocks were applied (at least one event). Returns the first event
        not applied, or None (nothing applied) when the stream is not in the state the lane
        covers (``_lane_target``), and the caller must decode the batch."""
        target = self._lane_target(key, packed)
        if target is None:
            return None
        context, slot, root = target
        return count_packed(
            stats, start, context.apply_packed(slot, packed, start, max_blocks, root)
        )

    def submit_packed(
        self, key: str, packed: PackedBatch, lane: IngestLane, on_applied: OnApplied
    ) -> bool:
        """``apply_packed`` of the whole batch on the ingest thread, its answer to
        ``on_applied`` (``count_packed`` counts it); False, nothing given, as None there."""
        target = self._lane_target(key, packed)
        if target is None:
            return False
        context, slot, root = target
        context.submit_packed(lane, slot, packed, root, on_applied)
        return True

    def _lane_target(
        self, key: str, packed: PackedBatch
    ) -> tuple[PrefixContext, _Slot, int | None] | None:
        """The context, slot and hash chain root the C lane applies the stream's batch to
        (None for a profiled stream: its engine hashes are the keys), or None when the
        stream is not in the state the lane covers: the lane applies what
        ``_store`` and ``_remove`` do for an engine's own GPU blocks once its first stored
        event made its slot, in a context where no other of the stream's slots at that
        rank, and no other tier of this one, could take a removal."""
        if not self.lane_takes(key):
            return None
        source = self._sources[key]
        rank = source.dp_rank if packed.dp_rank is None else packed.dp_rank
        target = self._targets.get((key, rank, None))
        if target is None:
            return None
        context, slot = target
        if packed.removals and not (
            self._stream_slots[key].get(rank) == {(context.key, (slot.instance_id, rank))}
            and not slot.holdings[Tier.CPU].by_engine_hash
            and not slot.holdings[Tier.DISK].by_engine_hash
        ):
            return None
        return context, slot, None if source.hash_profile else salt_root(source.salt)

    def lane_takes(self, key: str) -> bool:
        """Whether the C lane may apply the stream's batches at all: not a pool's (its
        blocks go to the pool's slot)."""
        source = self._sources.get(key)
        return source is not None and not source.shared_pool

    def _store(
        self, source: StreamSource, dp_rank: int, event: BlockStored, stats: ApplyStats
    ) -> None:
        if event.group_idx:  # sliding-window / secondary KV groups are no reusable prefix
            stats.ignored += 1
            return
        if event.block_size is not None and event.block_size != source.block_size:
            stats.drop("block_size_mismatch")
            stats.foreign_block_size = event.block_size
            return
        if not event.block_hashes:
            stats.ignored += 1
            return
        tier = source.default_tier if event.tier is None else event.tier
        saved = tier is Tier.CPU and source.kv_store  # saved to the store, not kept by the engine
        if saved and source.kv_store in self.stores_down:
            stats.drop("kv_store_down")
            return
        target_key = (source.key, dp_rank, event.lora_name)
        target = self._targets.get(target_key)
        if target is None:
            context_key = source.context_key(event.lora_name)
            limit = self._over_limit(source, context_key, dp_rank)
            if limit:
                stats.drop(limit)
                return
            known = self.contexts.get(context_key)
            if known is not None and known.profile != source.hash_profile:
                stats.drop("hash_profile_mismatch")  # another LoRA's context, keyed otherwise
                return
        else:
            known = target[0]
        owner = (source.instance_id, dp_rank)
        prefixes = self._prefixes(known, owner, source, event, stats)
        if not prefixes:
            return  # counted by _prefixes; nothing created for a rejected event
        if target is None:
            target = self._targets[target_key] = self._slot_for(source, context_key, dp_rank)
        context, slot = target
        if saved:
            slot = context.store_pool(source.kv_store)
            announced = self._store_checks.get(source.kv_store)
            if announced is not None:
                announced.update(event.block_hashes)
        stats.blocks_stored += context.hold(slot, tier, event.block_hashes, prefixes)

    @staticmethod
    def _prefixes(
        context: PrefixContext | None,
        owner: SlotKey,
        source: StreamSource,
        event: BlockStored,
        stats: ApplyStats,
    ) -> list[PrefixHash]:
        """The prefix hash of each stored block, or as many as can be placed ([] = none).
        A profiled stream's blocks are keyed by their engine hashes: tokens and parent are
        not needed."""
        hashes, size = event.block_hashes, source.block_size
        if source.hash_profile is not None:
            return cast(list[PrefixHash], list(hashes))
        if event.token_ids:
            if len(event.token_ids) != len(hashes) * size:
                stats.drop("token_count_mismatch")
                return []
            if event.parent_hash is None:
                parent = salt_root(event.salt or source.salt)
            else:
                known = context.prefix_of(event.parent_hash, owner) if context else None
                if known is None:
                    stats.orphaned += 1
                    return []
                parent = known
            return chain_hashes(parent, event.token_ids, size)
        placed: list[PrefixHash] = []  # no tokens: place through hashes published with tokens
        for engine_hash in hashes:
            prefix_hash = context.prefix_of(engine_hash, owner) if context else None
            if prefix_hash is None:
                stats.drop("unknown_block_without_tokens")
                break
            placed.append(prefix_hash)
        return placed

    def _remove(
        self, source: StreamSource, dp_rank: int, event: BlockRemoved, stats: ApplyStats
    ) -> None:
        if event.group_idx:
            stats.ignored += 1
            return
        by_rank = self._stream_slots[source.key]
        here = by_rank.get(dp_rank, ())
        if len(here) == 1 and STORE_POOL_RANK not in by_rank:
            # the usual case, an engine's one slot at the rank, without building lists: the
            # same as below (a removal's Python steps cost a third of its time at 320k blocks)
            ((context_key, slot_key),) = here
            context = self.contexts[context_key]
            slot = context.slots[slot_key]
            holds = [t for t in self._removal_tiers(slot, dp_rank, event.tier)
                     if slot.holdings[t].by_engine_hash]  # fmt: skip
            if len(holds) == 1:
                stats.blocks_removed += context.release_many(slot, holds[0], event.block_hashes)
                return
        reached = [*here, *by_rank.get(STORE_POOL_RANK, ())]
        owned = [
            (self.contexts[ck], slot, tier)
            for ck, sk in reached
            for slot in (self.contexts[ck].slots[sk],)
            for tier in self._removal_tiers(slot, dp_rank, event.tier)
            if slot.holdings[tier].by_engine_hash  # nothing to release there
        ]
        if not owned:
            return
        if len(owned) == 1:  # the common case: an engine's own blocks on one tier
            context, slot, tier = owned[0]
            stats.blocks_removed += context.release_many(slot, tier, event.block_hashes)
            return
        for engine_hash in event.block_hashes:
            released = [context.release(slot, tier, engine_hash) for context, slot, tier in owned]
            stats.blocks_removed += any(released)

    @staticmethod
    def _removal_tiers(slot: _Slot, dp_rank: int, medium: Tier | None) -> tuple[Tier, ...]:
        """Where a removal reaches: an engine slot at the batch rank on the event's tier (no
        medium: wherever it is); a kv_store pool only when the medium says CPU, because a
        medium-less removal is the engine's own eviction, not the store's."""
        if slot.kv_store:
            return (Tier.CPU,) if medium is Tier.CPU else ()
        if slot.dp_rank != dp_rank:
            return ()
        return TIERS if medium is None else (medium,)

    # -- queries -------------------------------------------------------------------------
    def match_tokens(
        self,
        context_key: ContextKey,
        token_ids: Sequence[int],
        salt: str = "",
        instance_id: str | None = None,
    ) -> dict[str, InstanceMatch] | None:
        """Per-instance cumulative matches of a prompt; None when the context is unknown.
        ``salt`` roots the Go chain, or is vLLM's cache salt in a profiled context."""
        context = self.contexts.get(context_key)
        if context is None:
            return None
        return context.match(context.query_hashes(token_ids, salt), instance_id)

    def plain_fleet(self, context_key: ContextKey) -> PlainFleet | None:
        """The context's ``PlainFleet``; None when its queries are not plain, or it is unknown."""
        context = self.contexts.get(context_key)
        return None if context is None else context.plain_fleet()

    def match_prefix_hashes(
        self,
        context_key: ContextKey,
        hashes: Sequence[PrefixHash],
        instance_id: str | None = None,
    ) -> dict[str, InstanceMatch] | None:
        """The same answer for a prompt its caller hashed already (``prefix_hashes``)."""
        context = self.contexts.get(context_key)
        return None if context is None else context.match(hashes, instance_id)

    def match_engine_hashes(
        self,
        context_key: ContextKey,
        engine_hashes: Sequence[EngineHash],
        instance_id: str | None = None,
    ) -> dict[str, InstanceMatch] | None:
        """The same answer for a prompt given as the engine's own block hashes."""
        context = self.contexts.get(context_key)
        if context is None:
            return None
        prefix_of = context.engine_prefix.get
        return context.match([prefix_of(h, UNKNOWN_PREFIX) for h in engine_hashes], instance_id)

    def tenants(self) -> set[str]:
        return {key.tenant_id for key in self.contexts}

    def model_contexts(self, model_name: str) -> list[ContextKey]:
        """The contexts of a model, in the order they were created (what a query that
        matched no context could have asked for)."""
        return [key for key in self.contexts if key.model_name == model_name]

    # -- views (the read API of everything outside the index) ----------------------------
    def context_count(self) -> int:
        return len(self.contexts)

    def context_views(self) -> list[ContextView]:
        """Every context's counts and owners, in the order the contexts were created."""
        return [context.view() for context in self.contexts.values()]

    def held_hashes(self, context_key: ContextKey) -> Iterator[tuple[EngineHash, PrefixHash]]:
        """The engine hash -> prefix hash mappings of a context's owners (lazily: a view
        asks for a few of possibly millions)."""
        context = self.contexts.get(context_key)
        return context.held_hashes() if context is not None else iter(())

    def block_count(self) -> int:
        return sum(sum(c.block_counts()) for c in self.contexts.values())

    def prefix_count(self, context_key: ContextKey) -> int:
        """A context's distinct prefix blocks over every tier (0: no such context)."""
        context = self.contexts.get(context_key)
        return context.prefix_count() if context is not None else 0

    def store_blocks(self) -> dict[str, int]:
        """Blocks per kv_store over every context; each store some registration names."""
        blocks: dict[str, int] = {}
        for context in self.contexts.values():
            for pool in context.store_pools():
                blocks[pool.kv_store] = blocks.get(pool.kv_store, 0) + pool.blocks
        return blocks
