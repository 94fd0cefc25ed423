"""Smoke test of the router replay: the whole stack as processes, a small slice, quickly.

The benchmark's numbers are only worth reading if every request made it through router,
conductor and engines, and if the figures it reports are well-formed; this runs
``--quick`` exactly as a user would and checks both, a small ``--mixed`` replay (two
models and their adapters on one fleet, then each alone), and (when vllm-router and
sglang-router are installed) a small slice through every peer router.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.peer_routers import PEERS
from bench.router_replay import MIXED_MODELS, conversation_name
from bench.trace_sim import load_trace, trace_path
from tests.support.bench_run import run_bench
from tests.support.parts import peer_bin_dir

BUDGET_S = 60.0
STORE_BUDGET_S = 180.0  # two fleets, one with a store to start and fill
MIXED_BUDGET_S = 120.0  # five fleets
MIXED_NAMES = [name for model, adapters in MIXED_MODELS for name in (model, *adapters)]


def run_replay(tmp_path: Path, *flags: str, budget_s: float = BUDGET_S) -> dict:
    """``python -m bench.router_replay`` as a user runs it, within the budget; its JSON
    report."""
    report_path = tmp_path / "router_replay.json"
    run_bench("bench.router_replay", *flags, "--json", str(report_path), budget_s=budget_s)
    return json.loads(report_path.read_text())


def test_quick_replay_completes_without_errors(tmp_path: Path) -> None:
    report = run_replay(tmp_path, "--quick")
    runs = report["runs"]
    assert list(runs) == report["setup"]["policies"] and len(runs) == 2
    for policy, run in runs.items():
        assert run["errors"] == 0, (policy, run["error_samples"])
        assert run["served"] + run["rejected"] == run["requests"] == report["setup"]["requests"]
        assert 0.0 <= run["hit_ratio"] <= 1.0, policy
        assert run["ttft_p50_s"] is not None and run["ttft_p50_s"] > 0, policy
        served = sum(entry["requests"] for entry in run["instances"].values())
        assert served == run["served"], policy  # every answer named a configured engine


def test_a_replay_with_the_index_in_the_router_runs_no_conductor(tmp_path: Path) -> None:
    """``--conductor embedded``: the router indexes the engines' events itself; the warm-up
    waits on its metrics, and every request is routed with the index's answer."""
    report = run_replay(tmp_path, "--quick", "--policies", "ttft", "--conductor", "embedded")
    assert report["setup"]["conductor"] == "embedded"
    run = report["runs"]["ttft"]
    assert run["errors"] == 0, run["error_samples"]
    assert run["served"] == run["requests"] == report["setup"]["requests"]
    assert sum(run["fallbacks"].values()) == 0
    assert run["hit_ratio"] > 0


def test_router_replicas_each_serve_their_share_of_the_requests(tmp_path: Path) -> None:
    """``--replicas 1,2``: each policy runs with one router, then two sharing the
    conductor, the client alternating between them."""
    report = run_replay(tmp_path, "--quick", "--policies", "ttft", "--replicas", "1,2")
    assert report["setup"]["replica_runs"] == [1, 2]
    assert list(report["runs"]) == ["ttft", "ttftx2"]
    for label, run in report["runs"].items():
        assert run["errors"] == 0, (label, run["error_samples"])
        assert run["served"] == run["requests"] == report["setup"]["requests"]


def test_the_mixed_split_keeps_every_reused_prefix_within_one_name() -> None:
    """The split by conversation loses no hit the one-model replay could have: every
    request's longest prefix shared with an earlier one, beyond the conversation trace's
    common block 0, is an earlier request's of the same name."""
    earlier: dict[tuple[int, ...], str] = {}
    reused = 0
    for request in load_trace(trace_path("conversation"), 800):
        name = conversation_name(request, MIXED_NAMES)
        ids = request.hash_ids
        longest = next((ids[:k] for k in range(len(ids), 1, -1) if ids[:k] in earlier), None)
        if longest is not None:
            assert earlier[longest] == name, request.index
            reused += 1
        earlier.update((ids[:k], name) for k in range(1, len(ids) + 1))
    assert reused > 100  # the slice does reuse conversations' prefixes


def test_a_mixed_replay_compares_each_name_with_its_replay_alone(tmp_path: Path) -> None:
    """``--mixed``: the slice split across two models and an adapter of each on one fleet
    of four engines, then each name's requests alone on two engines of its model. Every
    request is served by an engine of its own model, and the comparison reads both runs."""
    report = run_replay(
        tmp_path, "--mixed", "--requests", "40", "--speedup", "20", budget_s=MIXED_BUDGET_S
    )
    runs = report["runs"]
    assert list(runs) == ["ttft@mixed", *(f"ttft@{name}" for name in MIXED_NAMES)]
    mixed = runs["ttft@mixed"]
    assert list(mixed["models"]) == MIXED_NAMES and mixed["served"] == 40
    engines_of = {  # two engines per model, numbered in the models' order
        name: {f"engine-{2 * index}", f"engine-{2 * index + 1}"}
        for index, (model, adapters) in enumerate(MIXED_MODELS)
        for name in (model, *adapters)
    }
    rows = {row["model"]: row for row in report["comparison"]}
    for name in MIXED_NAMES:
        alone, in_mixed = runs[f"ttft@{name}"], mixed["models"][name]
        assert alone["errors"] == in_mixed["errors"] == 0, name
        assert alone["served"] == in_mixed["served"] == in_mixed["requests"] > 0, name
        assert set(in_mixed["instances"]) == engines_of[name], name
        served = sum(entry["requests"] for entry in in_mixed["instances"].values())
        assert served == in_mixed["served"], name  # every answer from its model's engines
        assert in_mixed["hit_ratio"] > 0 and alone["hit_ratio"] > 0, name  # the warm-up's
        row = rows[name]
        assert (row["hit_mixed"], row["hit_alone"]) == (in_mixed["hit_ratio"], alone["hit_ratio"])
        assert row["ttft_p50_s_mixed"] > 0 and row["ttft_p50_s_alone"] > 0, name


@pytest.mark.needs("store")
def test_a_replay_with_the_store_loads_what_another_engine_saved(tmp_path: Path) -> None:
    """With ``--store both`` the same slice runs without and with a real store. With it, the
    warm-up's prompt, computed by the first engine, is loaded by the second from the store."""
    report = run_replay(
        tmp_path, "--requests", "30", "--engines", "2", "--policies", "round_robin",
        "--speedup", "20", "--store", "both", budget_s=STORE_BUDGET_S,
    )  # fmt: skip
    runs = report["runs"]
    assert list(runs) == ["round_robin", "round_robin+store"]
    for label, run in runs.items():
        assert run["errors"] == 0, (label, run["error_samples"])
        assert run["served"] == run["requests"] == 30, label
    assert runs["round_robin"]["store_loaded_tokens"] == 0
    warm_up_prompt = report["setup"]["warm_up_prompt_tokens"] // 16 * 16
    assert runs["round_robin+store"]["store_loaded_tokens"] >= warm_up_prompt - 16
    assert runs["round_robin+store"]["hit_ratio"] >= runs["round_robin"]["hit_ratio"]


@pytest.mark.needs("peer-routers")
def test_every_peer_router_serves_the_same_text_prompts(tmp_path: Path) -> None:
    """Ours and each peer on a fleet of its own, the same text prompts: every request served,
    the engines' figures read through every router, each peer's version recorded."""
    bin_dir = peer_bin_dir()
    report = run_replay(
        tmp_path, "--requests", "16", "--engines", "2", "--speedup", "20", "--policies", "ttft",
        "--peers", ",".join(PEERS), *(("--peer-bin-dir", str(bin_dir)) if bin_dir else ()),
    )  # fmt: skip
    assert report["setup"]["prompts"] == "text (stand-in tokenizer)"
    assert all(peer["version"] != "unknown" for peer in report["setup"]["peers"].values())
    runs = report["runs"]
    assert list(runs) == ["ttft", *PEERS]
    for label, run in runs.items():
        assert run["errors"] == 0, (label, run["error_samples"])
        assert run["served"] == run["requests"] == 16, label
        assert sum(entry["requests"] for entry in run["instances"].values()) == 16, label
        assert run["ttft_p50_s"] > 0 and run["path_overhead_p50_ms"] is not None, label
        assert run["routing_cpu_s"] > 0, label
        assert run["hit_ratio"] > 0, label  # the warm-up's first block, cached everywhere
    assert runs["ttft"]["overhead_p50_ms"] is not None
