"""A paged KV block pool with prefix caching that behaves — and publishes — like vLLM 0.33.

The simulator's cache must make the same decisions a real engine would (which prefix hits,
which block is evicted) and announce them with the same KV events, because the conductor's
index and the router's choices are only as right as those events. So this mirrors vLLM's
``KVCacheManager`` + ``BlockPool``:

- A request's complete blocks are identified by chained block hashes (``block_hash``). The
  longest prefix of them cached on the GPU is reused; at least one prompt token is always
  recomputed (vLLM caps the hit at ``len(prompt) - 1`` tokens).
- Free blocks sit in one queue, least recently used first; cached blocks stay cached while
  free and are evicted only when popped for reuse (one ``BlockRemoved`` per evicted hash).
  ``free`` releases a request's blocks in *reverse* order, as vLLM does, so a chain's tail is
  evicted before its head and shared prefixes survive longest.
- Blocks are cached (one ``BlockStored`` per call, parent = previous block's hash) as soon
  as the tokens scheduled to fill them are: at ``allocate`` the complete blocks of the
  prompt's first chunk (vLLM caches at scheduling time), then those of each later prefill
  chunk or decode token ``append_tokens`` schedules. A block whose hash is already cached is
  cached again (a duplicate), and announced again, as vLLM does.
- Optional CPU tier (``num_cpu_blocks > 0``): a victim cache. Unlike vLLM's offloading
  connector, which copies blocks out as they are computed, a block moves to the CPU only
  when the GPU evicts it, so the CPU holds what the GPU lost: ``BlockStored`` medium CPU,
  then the GPU ``BlockRemoved``. The CPU tier evicts LRU (``BlockRemoved`` medium CPU). A
  prefix hit continues from the GPU hit into consecutive CPU blocks, which are loaded back
  into fresh GPU blocks (cached and announced on the GPU) and stay on the CPU. As with
  vLLM's connector, the CPU walk starts where the GPU hit ends and stops at the first block
  the CPU does not hold.
- External tier (a KV connector's store, e.g. vLLM's ``MooncakeStoreConnector``): the caller
  looks the prompt up in the store and loads what it can before admission, then passes the
  range of prompt blocks it loaded; the hit continues into that range from where the GPU
  and CPU hits end (a gap means recompute). Loaded blocks are cached and announced on the
  GPU like any other; the external tier's own events are the connector's business.

SGLang mode (``engine="sglang"``: SGLang 0.5.23's radix cache, as
``tests/fixtures/sglang_frames.json`` captured it; pages are blocks here):

- Pages are hashed with SGLang's chain (``block_hash.SGLangBlockHasher``); the hit rule is
  the same (at most ``len(prompt) - 1`` tokens, whole pages).
- A prefill chunk's pages enter the cache when the chunk is computed (``checkpoint``, which
  the scheduler calls as the step completes), a finished request's pages, outputs
  included, when it is freed; decode pages never before. Pages another request cached
  meanwhile are adopted, never cached twice nor announced twice. Each insert is one
  radix node; a node is split where a later match ends.
- Pages not in the cache are reused before anything is evicted; eviction takes the least
  recently used node (a leaf: children are used no later than their parents) whole, as
  SGLang evicts a leaf, and announces its pages in one BlockRemoved, in chain order.
- Events are coalesced as SGLang's recorder does: a removal extends the removal before it,
  a store continuing the chain of the store before it extends that store.
- The cache starts with an AllBlocksCleared (SGLang's sequence 0). No CPU tier.

Everything is synchronous and O(blocks touched) per call: the asyncio shell calls it once
per request and step, and the trace simulator thousands of times a second. Events
accumulate until ``take_events`` (the shell publishes one batch per engine step). Each
event is a ``WireEvent`` (``publishers.encoding``): the typed event plus the fields only
vLLM's wire carries — the per-block untagged ``extra_keys`` and the LoRA ``lora_id`` — so
the publisher encodes exactly what vLLM would send.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from conductor.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier

from ..encoding import WireEvent
from .block_hash import (
    BlockHasher,
    Engine,
    ExtraKeys,
    LoraAdapter,
    PageHasher,
    SGLangBlockHasher,
    event_extra_keys,
)

KV_CACHE_GROUP = 0  # vLLM's BlockPool tags every event with the (single) KV-cache group 0


class CapacityError(ValueError):
    """The request needs more blocks than the pool has: it can never run on this engine."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """What the scheduler and timing model need to know about an admitted prompt."""

    num_prompt_tokens: int
    num_cached_tokens: int  # not recomputed: the GPU hit plus the loaded tokens
    num_cpu_loaded_tokens: int  # part of ``num_cached_tokens`` copied back from the CPU tier
    block_hashes: tuple[int, ...]  # event hashes of the prompt's complete blocks
    num_scheduled_tokens: int  # of ``num_new_tokens``, those given KV slots now (a chunk)
    num_external_loaded_tokens: int = 0  # part of ``num_cached_tokens`` from the external tier

    @property
    def num_loaded_tokens(self) -> int:
        """Cached tokens that are not on the GPU: they cost a load, not a computation."""
        return self.num_cpu_loaded_tokens + self.num_external_loaded_tokens

    @property
    def num_new_tokens(self) -> int:
        """Tokens the prefill must compute."""
        return self.num_prompt_tokens - self.num_cached_tokens


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Cumulative prefix-cache counters (vLLM's ``prefix_cache_queries/hits`` and, for the
    external tier, ``external_prefix_cache_queries/hits``: the prompt past the GPU hit)."""

    requests: int = 0
    query_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    external_query_tokens: int = 0
    external_hit_tokens: int = 0


class _CachedBlock(NamedTuple):  # a tuple: built once per hashed block, so it must be cheap
    """A full block's identity and everything needed to announce it again later (offload)."""

    digest: bytes
    event_hash: int
    parent_event_hash: int | None
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys  # untagged, as events carry them
    lora: LoraAdapter | None
    cache_salt: str | None  # set on block 0 only: what a consumer reads from its extra keys


class _Node:
    """SGLang's radix node: the pages one insert added, until a match splits them."""

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids  # in chain order


@dataclass(slots=True)
class _Request:
    token_ids: list[int]  # every token known, scheduled or not
    lora: LoraAdapter | None
    cache_salt: str | None
    blocks: list[_CachedBlock] = field(default_factory=list)  # its complete blocks, in order
    block_ids: list[int] = field(default_factory=list)  # GPU blocks, in order
    num_scheduled_tokens: int = 0  # the first tokens that have KV slots
    num_cached_blocks: int = 0  # the first ``blocks`` cached on the GPU and announced


class BlockManager:
    """One engine's (one DP rank's) KV cache: ``num_gpu_blocks`` blocks of ``block_size``,
    managed as ``engine`` (vLLM or SGLang) manages it."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        hasher: PageHasher | None = None,
        engine: Engine = "vllm",
    ) -> None:
        if num_gpu_blocks <= 0 or block_size <= 0 or num_cpu_blocks < 0:
            raise ValueError("num_gpu_blocks and block_size must be > 0, num_cpu_blocks >= 0")
        if engine == "sglang" and num_cpu_blocks:
            raise ValueError("a CPU tier is not simulated for SGLang")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.engine = engine
        self._radix = engine == "sglang"
        self._hasher = hasher or (SGLangBlockHasher() if self._radix else BlockHasher())
        self._nodes: dict[int, _Node] = {}  # SGLang: each cached block's radix node
        self._ref_counts = [0] * num_gpu_blocks
        self._gpu_blocks: list[_CachedBlock | None] = [None] * num_gpu_blocks
        self._gpu_cache: dict[bytes, list[int]] = {}  # digest -> block ids (duplicates)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_gpu_blocks))
        self._cpu_cache: OrderedDict[bytes, _CachedBlock] = OrderedDict()  # LRU first
        self._requests: dict[str, _Request] = {}
        self._events: list[WireEvent] = []
        self._stats = CacheStats()
        # the last refused prompt's hashes: the scheduler retries its queue head every step,
        # and hashing a long prompt again each time would dominate the simulator
        self._refused: tuple[str, int, list[_CachedBlock]] | None = None
        if self._radix:  # SGLang's cache resets as it starts: its first batch says so
            self._events.append(WireEvent(AllBlocksCleared()))

    # -- request lifecycle -------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        *,
        lora: LoraAdapter | None = None,
        cache_salt: str | None = None,
        token_budget: int | None = None,
        chunked: bool = True,
        external: range | None = None,
        read_cache: bool = True,
    ) -> Allocation | None:
        """Admit a prompt: reuse its cached prefix, take blocks for the rest, cache it.

        ``external``: the prompt's blocks (by index) already loaded from the external tier;
        None when the engine has no such tier (nothing is counted as queried).
        ``read_cache`` False: nothing is reused, nor counted in ``stats`` (vLLM's
        ``skip_reading_prefix_cache``); the prompt's blocks are cached all the same.

        With a ``token_budget`` only that many uncached tokens are scheduled now (a chunked
        prefill's first chunk; ``append_tokens`` schedules the rest), or, with ``chunked``
        False, the prompt waits until its whole remainder fits the budget, as vLLM without
        chunked prefill. Returns None, changing nothing, when the blocks (or the budget) are
        not free now; raises CapacityError when the pool can never hold the prompt.
        ``stats`` count admitted prompts only, so a retried request is counted once.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated")
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        self._blocks_for(len(token_ids))  # the whole prompt must fit, eventually
        request = _Request(list(token_ids), lora, cache_salt)
        refused, self._refused = self._refused, None
        if refused is not None and refused[:2] == (request_id, len(token_ids)):
            request.blocks = refused[2]
        else:
            request.blocks = self._complete_blocks(request, 0)

        hit_limit = (len(token_ids) - 1) // self.block_size if read_cache else 0
        gpu_hits: list[int] = []
        for block in request.blocks[:hit_limit]:
            cached = self._gpu_cache.get(block.digest)
            if cached is None:
                break
            gpu_hits.append(cached[0])
        num_cpu_hits = 0
        for block in request.blocks[len(gpu_hits) : hit_limit]:
            if block.digest not in self._cpu_cache:
                break
            num_cpu_hits += 1
        num_external_hits = 0
        start = len(gpu_hits) + num_cpu_hits
        if external is not None and external.start <= start < external.stop:
            num_external_hits = max(0, min(external.stop, hit_limit) - start)

        num_cached_blocks = len(gpu_hits) + num_cpu_hits + num_external_hits
        num_cached_tokens = num_cached_blocks * self.block_size
        num_uncached = len(token_ids) - num_cached_tokens
        num_scheduled = num_uncached if token_budget is None else min(num_uncached, token_budget)
        num_new_blocks = self._blocks_for(num_cached_tokens + num_scheduled) - len(gpu_hits)
        free_hits = sum(1 for block_id in gpu_hits if self._ref_counts[block_id] == 0)
        if num_new_blocks > len(self._free) - free_hits or (
            not chunked and num_scheduled < num_uncached
        ):
            self._refused = (request_id, len(token_ids), request.blocks)
            return None

        if self._radix and gpu_hits:  # SGLang's match splits the node where the hit ends
            self._split_after(gpu_hits[-1])
        for block_id in gpu_hits:  # before taking new blocks, so hits cannot be evicted
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        for block in request.blocks[len(gpu_hits) : len(gpu_hits) + num_cpu_hits]:
            self._cpu_cache.move_to_end(block.digest)
        new_block_ids = [self._take_free_block() for _ in range(num_new_blocks)]
        request.block_ids = gpu_hits + new_block_ids
        request.num_scheduled_tokens = num_cached_tokens + num_scheduled
        request.num_cached_blocks = len(gpu_hits)
        if not self._radix:  # vLLM caches at scheduling; SGLang at ``checkpoint``
            self._cache_on_gpu(request)
        self._requests[request_id] = request

        gpu_hit_tokens = len(gpu_hits) * self.block_size
        cpu_hit_tokens = num_cpu_hits * self.block_size
        external_hit_tokens = num_external_hits * self.block_size
        stats = self._stats
        if read_cache:
            self._stats = CacheStats(
                stats.requests + 1,
                stats.query_tokens + len(token_ids),
                stats.gpu_hit_tokens + gpu_hit_tokens,
                stats.cpu_hit_tokens + cpu_hit_tokens,
                stats.external_query_tokens
                + (0 if external is None else len(token_ids) - gpu_hit_tokens),
                stats.external_hit_tokens + external_hit_tokens,
            )
        return Allocation(
            num_prompt_tokens=len(token_ids),
            num_cached_tokens=num_cached_tokens,
            num_cpu_loaded_tokens=cpu_hit_tokens,
            block_hashes=tuple(block.event_hash for block in request.blocks),
            num_scheduled_tokens=num_scheduled,
            num_external_loaded_tokens=external_hit_tokens,
        )

    def prompt_digests(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: LoraAdapter | None = None,
    ) -> list[bytes]:
        """The digests of a prompt's complete blocks, as ``allocate`` will hash them."""
        return self._hasher.block_digests(
            token_ids, self.block_size, lora=lora, cache_salt=cache_salt
        )

    def num_gpu_prefix_blocks(self, digests: Sequence[bytes]) -> int:
        """How many of these leading blocks the GPU caches now (changes nothing)."""
        count = 0
        for digest in digests:
            if digest not in self._gpu_cache:
                break
            count += 1
        return count

    def append_tokens(
        self, request_id: str, token_ids: Sequence[int], num_tokens: int | None = None
    ) -> bool:
        """Add tokens to the request's sequence (sampled ones; may be none) and schedule its
        next ``num_tokens`` (default: the added ones) — a decode, or a prefill's next chunk.

        Blocks the scheduled tokens complete are cached. Returns False, changing nothing,
        when a new block is needed and none is free (vLLM would preempt a request); raises
        CapacityError past the pool's size.
        """
        request = self._requests[request_id]
        scheduled = request.num_scheduled_tokens + (
            len(token_ids) if num_tokens is None else num_tokens
        )
        if scheduled > len(request.token_ids) + len(token_ids):
            raise ValueError(f"request {request_id!r} cannot schedule tokens it does not have")
        num_new_blocks = self._blocks_for(scheduled) - len(request.block_ids)
        if num_new_blocks > len(self._free):
            return False
        if token_ids:
            request.token_ids.extend(token_ids)
            request.blocks.extend(self._complete_blocks(request, len(request.blocks)))
        request.block_ids.extend(self._take_free_block() for _ in range(num_new_blocks))
        request.num_scheduled_tokens = scheduled
        if not self._radix:
            self._cache_on_gpu(request)
        return True

    def checkpoint(self, request_id: str) -> None:
        """The request's scheduled tokens are computed: SGLang caches the pages they complete
        now (``checkpoint_kv_cache`` after a prefill chunk). vLLM cached them when they were
        scheduled: nothing to do."""
        request = self._requests.get(request_id)
        if self._radix and request is not None:
            self._insert(request)

    def free(self, request_id: str, *, finished: bool = True) -> None:
        """Release a finished or aborted request's blocks; they stay cached until evicted.

        Tail first, as vLLM does, so the end of a chain is evicted before its prefix.
        Unknown ids are ignored: an abort may race with a request that never got blocks.
        SGLang first caches a finished request's pages (not a preempted one's, ``finished``
        False) and reuses pages it did not cache before evicting any.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if self._radix and finished:
            self._insert(request)
        for block_id in reversed(request.block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._radix and self._gpu_blocks[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def reset(self) -> bool:
        """Drop every cached block (vLLM's ``reset_prefix_cache``); False while requests run.

        The CPU tier is cleared too: consumers drop all of an engine's blocks on
        AllBlocksCleared, so keeping any would make their view wrong.
        """
        if self._requests:
            return False
        self._gpu_blocks = [None] * self.num_gpu_blocks
        self._gpu_cache.clear()
        self._cpu_cache.clear()
        self._nodes.clear()
        self._events.append(WireEvent(AllBlocksCleared()))
        return True

    def take_events(self) -> list[WireEvent]:
        """Events since the last call, in the order the changes happened."""
        events, self._events = self._events, []
        return _coalesced(events) if self._radix else events

    # -- load ------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of GPU blocks held by running requests (vLLM's ``kv_cache_usage``)."""
        return 1.0 - len(self._free) / self.num_gpu_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take now, cached-but-unused ones included."""
        return len(self._free)

    @property
    def stats(self) -> CacheStats:
        return self._stats

    # -- internals -------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.num_gpu_blocks:
            raise CapacityError(
                f"{num_tokens} tokens need {num_blocks} blocks of {self.block_size}; "
                f"the pool has {self.num_gpu_blocks}"
            )
        return num_blocks

    def _complete_blocks(self, request: _Request, start: int) -> list[_CachedBlock]:
        """Hash the request's complete blocks from index ``start`` on."""
        size = self.block_size
        tokens = request.token_ids
        parent = request.blocks[start - 1] if start else None
        digests = self._hasher.block_digests(
            tokens,
            size,
            lora=request.lora,
            cache_salt=request.cache_salt,
            start=start,
            parent=parent.digest if parent else None,
        )
        blocks: list[_CachedBlock] = []
        for index, digest in enumerate(digests, start):
            parent = _CachedBlock(
                digest=digest,
                event_hash=self._hasher.event_hash(digest),
                parent_event_hash=parent.event_hash if parent else None,
                token_ids=tuple(tokens[index * size : (index + 1) * size]),
                extra_keys=event_extra_keys(index, request.lora, request.cache_salt),
                lora=request.lora,
                cache_salt=(request.cache_salt or None) if index == 0 else None,
            )
            blocks.append(parent)
        return blocks

    def _take_free_block(self) -> int:
        """Pop the least recently used free block, evicting what it caches."""
        block_id, _ = self._free.popitem(last=False)
        block = self._gpu_blocks[block_id]
        if block is not None and self._radix:
            self._evict_node(block_id)
        elif block is not None:
            self._gpu_blocks[block_id] = None
            holders = self._gpu_cache[block.digest]
            holders.remove(block_id)
            if not holders:
                del self._gpu_cache[block.digest]
            if self.num_cpu_blocks:
                self._offload(block)
            removed = BlockRemoved([block.event_hash], Tier.GPU, KV_CACHE_GROUP)
            self._events.append(WireEvent(removed))
        self._ref_counts[block_id] = 1
        return block_id

    def _evict_node(self, block_id: int) -> None:
        """SGLang evicts the whole node of the least recently used page (a leaf): its other
        pages are free and uncached now, taken before any cached page."""
        node = self._nodes[block_id]
        hashes = []
        for member in node.block_ids:
            block = self._gpu_blocks[member]
            assert block is not None, "a radix node holds cached blocks only"
            self._gpu_blocks[member] = None
            del self._gpu_cache[block.digest], self._nodes[member]
            hashes.append(block.event_hash)
            if member != block_id:
                self._free.move_to_end(member, last=False)
        self._events.append(WireEvent(BlockRemoved(hashes, Tier.GPU)))

    def _split_after(self, block_id: int) -> None:
        """Split the node holding ``block_id`` after it, as SGLang's match and insert split a
        node where they stop inside it; the split-off pages count as used now (the match
        touched their node), so they move to the recent end if free, tail first."""
        node = self._nodes[block_id]
        at = node.block_ids.index(block_id) + 1
        if at == len(node.block_ids):
            return
        tail = _Node(node.block_ids[at:])
        del node.block_ids[at:]
        for member in reversed(tail.block_ids):
            self._nodes[member] = tail
            if member in self._free:
                self._free.move_to_end(member)

    def _insert(self, request: _Request) -> None:
        """SGLang's radix insert of the pages the request has computed and not cached: those
        another request cached meanwhile are adopted (the request's copies freed), the rest
        become one node, announced in one BlockStored."""
        index, end = request.num_cached_blocks, request.num_scheduled_tokens // self.block_size
        if index >= end:
            return
        while index < end and (cached := self._gpu_cache.get(request.blocks[index].digest)):
            self._adopt(request, index, cached[0])
            index += 1
        request.num_cached_blocks = end
        if index:
            self._split_after(request.block_ids[index - 1])
        if index == end:
            return
        node = _Node(request.block_ids[index:end])
        for block_id, block in zip(node.block_ids, request.blocks[index:end], strict=True):
            self._gpu_blocks[block_id] = block
            self._gpu_cache[block.digest] = [block_id]
            self._nodes[block_id] = node
        self._events.append(self._stored(request.blocks[index:end], Tier.GPU))

    def _adopt(self, request: _Request, index: int, block_id: int) -> None:
        """Use the cached ``block_id`` for the request's ``index``-th block; free its copy."""
        own = request.block_ids[index]
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1
        request.block_ids[index] = block_id
        self._ref_counts[own] -= 1
        if self._ref_counts[own] == 0:
            self._free[own] = None
            self._free.move_to_end(own, last=False)

    def _offload(self, block: _CachedBlock) -> None:
        if block.digest in self._cpu_cache:
            self._cpu_cache.move_to_end(block.digest)
            return
        if len(self._cpu_cache) >= self.num_cpu_blocks:
            _, victim = self._cpu_cache.popitem(last=False)
            removed = BlockRemoved([victim.event_hash], Tier.CPU, KV_CACHE_GROUP)
            self._events.append(WireEvent(removed))
        self._cpu_cache[block.digest] = block
        self._events.append(self._stored([block], Tier.CPU))

    def _cache_on_gpu(self, request: _Request) -> None:
        """Cache and announce the request's blocks its scheduled tokens have completed."""
        start = request.num_cached_blocks
        end = request.num_scheduled_tokens // self.block_size
        blocks = request.blocks[start:end]
        if not blocks:
            return
        for block_id, block in zip(request.block_ids[start:end], blocks, strict=True):
            self._gpu_blocks[block_id] = block
            self._gpu_cache.setdefault(block.digest, []).append(block_id)
        request.num_cached_blocks = end
        self._events.append(self._stored(blocks, Tier.GPU))

    def _stored(self, blocks: Sequence[_CachedBlock], tier: Tier) -> WireEvent:
        """One BlockStored for consecutive blocks of one chain, as BlockPool builds it."""
        first = blocks[0]
        lora = first.lora
        stored = BlockStored(
            block_hashes=[block.event_hash for block in blocks],
            parent_hash=first.parent_event_hash,
            token_ids=[token for block in blocks for token in block.token_ids],
            block_size=self.block_size,
            tier=tier,
            lora_name=lora.name if lora else None,
            salt=first.cache_salt,
            group_idx=KV_CACHE_GROUP,
        )
        return WireEvent(
            stored,
            lora_id=lora.adapter_id if lora else None,
            extra_keys=[block.extra_keys for block in blocks],
        )


def _coalesced(events: list[WireEvent]) -> list[WireEvent]:
    """SGLang's recorder (``KVCacheEventRecorder.enqueue``): a removal extends a removal of
    the same medium just before it; a store extends the store just before it when it
    continues that store's chain (its parent is that store's last hash) with equal fields."""
    merged: list[WireEvent] = []
    for wire in events:
        event, tail = wire.event, merged[-1].event if merged else None
        if isinstance(event, BlockRemoved) and isinstance(tail, BlockRemoved):
            if tail.tier == event.tier:
                tail.block_hashes.extend(event.block_hashes)
                continue
        elif isinstance(event, BlockStored) and isinstance(tail, BlockStored):
            if _continues(tail, event):
                tail.block_hashes.extend(event.block_hashes)
                tail.token_ids = array("i", [*tail.token_ids, *event.token_ids])
                continue
        merged.append(wire)
    return merged


def _continues(tail: BlockStored, event: BlockStored) -> bool:
    same = (tail.tier, tail.block_size, tail.salt, tail.lora_name) == (
        event.tier,
        event.block_size,
        event.salt,
        event.lora_name,
    )
    return same and bool(tail.block_hashes) and event.parent_hash == tail.block_hashes[-1]
