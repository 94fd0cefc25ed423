"""Routing policies: pure functions of (cache hits, load, request) -> the chosen instance.

They hold no state and do no I/O, so the proxy, the unit tests and the trace simulator all
call the very same code. Cache hits are the conductor's cumulative answer per instance
(GPU <= CPU <= DISK tokens); load is what the router itself tracks per instance.

``REGISTRY`` names every policy once: the config's validation, the ``--policy`` choices and
``choose`` all read it, so a policy is added in one place.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeVar

# what ``_argmin`` ranks by: one number, or numbers compared in order
Rank = TypeVar("Rank", float, tuple[float, ...])
# count a prefix pulled through the store when it is this many times the instance's own:
# 1, whenever the store holds more. On the FAST'25 traces with a store, 1 gave the lowest
# mean and p90 TTFT of 1, 1.5, 2, 4 and inf (bench/results/trace-replay.md)
STORE_BALANCE_THRESHOLD = 1.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy prefill instance as the router sees it for one request."""

    instance_id: str
    gpu_tokens: int = 0  # prompt prefix already on its GPU
    cpu_tokens: int = 0  # ... on its GPU or a CPU tier it can load from (>= gpu_tokens)
    disk_tokens: int = 0  # ... adding DISK tiers (>= cpu_tokens)
    in_flight: int = 0  # requests sent and not finished
    queued_prefill_tokens: int = 0  # uncached prompt tokens sent and not yet prefilled
    # its CPU tier is a Mooncake store it shares with others and can load from now: that
    # part of its hit is KV other instances saved, pulled at the store's cost (KV balancing)
    store: bool = False


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    """What the router believes an instance's prefill costs; learned or configured.

    ``prefill(n, p)`` = overhead + per_token × n + attention × n × (n + 2p), the shape of
    the engine's FLOPs (linear layers per new token, attention over the whole context).
    """

    overhead_s: float = 0.02
    per_token_s: float = 1.1e-4
    attention_s: float = 1.0e-9  # per new token × context token
    cpu_load_per_token_s: float = 3.3e-6  # an own CPU tier: 320 KiB/token at 100 GB/s
    disk_load_per_token_s: float = 1.6e-5  # ~20 GB/s
    # a shared Mooncake store: KV bytes per token (LLaMA3-70B in BF16: 80 layers × K and V
    # × 8 heads × 128 × 2 B) and the bandwidth a load from it reaches (NIC-bound, 100 GB/s)
    store_bytes_per_token: float = 327_680.0
    store_bandwidth_bytes_s: float = 100e9

    @property
    def store_load_per_token_s(self) -> float:
        return self.store_bytes_per_token / self.store_bandwidth_bytes_s

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        attention = self.attention_s * new_tokens * (new_tokens + 2 * cached_tokens)
        return self.overhead_s + self.per_token_s * new_tokens + attention

    def store_load_s(self, tokens: int) -> float:
        """Bringing ``tokens`` of KV from the store: tokens × bytes per token ÷ bandwidth."""
        return tokens * self.store_bytes_per_token / self.store_bandwidth_bytes_s

    def load_s(self, cpu_tokens: int, disk_tokens: int, store: bool = False) -> float:
        """Loading the CPU part of a hit (from the store when ``store``) and the DISK part."""
        cpu_s = self.store_load_s(cpu_tokens) if store else self.cpu_load_per_token_s * cpu_tokens
        return cpu_s + self.disk_load_per_token_s * disk_tokens


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen instance and what the choice was based on (for headers and metrics)."""

    instance_id: str
    policy: str
    cached_tokens: int  # the hit the decision used (tokens not recomputed)
    estimated_ttft_s: float | None = None
    scores: dict[str, float] = field(default_factory=dict)


class SloViolation(Exception):
    """Even the best instance's estimated TTFT breaks the SLO: reject (HTTP 429)."""

    def __init__(self, best: Decision, slo_s: float) -> None:
        assert best.estimated_ttft_s is not None, "only an estimate can break the SLO"
        super().__init__(
            f"estimated time to first token {best.estimated_ttft_s * 1000:.0f} ms on the best "
            f"instance ({best.instance_id}) exceeds the {slo_s * 1000:.0f} ms SLO"
        )
        self.best = best
        self.slo_s = slo_s


def _argmin(
    candidates: Sequence[Candidate], key: Callable[[Candidate], Rank], turn: int
) -> Candidate:
    """The lowest-``key`` candidate; ties rotate with ``turn`` so equals share the load."""
    best = min(key(c) for c in candidates)
    leaders = [c for c in candidates if key(c) == best]
    return leaders[turn % len(leaders)]


def round_robin(candidates: Sequence[Candidate], turn: int) -> Decision:
    chosen = candidates[turn % len(candidates)]
    return Decision(chosen.instance_id, "round_robin", chosen.gpu_tokens)


def least_loaded(candidates: Sequence[Candidate], turn: int) -> Decision:
    chosen = _argmin(candidates, lambda c: (c.queued_prefill_tokens, c.in_flight), turn)
    return Decision(chosen.instance_id, "least_loaded", chosen.gpu_tokens)


def max_prefix(candidates: Sequence[Candidate], turn: int) -> Decision:
    """The upstream Mooncake proxy: the longest match wins (ties rotate), load ignored."""
    chosen = _argmin(candidates, lambda c: -c.disk_tokens, turn)
    return Decision(chosen.instance_id, "max_prefix", chosen.disk_tokens)


def kv_cost(
    candidates: Sequence[Candidate],
    turn: int,
    block_size: int,
    overlap_weight: float = 1.0,
    temperature: float = 0.0,
    rng: random.Random | None = None,
) -> Decision:
    """Dynamo-style: score = overlap_weight × cached blocks − load in blocks (queued prefill
    blocks + in-flight requests); softmax over scores at ``temperature`` (0 = argmax)."""
    scores = {
        c.instance_id: overlap_weight * (c.gpu_tokens / block_size)
        - (c.queued_prefill_tokens / block_size + c.in_flight)
        for c in candidates
    }
    if temperature > 0:
        top = max(scores.values())
        weights = [math.exp((scores[c.instance_id] - top) / temperature) for c in candidates]
        chosen = (rng or random.Random()).choices(list(candidates), weights)[0]
    else:
        chosen = _argmin(candidates, lambda c: -scores[c.instance_id], turn)
    return Decision(chosen.instance_id, "kv_cost", chosen.gpu_tokens, scores=scores)


def reusable_hits(
    hits: Mapping[str, tuple[int, int, int]], prompt_tokens: int, block_size: int
) -> dict[str, tuple[int, int, int]]:
    """Hits as the engine will use them: vLLM always computes the prompt's last token, so
    a hit that covers the whole prompt reuses one block less than the index holds."""
    most = max(prompt_tokens - 1, 0) // block_size * block_size
    return {
        name: (min(gpu, most), min(cpu, most), min(disk, most))
        for name, (gpu, cpu, disk) in hits.items()
    }


def ttft_estimate(
    candidate: Candidate,
    prompt_tokens: int,
    model: PrefillCostModel,
    balance_threshold: float | None = None,
) -> tuple[float, int]:
    """Mooncake's Algorithm 1 for one instance: (estimated TTFT, tokens not recomputed).

    Queue time is the prefill work already sent there. The instance reuses its GPU hit,
    loads the CPU/DISK part of its cumulative hit, and computes the rest. For an instance
    that shares a store, the CPU part is the store's: KV other instances computed and saved,
    pulled at the store's cost. That is Mooncake's KV-cache balancing, and as in Algorithm 1
    the pull is counted when the prefix it reaches is at least ``balance_threshold`` times
    the instance's own (None: ``STORE_BALANCE_THRESHOLD``; inf: never, as a router that
    ignores the store).
    """
    queue_s = model.per_token_s * candidate.queued_prefill_tokens
    reusable = min(candidate.disk_tokens, prompt_tokens)
    if candidate.store:
        own = min(candidate.gpu_tokens, prompt_tokens)
        threshold = STORE_BALANCE_THRESHOLD if balance_threshold is None else balance_threshold
        if not reusable > own * threshold:
            return queue_s + model.prefill_s(prompt_tokens - own, own), own
    load_s = model.load_s(
        candidate.cpu_tokens - candidate.gpu_tokens,
        candidate.disk_tokens - candidate.cpu_tokens,
        candidate.store,
    )
    return queue_s + load_s + model.prefill_s(prompt_tokens - reusable, reusable), reusable


def ttft(
    candidates: Sequence[Candidate],
    turn: int,
    prompt_tokens: int,
    model: PrefillCostModel,
    balance_threshold: float | None = None,
    slo_s: float | None = None,
    slack: float = 0.0,
) -> Decision:
    """The instance with the lowest estimated TTFT (or, within ``slack`` × of it, the one
    reusing most); raises SloViolation past the SLO."""
    estimates = {
        c.instance_id: ttft_estimate(c, prompt_tokens, model, balance_threshold) for c in candidates
    }
    fastest = min(seconds for seconds, _ in estimates.values())
    # within ``slack`` of the fastest estimate, the longest hit wins: placing a request
    # where its prefix already is keeps that prefix hot for the conversation's next turns
    near = [c for c in candidates if estimates[c.instance_id][0] <= fastest * (1 + slack)]
    chosen = _argmin(
        near, lambda c: (-estimates[c.instance_id][1], estimates[c.instance_id][0]), turn
    )
    estimate, cached = estimates[chosen.instance_id]
    decision = Decision(
        chosen.instance_id,
        "ttft",
        cached,
        estimate,
        {name: seconds for name, (seconds, _) in estimates.items()},
    )
    if slo_s is not None and estimate > slo_s:
        raise SloViolation(decision, slo_s)
    return decision


@dataclass(frozen=True, slots=True)
class RoutingParams:
    """A policy and its parameters (the router config's ``routing`` section)."""

    policy: str = "ttft"
    block_size: int = 16
    overlap_weight: float = 1.0
    temperature: float = 0.0
    # KV balancing: pulling through a shared store (the only transfer path) what other
    # instances saved there; None is STORE_BALANCE_THRESHOLD, inf turns it off
    balance_threshold: float | None = None
    ttft_slo_s: float | None = None
    # within (1 + slack) × the fastest TTFT estimate, the longest hit wins (0: Mooncake's
    # Algorithm 1 exactly); 0.5 measured best on the FAST'25 traces (bench/results/trace-replay.md)
    ttft_slack: float = 0.5
    cost: PrefillCostModel = PrefillCostModel()


class PolicyRun(Protocol):
    """How a registered policy runs: the parameters it reads come from ``params``."""

    def __call__(
        self,
        params: RoutingParams,
        candidates: Sequence[Candidate],
        turn: int,
        prompt_tokens: int,
        rng: random.Random | None,
    ) -> Decision: ...


@dataclass(frozen=True, slots=True)
class Policy:
    """A routing policy as the config, the CLI and ``choose`` know it."""

    name: str
    summary: str  # one line for ``--help``
    parameters: tuple[str, ...]  # the keys of the config's ``routing`` section it reads
    run: PolicyRun

    def describe(self) -> str:
        """``name: summary [parameters]``, as ``--help`` lists it."""
        reads = f" [{', '.join(self.parameters)}]" if self.parameters else ""
        return f"{self.name}: {self.summary}{reads}"


def _of_candidates_alone(decide: Callable[[Sequence[Candidate], int], Decision]) -> PolicyRun:
    """A policy that reads no parameter and no prompt length."""

    def run(
        params: RoutingParams,
        candidates: Sequence[Candidate],
        turn: int,
        prompt_tokens: int,
        rng: random.Random | None,
    ) -> Decision:
        return decide(candidates, turn)

    return run


def _run_kv_cost(
    params: RoutingParams,
    candidates: Sequence[Candidate],
    turn: int,
    prompt_tokens: int,
    rng: random.Random | None,
) -> Decision:
    return kv_cost(
        candidates, turn, params.block_size, params.overlap_weight, params.temperature, rng
    )


def _run_ttft(
    params: RoutingParams,
    candidates: Sequence[Candidate],
    turn: int,
    prompt_tokens: int,
    rng: random.Random | None,
) -> Decision:
    return ttft(
        candidates,
        turn,
        prompt_tokens,
        params.cost,
        params.balance_threshold,
        params.ttft_slo_s,
        params.ttft_slack,
    )


# every policy the router has, in the order the CLI and the benchmarks list them
REGISTRY: Mapping[str, Policy] = MappingProxyType(
    {
        policy.name: policy
        for policy in (
            Policy("round_robin", "each instance in turn", (), _of_candidates_alone(round_robin)),
            Policy(
                "least_loaded",
                "the least queued prefill, then the fewest requests",
                (),
                _of_candidates_alone(least_loaded),
            ),
            Policy(
                "max_prefix",
                "the longest cached prefix, load ignored",
                (),
                _of_candidates_alone(max_prefix),
            ),
            Policy(
                "kv_cost",
                "cached blocks against load in blocks, as Dynamo",
                ("overlap_weight", "temperature"),
                _run_kv_cost,
            ),
            Policy(
                "ttft",
                "the lowest estimated time to first token, Mooncake's Algorithm 1",
                ("cost", "learn_cost_model", "balance_threshold", "ttft_slo_ms", "ttft_slack"),
                _run_ttft,
            ),
        )
    }
)
POLICIES: tuple[str, ...] = tuple(REGISTRY)  # the names alone


def policy_named(name: str) -> Policy:
    """The registered policy ``name``; ValueError naming every choice otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


def choose(
    params: RoutingParams,
    candidates: Sequence[Candidate],
    turn: int,
    prompt_tokens: int,
    rng: random.Random | None = None,
) -> Decision:
    """Run ``params.policy`` over non-empty ``candidates``; ``turn`` rotates ties."""
    if not candidates:
        raise ValueError("no candidate instances")
    return policy_named(params.policy).run(params, candidates, turn, prompt_tokens, rng)
