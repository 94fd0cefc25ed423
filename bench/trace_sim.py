"""Trace replay: the Mooncake FAST'25 traces through the router's policies, in process.

A discrete-event simulation on a virtual clock (a heap of events; no sockets, no sleeping)
of N prefill instances behind the router, wired as in production:

    engine BlockManager --take_events()--> EventBatch --apply()--> conductor PrefixCacheTable
    router: match_tokens() -> InstancePool.candidates() -> policy.choose() -> claim()

What decides a hit or a route is the project's own code: ``BlockManager`` (vLLM 0.33's
caching decisions and events), ``PrefixCacheTable`` (the conductor's index and its
``/query`` answer), ``router.pool`` (the proxy's load accounting) and ``router.policy``
(the policies). What an instance does with the requests it is sent is a simplified model of
its own, *not* the engine simulator's ``publishers.engine.scheduler.Scheduler``, so the
TTFTs are this model's:
- one prefill at a time, from a FIFO queue per instance: no per-step token budget, no
  chunked prefill, no batching of prompts, no preemption, no decode (it runs elsewhere, so
  it neither delays prefills nor holds blocks here). A prefill is compute-bound, so batching
  prompts would not finish the first one sooner;
- a prefill's blocks are allocated (and announced) all at once when it starts, as vLLM
  caches a prompt at scheduling time, and freed when it ends (its KV has gone to the decode
  instance);
- its duration is priced here, per prompt rather than per engine step: ``kv_load_seconds``
  for every reused token from its own CPU tier, plus the router's own
  ``PrefillCostModel.store_load_s`` (tokens × bytes per token ÷ the store's bandwidth) for
  every token loaded from the optional shared Mooncake store, plus ``prefill_seconds`` for
  the rest after the cached prefix (one overhead per computed prompt); loading and
  computing are not overlapped, transfers not congested. With a store, every instance
  shares it and loads what the store holds past its own hit when its prefill *starts* (the
  engine simulator looks the store up before queueing); the router prices that pull at the
  store's cost when KV balancing counts it;
- the request's first token, and so its TTFT, is the end of its prefill. The router learns
  it at once: ``Ticket.first_token()`` and ``release()`` (the prefill request is done).
Events reach the conductor the instant they happen (no network delay), so the router
always sees the engines' current caches; queueing at the router is not modelled. By
default every instance has served the trace's first request before the replay starts
(``warm_start``): a fleet in service holds its system prompt.

Router replicas (``replicas`` N > 1): N routers behind a load balancer, request i sent to
replica i mod N. Each has its own ``InstancePool`` (its own claims, its own tie-breaking
turn) and sees the other replicas' loads (``InstancePool.set_others``, what the
conductor's ``/query`` answer carries) as they were ``load_lag_s`` trace seconds ago (inf:
no load sharing, a replica prices only its own claims). The router's cost model is the
fitted one in every replica: by default nothing is learned.
``in_flight_prefixes`` (off by default, as before replicas existed) models the router's
pending prefixes (``router.pending``): a prompt routed to an instance counts as a GPU hit
there until its prefill starts (here the index has its blocks from then on), for its own
replica at once and for the others ``routed_lag_s`` later (None: ``load_lag_s``; the
conductor's ``/routed``). ``learn_cost`` (off by default) gives each replica production's
``CostLearner``, started from the fitted model and fed, as the router feeds it, each of its
own requests' TTFT with the tokens it expected to compute and the queue it saw.

Run ``python -m bench.trace_report --help`` (the command line); bench/README.md "trace_sim"
has its method and caveats, bench/results/trace-replay.md its results.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.harness import percentile
from conductor.index import ContextKey, PrefixCacheTable, StreamSource
from conductor.routed import common_prefix
from conductor.wire.events import BlockRemoved, BlockStored, Event, EventBatch, Tier
from publishers.engine.block_manager import Allocation, BlockManager
from publishers.engine.timing import TimingModel
from router.policy import (
    POLICIES,
    Candidate,
    Decision,
    PrefillCostModel,
    RoutingParams,
    SloViolation,
    choose,
    reusable_hits,
)
from router.pool import CostLearner, InstancePool, Ticket

TRACE_BLOCK_SIZE = 512  # tokens per hash_id in the Mooncake traces
TRACES_DIR = Path(__file__).resolve().parent / "traces"
SIM_POLICIES = ("random", *POLICIES)  # random: the paper's baseline, not a router policy
TENANT, MODEL = "default", "trace-model"
STORE_INSTANCE = "mooncake-store"
DEFAULT_SLOS_S = (30.0, 5.0)  # the paper's TTFT threshold; a tighter, interactive one


# -- the trace ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def trace_path(name_or_path: str) -> Path:
    """``conversation`` / ``synthetic`` name the copies in bench/traces; else a path."""
    candidate = TRACES_DIR / f"{name_or_path}_trace.jsonl"
    return candidate if candidate.exists() else Path(name_or_path)


def load_trace(
    path: Path | str, limit: int | None = None, time_scale: float = 1.0
) -> list[TraceRequest]:
    """The first ``limit`` requests; arrivals in seconds, multiplied by ``time_scale``
    (``0.5`` replays the trace twice as fast, i.e. at twice its load)."""
    requests = []
    with open(path, encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if limit is not None and index >= limit:
                break
            row = json.loads(line)
            requests.append(
                TraceRequest(
                    index,
                    row["timestamp"] / 1000.0 * time_scale,
                    row["input_length"],
                    row["output_length"],
                    tuple(row["hash_ids"]),
                )
            )
    return requests


def block_tokens(hash_id: int) -> list[int]:
    """The 512 tokens a hash_id stands for: a pure function of the id.

    SHAKE-128 of the id, one byte per token: equal ids give equal blocks, distinct ids
    collide with negligible probability (512 random bytes). Byte-sized token ids are
    Python's shared small ints, which matters: every cached block keeps its tokens in the
    engines' BlockManager, and 16-bit tokens made one full run hold gigabytes.
    """
    return list(hashlib.shake_128(hash_id.to_bytes(8, "little")).digest(TRACE_BLOCK_SIZE))


def prompt_tokens(request: TraceRequest) -> list[int]:
    """The request's prompt: its ids' blocks in order, the last one cut to the remainder.

    Always 512 tokens per id, the trace's unit; the engines' block size may differ (a
    divisor of 512 keeps the trace's sharing exact)."""
    tokens: list[int] = []
    for hash_id in request.hash_ids:
        tokens += block_tokens(hash_id)
    del tokens[request.input_length :]
    return tokens


def distinct_blocks(requests: Iterable[TraceRequest]) -> int:
    return len({hash_id for request in requests for hash_id in request.hash_ids})


def unbounded_block_hit_ratio(requests: Iterable[TraceRequest]) -> float:
    """Blocks seen before / blocks requested: the trace's ideal reuse (the issue's figure).

    Partial last blocks count as blocks here, as the trace counts them.
    """
    seen: set[int] = set()
    hits = total = 0
    for request in requests:
        hits += sum(1 for hash_id in request.hash_ids if hash_id in seen)
        total += len(request.hash_ids)
        seen.update(request.hash_ids)
    return hits / total if total else 0.0


def unbounded_token_hits(
    requests: Sequence[TraceRequest], warm_start: bool = False
) -> tuple[int, int]:
    """(reused, input) tokens of one never-evicting cache under the engine's own rules:
    only complete blocks are cached, and at least the prompt's last token is recomputed
    (vLLM caps a hit at ``len - 1`` tokens). ``warm_start``: the cache already served the
    first request, as the simulated fleet has. Set arithmetic, so it runs in a second; the
    test checks it against a BlockManager that never evicts."""
    block_size = TRACE_BLOCK_SIZE  # one hash_id per 512-token block
    cached: set[int] = set()
    if warm_start and requests:
        first = requests[0]
        cached.update(first.hash_ids[: first.input_length // block_size])
    reused = total = 0
    for request in requests:
        hit_limit = (request.input_length - 1) // block_size
        hits = 0
        while hits < hit_limit and request.hash_ids[hits] in cached:
            hits += 1
        reused += hits * block_size
        total += request.input_length
        cached.update(request.hash_ids[: request.input_length // block_size])
    return reused, total


# -- the router's cost model -------------------------------------------------------------


def cost_model_from_timing(timing: TimingModel) -> PrefillCostModel:
    """The router's PrefillCostModel that matches ``timing`` exactly.

    TimingModel prefill = overhead + l·(a·((n+p)² − p²)·d + b·n·d²) / (G·mfu), and
    (n+p)² − p² = n·(n + 2p), which is PrefillCostModel's shape: per_token = l·b·d²/(G·mfu),
    attention = l·a·d/(G·mfu). Loading cached KV costs kv_bytes_per_token / B per token:
    from a CPU tier, and from the store (its bytes per token and bandwidth are B's).
    """
    flops_per_s = timing.gpu_flops * timing.mfu
    load_per_token = timing.kv_load_seconds(1)
    return PrefillCostModel(
        overhead_s=timing.prefill_overhead_s,
        per_token_s=timing.num_layers * timing.linear_coef * timing.hidden_size**2 / flops_per_s,
        attention_s=timing.num_layers * timing.attention_coef * timing.hidden_size / flops_per_s,
        cpu_load_per_token_s=load_per_token,
        disk_load_per_token_s=load_per_token,
        store_bytes_per_token=timing.kv_bytes_per_token,
        store_bandwidth_bytes_s=timing.kv_load_bandwidth,
    )


# -- configuration -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated fleet. ``gpu_blocks`` None: ~1/N of the trace's distinct blocks each."""

    num_instances: int = 8
    block_size: int = TRACE_BLOCK_SIZE
    gpu_blocks: int | None = None
    cpu_blocks: int = 0  # per instance: BlockManager's CPU offload tier
    store_blocks: int = 0  # one shared Mooncake-store tier for all instances (0: none)
    timing: TimingModel = TimingModel()
    routing: RoutingParams = RoutingParams()  # policy, block_size and cost are set per run
    global_balance_threshold: float = 1.5  # the ttft-global variant's balance_threshold
    seed: int = 0
    queue_seconds: bool = False  # what-if: the router queues estimated seconds, not tokens
    warm_start: bool = True  # every cache has served the trace's first request at t < 0
    verify: bool = False  # check the index against the block manager at every allocation
    # router replicas: request i goes to replica i mod N, each with its own load accounting
    replicas: int = 1
    load_lag_s: float = 0.0  # trace s until a replica sees another's load (inf: never)
    in_flight_prefixes: bool = False  # routed prompts count as hits until their prefill starts
    routed_lag_s: float | None = None  # ... for the other replicas after this (None: load_lag_s)
    learn_cost: bool = False  # each replica learns per_token_s from its TTFTs (CostLearner)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.load_lag_s < 0 or (self.routed_lag_s is not None and self.routed_lag_s < 0):
            raise ValueError("lags must not be negative")

    @property
    def routed_lag(self) -> float:
        return self.load_lag_s if self.routed_lag_s is None else self.routed_lag_s

    def store_blocks_for(self, requests: Sequence[TraceRequest]) -> int:
        """The store's capacity (0: no store); never smaller than an instance's pool, so a
        prompt it saves stays whole."""
        return max(self.store_blocks, self.gpu_blocks_for(requests)) if self.store_blocks else 0

    def gpu_blocks_for(self, requests: Sequence[TraceRequest]) -> int:
        """The per-instance GPU pool; never smaller than the longest prompt needs.

        Default: the trace's distinct tokens (512 per hash_id) over N, so the pooled
        reference (N pools in one) holds every block the trace ever uses."""
        longest = max((-(-r.input_length // self.block_size) for r in requests), default=1)
        distinct_tokens = distinct_blocks(requests) * TRACE_BLOCK_SIZE
        share = math.ceil(distinct_tokens / self.block_size / self.num_instances)
        return max(self.gpu_blocks or share, longest + 1)


# -- the engine side ---------------------------------------------------------------------


@dataclass(slots=True)
class Job:
    """A routed request waiting for, or in, its prefill."""

    request: TraceRequest
    tokens: list[int]
    ticket: Ticket
    cached_tokens: int = 0
    pending: PendingPrompt | None = None  # in_flight_prefixes: its prompt, until it starts
    replica: int = 0  # the router replica that routed it
    expected: tuple[int, int] = (0, 0)  # learn_cost: (new tokens, queued before), as claimed


@dataclass(slots=True)
class PendingPrompt:
    """A routed prompt not in the index yet (its prefill has not started): who routed it,
    when, where, and its chained block keys (complete blocks only)."""

    replica: int
    routed_at: float
    instance_id: str
    keys: list[int]


class RouterReplica:
    """One router process: its pool (its own claims), its tie-breaking turn and, when
    replicas share their loads, the history of its own load the others read with a lag."""

    def __init__(self, pool: InstancePool, learner: CostLearner | None = None) -> None:
        self.pool = pool
        self.learner = learner
        self.turn = 0
        self.times: list[float] = []  # when its own load changed ...
        self.loads: list[dict[str, tuple[int, int]]] = []  # ... and to what

    def record(self, now: float) -> None:
        self.times.append(now)
        self.loads.append(self.pool.own_loads())

    def load_at(self, at: float) -> dict[str, tuple[int, int]]:
        """Its own loads as they were at ``at`` (its last change at or before)."""
        index = bisect.bisect_right(self.times, at) - 1
        if index > 0:  # nothing older is read again: time only moves forward
            del self.times[:index], self.loads[:index]
            index = 0
        return self.loads[index] if index >= 0 else {}


@dataclass(slots=True)
class PrefillInstance:
    """One engine: its KV cache, its FIFO of prefills and what it did."""

    name: str
    blocks: BlockManager
    source: StreamSource
    waiting: deque[Job] = field(default_factory=deque)
    busy: bool = False
    computed_tokens: int = 0
    busy_s: float = 0.0


class SharedStore:
    """A Mooncake-store tier shared by all instances: an LRU of engine block hashes.

    Instances save every complete block of a finished prefill and load, after their own
    GPU/CPU hit, the consecutive blocks the store holds. Its events (medium CPU) go to the
    conductor as a shared pool, so every instance's CPU answer includes them. Its evictions
    are announced at once (the real store announces none: the conductor's existence checks
    remove them within its check interval, a staleness not modelled here).
    """

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def continuation(self, block_hashes: Sequence[int], start: int, stop: int) -> int:
        """How many of ``block_hashes[start:stop]`` it holds in a row (and touches them)."""
        count = 0
        for block_hash in block_hashes[start:stop]:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            count += 1
        return count

    def put(self, block_hashes: Sequence[int], tokens: Sequence[int]) -> list[Event]:
        """Save a prompt's complete blocks; one BlockStored per run of new blocks."""
        events: list[Event] = []
        size = self.block_size
        run_start = None
        for index, block_hash in enumerate([*block_hashes, None]):
            if block_hash is not None and block_hash not in self._blocks:
                if len(self._blocks) >= self.capacity:
                    victim, _ = self._blocks.popitem(last=False)
                    events.append(BlockRemoved([victim], Tier.CPU))
                self._blocks[block_hash] = None
                run_start = index if run_start is None else run_start
                continue
            if run_start is not None:
                events.append(
                    BlockStored(
                        block_hashes=list(block_hashes[run_start:index]),
                        parent_hash=block_hashes[run_start - 1] if run_start else None,
                        token_ids=list(tokens[run_start * size : index * size]),
                        block_size=size,
                        tier=Tier.CPU,
                    )
                )
                run_start = None
            if block_hash is not None:
                self._blocks.move_to_end(block_hash)
        return events


# -- results -----------------------------------------------------------------------------


@dataclass(slots=True)
class RunResult:
    """What one policy (or reference) did with the trace."""

    policy: str
    input_tokens: int = 0
    reused_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    rejected: int = 0
    instance_tokens: list[int] = field(default_factory=list)  # computed prefill tokens
    instance_busy_s: list[float] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # verify mode: index != engine
    wall_s: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.reused_tokens / self.input_tokens if self.input_tokens else 0.0


# -- the simulation ----------------------------------------------------------------------

_FINISH, _ARRIVAL = 0, 1  # at equal times a finishing prefill frees its load first


class TraceSimulation:
    """One policy over one trace on a fresh fleet, conductor table and router pool."""

    def __init__(self, requests: Sequence[TraceRequest], config: SimConfig, policy: str):
        if policy not in SIM_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {SIM_POLICIES}")
        self.requests = requests
        self.config = config
        self.policy = policy
        size = config.block_size
        self.params = replace(
            config.routing,
            policy=policy,
            block_size=size,
            cost=cost_model_from_timing(config.timing),
        )
        self.rng = random.Random(config.seed)
        self.result = RunResult(policy)
        self.now = 0.0
        self._heap: list[tuple[float, int, int, object]] = []
        self._sequence = 0
        self.table = PrefixCacheTable()
        self.context = ContextKey(TENANT, MODEL, "", size)
        self.store: SharedStore | None = None
        if config.store_blocks:
            self.store = SharedStore(config.store_blocks_for(requests), size)
            self.store_source = StreamSource(
                f"{STORE_INSTANCE}|{TENANT}|0", STORE_INSTANCE, TENANT, MODEL, "", size,
                shared_pool=True,
            )  # fmt: skip
            self.table.add_stream(self.store_source)
        self.instances = self._fleet(config.gpu_blocks_for(requests))
        self.replicas = [self._replica() for _ in range(config.replicas)]
        self.pool = self.replicas[0].pool  # the only one by default
        self.pending: dict[int, PendingPrompt] = {}  # in_flight_prefixes: by request index

    def _replica(self) -> RouterReplica:
        pool = InstancePool.build(
            ((name, f"sim://{name}") for name in self.instances),
            kv_stores=dict.fromkeys(self.instances, STORE_INSTANCE) if self.store else None,
        )
        replica = RouterReplica(
            pool, CostLearner(self.params.cost) if self.config.learn_cost else None
        )
        if self.config.replicas > 1 and math.isfinite(self.config.load_lag_s):
            pool.load_listener = lambda: replica.record(self.now)
        return replica

    def _fleet(self, gpu_blocks: int) -> dict[str, PrefillInstance]:
        """The instances, registered with the conductor (and warmed up, if configured)."""
        config, size = self.config, self.config.block_size
        instances = {}
        for index in range(config.num_instances):
            name = f"prefill-{index}"
            instance = PrefillInstance(
                name,
                BlockManager(gpu_blocks, size, num_cpu_blocks=config.cpu_blocks),
                StreamSource(f"{name}|{TENANT}|0", name, TENANT, MODEL, "", size),
            )
            self.table.add_stream(instance.source)
            if config.warm_start and self.requests:
                hashes = warm_up(instance.blocks, self.requests[0])
                self._publish(instance.source.key, [w.event for w in instance.blocks.take_events()])
                if self.store is not None:
                    events = self.store.put(hashes, prompt_tokens(self.requests[0]))
                    self._publish(self.store_source.key, events)
            instances[name] = instance
        return instances

    # -- driver ------------------------------------------------------------------------

    def run(self) -> RunResult:
        started = time.perf_counter()
        for request in self.requests:
            self._push(request.arrival_s, _ARRIVAL, request)
        while self._heap:
            self.now, kind, _, payload = heapq.heappop(self._heap)
            if kind == _ARRIVAL:
                self._arrive(payload)
            else:
                self._finish(*payload)
        result = self.result
        result.instance_tokens = [i.computed_tokens for i in self.instances.values()]
        result.instance_busy_s = [i.busy_s for i in self.instances.values()]
        result.wall_s = time.perf_counter() - started
        return result

    def _push(self, at: float, kind: int, payload: object) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, (at, kind, self._sequence, payload))

    # -- router ------------------------------------------------------------------------

    def hits(self, tokens: Sequence[int]) -> dict[str, tuple[int, int, int]]:
        """The conductor's /query answer for a prompt: (GPU, CPU, DISK) tokens per instance."""
        matches = self.table.match_tokens(self.context, tokens) or {}
        return {name: (m.gpu, m.cpu, m.disk) for name, m in matches.items()}

    def route(
        self, candidates: Sequence[Candidate], prompt_length: int, replica: RouterReplica
    ) -> Decision:
        replica.turn += 1
        if self.policy == "random":
            chosen = self.rng.choice(candidates)
            return Decision(chosen.instance_id, "random", chosen.gpu_tokens)
        params = self.params
        if replica.learner is not None:
            params = replace(params, cost=replica.learner.model)
        return choose(params, candidates, replica.turn, prompt_length, self.rng)

    def _arrive(self, request: TraceRequest) -> None:
        tokens = prompt_tokens(request)
        number = request.index % len(self.replicas)
        replica = self.replicas[number]
        self._share_loads(number)
        hits = self.hits(tokens)
        keys = self._block_keys(tokens) if self.config.in_flight_prefixes else []
        if keys:
            self._add_in_flight(hits, keys, len(tokens), number)
        candidates = replica.pool.candidates(hits)
        try:
            decision = self.route(candidates, len(tokens), replica)
        except SloViolation:
            self.result.rejected += 1
            return
        upstream = replica.pool.prefill[decision.instance_id]
        work = self._queued_work(decision, len(tokens))
        ticket = replica.pool.claim(upstream, work)
        instance = self.instances[decision.instance_id]
        job = Job(request, tokens, ticket, replica=number)
        if replica.learner is not None:  # router.in_flight's Claim
            new_tokens = max(len(tokens) - decision.cached_tokens, 0)
            job.expected = (new_tokens, upstream.queue_tokens - new_tokens)
        if keys:
            job.pending = PendingPrompt(number, self.now, decision.instance_id, keys)
            self.pending[request.index] = job.pending
        instance.waiting.append(job)
        if not instance.busy:
            self._start(instance)

    def _share_loads(self, number: int) -> None:
        """The other replicas' loads as the conductor would pass them to replica
        ``number`` now: each as it was ``load_lag_s`` ago (none without sharing)."""
        if len(self.replicas) == 1 or not math.isfinite(self.config.load_lag_s):
            return
        seen_at = self.now - self.config.load_lag_s
        others: dict[str, tuple[int, int]] = {}
        for index, other in enumerate(self.replicas):
            if index == number:
                continue
            for name, (queued, in_flight) in other.load_at(seen_at).items():
                total = others.get(name, (0, 0))
                others[name] = (total[0] + queued, total[1] + in_flight)
        self.replicas[number].pool.set_others(others)

    def _block_keys(self, tokens: Sequence[int]) -> list[int]:
        """Chained keys of the prompt's complete blocks (equal keys, equal prefixes): the
        stand-in for the conductor's ``prefix_hashes`` that pending prompts compare."""
        size = self.config.block_size
        keys, key = [], 0
        for start in range(0, len(tokens) // size * size, size):
            key = hash((key, bytes(tokens[start : start + size])))
            keys.append(key)
        return keys

    def _add_in_flight(
        self, hits: dict[str, tuple[int, int, int]], keys: list[int], length: int, number: int
    ) -> None:
        """Raise each instance's GPU hit to the longest prefix of a prompt routed there and
        not started yet that replica ``number`` knows of (``router.lookup``'s rule)."""
        visible_until = self.now - self.config.routed_lag
        matches: dict[str, int] = {}
        for prompt in self.pending.values():
            if prompt.replica != number and prompt.routed_at > visible_until:
                continue
            shared = common_prefix(prompt.keys, keys)
            if shared > matches.get(prompt.instance_id, 0):
                matches[prompt.instance_id] = shared
        size = self.config.block_size
        pending_hits = {name: (blocks * size,) * 3 for name, blocks in matches.items()}
        for name, (pending, _, _) in reusable_hits(pending_hits, length, size).items():
            gpu, cpu, disk = hits.get(name, (0, 0, 0))
            if pending > gpu:
                hits[name] = (pending, max(cpu, pending), max(disk, pending))

    def _queued_work(self, decision: Decision, prompt_length: int) -> int:
        """What the router adds to the instance's ``queued_prefill_tokens``: the tokens it
        expects to be computed, as the proxy does. With ``queue_seconds`` (a what-if, see
        bench/results/trace-replay.md) it adds the estimated prefill time in per-token units
        instead, so the ttft policy's ``per_token_s × queued`` sums queued prefill *times*,
        as Algorithm 1 does."""
        cached = min(decision.cached_tokens, prompt_length)
        if not self.config.queue_seconds:
            return prompt_length - cached
        cost = self.params.cost
        return round(cost.prefill_s(prompt_length - cached, cached) / cost.per_token_s)

    # -- engine ------------------------------------------------------------------------

    def _start(self, instance: PrefillInstance) -> None:
        job = instance.waiting.popleft()
        if job.pending is not None:  # its blocks are indexed from now on
            del self.pending[job.request.index]
            job.pending = None
        request_id = str(job.request.index)
        expected = self._indexed_hit(instance, job) if self.config.verify else None
        allocation = instance.blocks.allocate(request_id, job.tokens)
        if allocation is None:  # cannot happen: one prefill at a time and a large enough pool
            raise RuntimeError(f"{instance.name} has no room for request {request_id}")
        self._publish(instance.source.key, [wire.event for wire in instance.blocks.take_events()])
        if expected is not None:
            self._check(instance, job, allocation, expected)
        from_store = self._store_hit(job, allocation)
        cached = allocation.num_cached_tokens + from_store
        job.cached_tokens = cached
        new_tokens = len(job.tokens) - cached
        timing = self.config.timing
        duration = (
            timing.kv_load_seconds(allocation.num_cpu_loaded_tokens)
            + self.params.cost.store_load_s(from_store)
            + timing.prefill_seconds(new_tokens, cached)
        )
        instance.busy = True
        instance.computed_tokens += new_tokens
        instance.busy_s += duration
        self._push(self.now + duration, _FINISH, (instance, job, allocation))

    def _store_hit(self, job: Job, allocation: Allocation) -> int:
        """Tokens loaded from the shared store right after the instance's own hit."""
        if self.store is None:
            return 0
        size = self.config.block_size
        start = allocation.num_cached_tokens // size
        stop = (len(job.tokens) - 1) // size  # the engine recomputes at least one token
        return self.store.continuation(allocation.block_hashes, start, stop) * size

    def _hit_limit(self, job: Job) -> int:
        """The most an engine reuses of a prompt: complete blocks, the last token excluded."""
        size = self.config.block_size
        return (len(job.tokens) - 1) // size * size

    def _finish(self, instance: PrefillInstance, job: Job, allocation: Allocation) -> None:
        request = job.request
        ttft = self.now - request.arrival_s
        result = self.result
        result.ttfts.append(ttft)
        result.input_tokens += request.input_length
        result.reused_tokens += job.cached_tokens
        if self.store is not None:  # saved while the blocks are still held: parents known
            self._publish(
                self.store_source.key, self.store.put(allocation.block_hashes, job.tokens)
            )
        instance.blocks.free(str(request.index))
        job.ticket.release()  # first token out: the prefill request is done
        learner = self.replicas[job.replica].learner
        if learner is not None:
            learner.observe(*job.expected, ttft)
        instance.busy = False
        if instance.waiting:
            self._start(instance)

    def _publish(self, stream_key: str, events: list[Event]) -> None:
        if events:
            self.table.apply(stream_key, EventBatch(self.now, events))

    # -- verification --------------------------------------------------------------------

    def _indexed_hit(self, instance: PrefillInstance, job: Job) -> tuple[int, int]:
        """What the conductor says this instance holds of the prompt, capped as the engine
        caps a hit (the last token is always recomputed): (GPU, GPU + own CPU) tokens."""
        match = self.table.match_tokens(self.context, job.tokens, instance_id=instance.name)
        found = (match or {}).get(instance.name)
        if found is None:
            return 0, 0
        return min(found.gpu, self._hit_limit(job)), min(found.cpu, self._hit_limit(job))

    def _check(
        self,
        instance: PrefillInstance,
        job: Job,
        allocation: Allocation,
        expected: tuple[int, int],
    ) -> None:
        gpu_hit = allocation.num_cached_tokens - allocation.num_cpu_loaded_tokens
        actual = (gpu_hit, allocation.num_cached_tokens)
        compared = 2 if self.store is None else 1  # the store adds shared CPU hits
        if actual[:compared] != expected[:compared]:
            self.result.mismatches.append(
                f"t={self.now:.3f} {instance.name} request {job.request.index}: "
                f"engine hit {actual}, conductor {expected}"
            )


def warm_up(blocks: BlockManager, request: TraceRequest) -> list[int]:
    """Serve ``request`` before the replay starts (not measured); its block hashes.

    A fleet in service already holds its application's system prompt (so does its store).
    Starting cold, the first instance to cache a block every prompt shares (the
    conversation trace's block 0) is, for max_prefix, the longest match of every later
    request: it would get them all.
    """
    allocation = blocks.allocate("warm-up", prompt_tokens(request))
    assert allocation is not None  # an empty pool holds the longest prompt
    blocks.free("warm-up")
    return allocation.block_hashes


# -- references --------------------------------------------------------------------------


def pooled_reference(requests: Sequence[TraceRequest], config: SimConfig) -> RunResult:
    """One LRU cache with the fleet's total capacity (the GPU blocks of all instances plus
    the store's), load ignored: every request runs alone, in arrival order, on the same
    BlockManager. No placement of the same blocks over N separate caches can reuse more
    (short of LRU anomalies): the hit-ratio ceiling."""
    started = time.perf_counter()
    blocks = BlockManager(
        config.gpu_blocks_for(requests) * config.num_instances + config.store_blocks_for(requests),
        config.block_size,
        num_cpu_blocks=config.cpu_blocks * config.num_instances,
    )
    result = RunResult("pooled")
    if config.warm_start and requests:
        warm_up(blocks, requests[0])
    for request in requests:
        allocation = blocks.allocate(str(request.index), prompt_tokens(request))
        assert allocation is not None  # nothing else holds blocks
        blocks.free(str(request.index))
        blocks.take_events()
        result.input_tokens += request.input_length
        result.reused_tokens += allocation.num_cached_tokens
    result.wall_s = time.perf_counter() - started
    return result


GLOBAL_VARIANT = "ttft-global"
LOCAL_VARIANT = "ttft-local"
# the ttft policy with another balance_threshold than the router's default; they differ
# from ttft only with a store (KV balancing pulls through it, and there is no other path)
TTFT_VARIANTS = (LOCAL_VARIANT, GLOBAL_VARIANT)
RUNS = ("random", "round_robin", "least_loaded", "max_prefix", "kv_cost", "ttft", *TTFT_VARIANTS)


def simulate(requests: Sequence[TraceRequest], config: SimConfig, name: str) -> RunResult:
    """One run: a policy of SIM_POLICIES (with the router's defaults: KV balancing at
    STORE_BALANCE_THRESHOLD when there is a store), ``pooled`` (the pooled-cache
    reference), ``ttft-local`` (ttft without balancing: store hits are not counted, though
    the engines still load them) or ``ttft-global`` (balancing at
    ``config.global_balance_threshold``)."""
    if name == "pooled":
        return pooled_reference(requests, config)
    if name in TTFT_VARIANTS:
        threshold = math.inf if name == LOCAL_VARIANT else config.global_balance_threshold
        routing = replace(config.routing, balance_threshold=threshold)
        result = TraceSimulation(requests, replace(config, routing=routing), "ttft").run()
        result.policy = name
        return result
    return TraceSimulation(requests, config, name).run()


# -- summaries ---------------------------------------------------------------------------


def json_safe(value: Any) -> Any:
    """Standard JSON: non-finite floats (an infinite threshold, a NaN ratio) as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def imbalance(values: Sequence[float]) -> float:
    """max / mean over instances: 1.0 is perfectly even."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else math.nan


def summarize(result: RunResult, slos_s: Sequence[float] = DEFAULT_SLOS_S) -> dict[str, object]:
    """The JSON-ready figures of one run; the TTFT CDF as 101 quantiles.

    SLO attainment counts rejected requests as misses.
    """
    ttfts = sorted(result.ttfts)
    served = len(ttfts)
    summary: dict[str, object] = {
        "policy": result.policy,
        "hit_ratio": result.hit_ratio,
        "input_tokens": result.input_tokens,
        "reused_tokens": result.reused_tokens,
        "wall_s": result.wall_s,
    }
    if not served and not result.rejected:  # a reference: no timing
        return summary
    offered = served + result.rejected
    return summary | {
        "served": served,
        "rejected": result.rejected,
        "ttft_mean_s": sum(ttfts) / served if served else math.nan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_max_s": ttfts[-1] if ttfts else math.nan,
        "slo_attainment": {
            f"{slo:g}": sum(1 for ttft in ttfts if ttft <= slo) / offered for slo in slos_s
        },
        "imbalance_tokens": imbalance(result.instance_tokens),
        "imbalance_busy": imbalance(result.instance_busy_s),
        "instance_tokens": result.instance_tokens,
        "instance_busy_s": result.instance_busy_s,
        "ttft_quantiles_s": [percentile(ttfts, q) for q in range(101)],
        "mismatches": result.mismatches[:20],
    }
