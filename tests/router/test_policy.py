"""Routing policies on hand-made hit/load tables: ties, zero hits, SLO, balancing."""

from __future__ import annotations

import math
import random

import pytest

from router.policy import (
    POLICIES,
    STORE_BALANCE_THRESHOLD,
    Candidate,
    PrefillCostModel,
    RoutingParams,
    SloViolation,
    choose,
    kv_cost,
    least_loaded,
    max_prefix,
    reusable_hits,
    round_robin,
    ttft,
    ttft_estimate,
)

MODEL = PrefillCostModel(
    overhead_s=0.01,
    per_token_s=1e-4,
    attention_s=0.0,
    cpu_load_per_token_s=1e-5,
    disk_load_per_token_s=5e-5,
    store_bytes_per_token=200_000,
    store_bandwidth_bytes_s=1e10,  # 2e-5 s per token
)


def hit(name: str, gpu: int = 0, cpu: int | None = None, disk: int | None = None, **load):
    cpu = gpu if cpu is None else cpu
    return Candidate(name, gpu, cpu, cpu if disk is None else disk, **load)


def test_round_robin_rotates_over_everyone():
    candidates = [hit("a"), hit("b"), hit("c")]
    assert [round_robin(candidates, turn).instance_id for turn in range(4)] == list("abca")


def test_least_loaded_prefers_less_queued_prefill_then_fewer_requests():
    candidates = [
        hit("a", queued_prefill_tokens=100, in_flight=1),
        hit("b", queued_prefill_tokens=50, in_flight=9),
        hit("c", queued_prefill_tokens=50, in_flight=2),
    ]
    assert least_loaded(candidates, 0).instance_id == "c"


def test_ties_rotate_with_the_turn():
    candidates = [hit("a", 64), hit("b", 64), hit("c", 16)]
    assert {max_prefix(candidates, turn).instance_id for turn in range(4)} == {"a", "b"}
    idle = [hit("a"), hit("b")]
    assert [least_loaded(idle, turn).instance_id for turn in range(2)] == ["a", "b"]


def test_max_prefix_uses_the_cumulative_hit_and_ignores_load():
    candidates = [hit("a", 32, queued_prefill_tokens=10**6), hit("b", 16, disk=48)]
    decision = max_prefix(candidates, 0)
    assert (decision.instance_id, decision.cached_tokens) == ("b", 48)


def test_zero_hits_everywhere_fall_back_to_rotation():
    candidates = [hit("a"), hit("b")]
    assert [max_prefix(candidates, t).instance_id for t in range(2)] == ["a", "b"]
    decisions = [ttft(candidates, t, 1000, MODEL) for t in range(2)]
    assert [d.instance_id for d in decisions] == ["a", "b"]
    assert all(d.cached_tokens == 0 for d in decisions)


def test_kv_cost_trades_overlap_against_load():
    candidates = [hit("a", 160, queued_prefill_tokens=320), hit("b", 0)]
    # a: 10 cached blocks - 20 queued blocks = -10 ; b: 0
    assert kv_cost(candidates, 0, block_size=16).instance_id == "b"
    # with overlap counted three times, a's cache wins: 30 - 20 = 10 > 0
    assert kv_cost(candidates, 0, block_size=16, overlap_weight=3).instance_id == "a"


def test_kv_cost_temperature_samples_but_favours_the_best():
    candidates = [hit("a", 1600), hit("b", 0)]
    rng = random.Random(7)
    picks = [kv_cost(candidates, 0, 16, temperature=50.0, rng=rng).instance_id for _ in range(400)]
    assert 0.7 < picks.count("a") / 400 < 1.0
    cold = {kv_cost(candidates, 0, 16, temperature=1e-6, rng=rng).instance_id for _ in range(50)}
    assert cold == {"a"}


def test_ttft_estimate_is_queue_plus_load_plus_prefill():
    candidate = hit("a", gpu=1000, cpu=3000, disk=4000, queued_prefill_tokens=500)
    estimate, cached = ttft_estimate(candidate, 10_000, MODEL)
    queue = 500 * 1e-4
    load = 2000 * 1e-5 + 1000 * 5e-5
    prefill = 0.01 + 6000 * 1e-4
    assert estimate == pytest.approx(queue + load + prefill)
    assert cached == 4000


def test_ttft_prefers_a_hit_until_the_queue_outweighs_it():
    cached = hit("a", 8000, queued_prefill_tokens=1000)
    idle = hit("b")
    assert ttft([cached, idle], 0, 10_000, MODEL).instance_id == "a"
    busy = hit("a", 8000, queued_prefill_tokens=20_000)
    decision = ttft([busy, idle], 0, 10_000, MODEL)
    assert decision.instance_id == "b"
    assert decision.scores["a"] > decision.scores["b"] == decision.estimated_ttft_s


def test_ttft_slo_rejects_with_the_best_estimate():
    candidates = [hit("a", queued_prefill_tokens=50_000), hit("b", queued_prefill_tokens=40_000)]
    with pytest.raises(SloViolation) as rejected:
        ttft(candidates, 0, 1000, MODEL, slo_s=1.0)
    assert rejected.value.best.instance_id == "b"
    assert "exceeds the 1000 ms SLO" in str(rejected.value)
    assert ttft(candidates, 0, 1000, MODEL, slo_s=10.0).instance_id == "b"


def test_a_store_hit_costs_tokens_times_bytes_per_token_over_bandwidth():
    own_tier = hit("a", gpu=1000, cpu=3000, disk=3000)
    shared = hit("b", gpu=1000, cpu=3000, disk=3000, store=True)
    prefill = MODEL.prefill_s(7000, 3000)
    assert ttft_estimate(own_tier, 10_000, MODEL)[0] == pytest.approx(2000 * 1e-5 + prefill)
    assert MODEL.store_load_s(2000) == pytest.approx(2000 * 200_000 / 1e10)
    assert ttft_estimate(shared, 10_000, MODEL)[0] == pytest.approx(2000 * 2e-5 + prefill)


def test_balancing_pulls_a_prefix_through_the_store_to_an_idle_instance():
    """Both instances share the store that holds 9000 tokens of the prompt; the holder has
    them on its GPU but is busy, the idle one holds 1000."""
    holder = hit("a", 9000, queued_prefill_tokens=30_000, store=True)
    idle = hit("b", 1000, cpu=9000, store=True)
    without = ttft([holder, idle], 0, 10_000, MODEL, balance_threshold=math.inf)
    assert (without.instance_id, without.cached_tokens) == ("b", 1000)
    assert without.estimated_ttft_s == pytest.approx(MODEL.prefill_s(9000, 1000))
    pulled = ttft([holder, idle], 0, 10_000, MODEL, balance_threshold=4.0)
    assert (pulled.instance_id, pulled.cached_tokens) == ("b", 9000)
    assert pulled.estimated_ttft_s == pytest.approx(
        MODEL.store_load_s(8000) + MODEL.prefill_s(1000, 9000)
    )
    # below the threshold the pull is not counted
    not_enough = ttft([holder, idle], 0, 10_000, MODEL, balance_threshold=10.0)
    assert not_enough.cached_tokens == 1000
    # the default threshold applies when none is given
    assert 9000 / 1000 > STORE_BALANCE_THRESHOLD
    assert ttft([holder, idle], 0, 10_000, MODEL).cached_tokens == 9000


def test_without_a_store_the_cpu_tier_is_the_instances_own_whatever_the_threshold():
    own_tier = hit("b", 1000, cpu=9000)
    for threshold in (None, 1.0, 10.0, math.inf):
        estimate, cached = ttft_estimate(own_tier, 10_000, MODEL, threshold)
        assert cached == 9000
        assert estimate == pytest.approx(8000 * 1e-5 + MODEL.prefill_s(1000, 9000))


@pytest.mark.parametrize("policy", POLICIES)
def test_choose_dispatches_every_policy(policy):
    candidates = [hit("a", 64), hit("b")]
    decision = choose(RoutingParams(policy=policy), candidates, 0, 128)
    assert decision.policy == policy and decision.instance_id in {"a", "b"}


def test_choose_rejects_unknown_policies_and_empty_fleets():
    with pytest.raises(ValueError, match="unknown policy"):
        choose(RoutingParams(policy="magic"), [hit("a")], 0, 10)
    with pytest.raises(ValueError, match="no candidate"):
        choose(RoutingParams(), [], 0, 10)


def test_prefill_cost_model_shape():
    model = PrefillCostModel()
    assert model.prefill_s(0) == 0.0
    assert model.prefill_s(2000) > 2 * model.prefill_s(1000) - model.overhead_s
    assert model.prefill_s(1000, cached_tokens=8000) > model.prefill_s(1000)
    assert math.isclose(model.load_s(0, 0), 0.0)
    assert model.store_load_per_token_s == pytest.approx(327_680 / 100e9)


def test_ttft_slack_keeps_a_request_with_its_prefix_when_nearly_as_fast():
    holder = hit("a", 8000, queued_prefill_tokens=10_000)  # 1.0 + 0.21 s
    idle = hit("b")  # 1.01 s
    assert ttft([holder, idle], 0, 10_000, MODEL).instance_id == "b"  # Algorithm 1
    near = ttft([holder, idle], 0, 10_000, MODEL, slack=0.5)
    assert (near.instance_id, near.cached_tokens) == ("a", 8000)
    far = hit("a", 8000, queued_prefill_tokens=30_000)  # 3.2 s: beyond 1.5 x 1.01 s
    assert ttft([far, idle], 0, 10_000, MODEL, slack=0.5).instance_id == "b"


def test_a_hit_covering_the_whole_prompt_reuses_one_block_less() -> None:
    """vLLM recomputes the last token; at a block boundary that costs the last block."""
    hits = {"a": (64, 64, 64), "b": (32, 64, 96), "c": (0, 0, 0)}
    assert reusable_hits(hits, 64, 32) == {"a": (32, 32, 32), "b": (32, 32, 32), "c": (0, 0, 0)}
    assert reusable_hits(hits, 97, 32) == hits
    assert reusable_hits({"a": (0, 0, 0)}, 0, 32) == {"a": (0, 0, 0)}
