"""The comparison's verdicts: ours against every peer, by engine and client TTFT and hits."""

from __future__ import annotations

from bench.router_compare import evaluate_goals, format_goals


def run(hit: float, mean: float, p90: float, client: float | None = None) -> dict:
    client = mean if client is None else client
    return {"hit_ratio": hit, "ttft_mean_s": mean, "ttft_p90_s": p90,
            "client_ttft_mean_s": client, "client_ttft_p90_s": client}  # fmt: skip


def test_ours_meets_both_goals_only_when_lowest_and_close_enough_on_hits() -> None:
    runs = {
        "ttft": run(0.098, 5.0, 9.0),
        "vllm-router:kv_aware": run(0.100, 6.0, 9.0),
        "sglang-router:cache_aware": run(0.090, 5.5, 12.0),
    }
    goal = evaluate_goals(runs, ["ttft"])["ttft"]
    assert goal["lowest_mean_and_p90_ttft"] and goal["lowest_mean_and_p90_client_ttft"]
    assert goal["best_peer_by_hit"] == "vllm-router:kv_aware" and goal["hit_goal_met"]
    runs["ttft"] = run(0.096, 5.0, 9.0, client=7.0)  # 96 %; slower for the client
    goal = evaluate_goals(runs, ["ttft"])["ttft"]
    assert goal["lowest_mean_and_p90_ttft"] and not goal["lowest_mean_and_p90_client_ttft"]
    assert not goal["hit_goal_met"]
    assert "client MISSED" in format_goals({"ttft": goal})[0]


def test_without_peers_or_ttfts_nothing_is_claimed() -> None:
    alone = evaluate_goals({"ttft": run(0.1, 5.0, 9.0)}, ["ttft"])["ttft"]
    assert alone["hit_goal_met"] is None and alone["lowest_mean_and_p90_ttft"] is None
    failed = run(0.0, 5.0, 9.0) | {"ttft_mean_s": None}
    goal = evaluate_goals({"ttft": run(0.1, 5.0, 9.0), "sglang-router:cache_aware": failed},
                          ["ttft"])["ttft"]  # fmt: skip
    assert goal["lowest_mean_and_p90_ttft"] is None
    assert "not evaluated" in format_goals({"ttft": goal})[0]
