"""Our router against vllm-router and sglang-router, side by side on both traces.

One command for the issue's router goal: in front of the same engine-simulator fleet, on
the conversation and the synthetic trace, our default policy has the lowest mean and p90
TTFT of every router, and a hit ratio at least ``HIT_SHARE_GOAL`` of the best peer's.

It is ``bench.router_replay`` with our default policy and every peer, text prompts (the
peers get exactly what ours gets), once per trace: each router on a fresh fleet (same
engines, flags, warm-up and requests). Every option of ``python -m bench.router_replay``
passes through (``--requests``, ``--engines``, ``--speedup``, ``--peer-bin-dir``,
``--tokenizer``...). The peers come from the project's ``routers`` extra or any venv:

    python -m bench.router_compare --peer-bin-dir /path/to/venv/bin

Results: a table per trace, the goals, and ``bench/results/router_compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import router_replay
from bench.harness import machine
from bench.peer_routers import PEERS
from bench.trace_report import lowest_mean_and_p90
from bench.trace_sim import json_safe

HIT_SHARE_GOAL = 0.97  # our hit ratio over the best peer's
DEFAULTS = ("--policies", "ttft", "--peers", ",".join(PEERS), "--prompts", "text")
TRACES = ("conversation", "synthetic")
TTFTS = {"ttft": "engine", "client_ttft": "client"}  # the summaries' figures, as named in print


def evaluate_goals(runs: dict[str, dict], policies: Sequence[str]) -> dict[str, Any]:
    """Per policy of ours: lowest mean and p90 TTFT of all routers, as the engines measure it
    (from their receiving the request) and as the client sees it (which adds the router's
    time)? Hit ratio at least the share of the best peer's? None: not evaluated (no peer, or
    a run without TTFTs because every request failed)."""
    peers = {name: run for name, run in runs.items() if name in PEERS}
    timed = all(run[f"{figure}_mean_s"] is not None for run in runs.values() for figure in TTFTS)
    goals: dict[str, Any] = {}
    for policy in policies:
        run = runs[policy]
        best = max(peers, key=lambda name: peers[name]["hit_ratio"], default=None)
        best_hit = peers[best]["hit_ratio"] if best else 0.0
        share = run["hit_ratio"] / best_hit if best_hit else None
        goals[policy] = {
            **{
                f"lowest_mean_and_p90_{figure}": (
                    lowest_mean_and_p90(run, peers.values(), figure) if timed and peers else None
                )
                for figure in TTFTS
            },
            "best_peer_by_hit": best,
            "hit_vs_best_peer": share,
            "hit_goal_met": None if share is None else share >= HIT_SHARE_GOAL,
        }
    return goals


def format_goals(goals: dict[str, Any]) -> list[str]:
    def verdict(value: bool | None) -> str:
        return "not evaluated" if value is None else "met" if value else "MISSED"

    lines = []
    for policy, goal in goals.items():
        share = goal["hit_vs_best_peer"]
        lowest = ", ".join(
            f"{name} {verdict(goal[f'lowest_mean_and_p90_{figure}'])}"
            for figure, name in TTFTS.items()
        )
        lines.append(
            f"goal {policy}: lowest mean and p90 TTFT of all routers: {lowest}; hit "
            + ("–" if share is None else f"{share:.1%}")
            + f" of the best peer's ({goal['best_peer_by_hit']}): "
            f"{verdict(goal['hit_goal_met'])} (≥ {HIT_SHARE_GOAL:.0%})"
        )
    return lines


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This command's own options; the rest is for ``bench.router_replay``."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.router_compare",
        description=__doc__.split("\n")[0],
        epilog="Other options go to bench.router_replay (see python -m bench.router_replay -h); "
        f"its defaults here: {' '.join(DEFAULTS)}.",
    )
    parser.add_argument("--traces", nargs="+", default=list(TRACES), help="traces to replay")
    parser.add_argument(
        "--json", type=Path, default=router_replay.RESULTS_DIR / "router_compare.json"
    )
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, replay_argv = parse_args(argv)
    replay_args = [
        router_replay.parse_args([*DEFAULTS, *replay_argv, "--trace", trace])
        for trace in args.traces
    ]  # fmt: skip  (every usage error before any run)
    router_replay.STOPPING.install()
    report: dict[str, Any] = {"traces": {}, "machine": machine()}
    status = 0
    for trace, options in zip(args.traces, replay_args, strict=True):
        setup = router_replay.build_setup(options)
        load_before = os.getloadavg()
        described, runs, wall_s = router_replay.run_all(setup, options.log_dir)
        goals = evaluate_goals({run["policy"]: run for run in runs}, setup.policies)
        print(f"\n## {trace}\n")
        print(versions_line(described))
        print(router_replay.format_table(described, runs))
        print("\n".join(format_goals(goals)))
        report["traces"][trace] = {
            "setup": described,
            "runs": {run["policy"]: run for run in runs},
            "goals": goals,
            "wall_s": wall_s,
            "load_average": {"before": load_before, "after": os.getloadavg()},
        }
        status = max(status, router_replay.check_runs(runs))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(json_safe(report), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")
    return status


def versions_line(described: dict[str, Any]) -> str:
    """The setup in a line, with each peer's version once."""
    peers = ", ".join(
        dict.fromkeys(f"{name.split(':')[0]} {peer['version']}"
                      for name, peer in described["peers"].items())
    )  # fmt: skip
    return (
        f"{described['requests']} requests, {described['engines']} engines, speedup "
        f"{described['speedup']:g}, prompts {described['prompts']}, our conductor "
        f"{described['conductor']}; peers: {peers or 'none'}; "
        f"ideal hit {described['ideal_hit_ratio']:.1%}, "
        f"pooled-LRU {described['pooled_hit_ratio']:.1%}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
