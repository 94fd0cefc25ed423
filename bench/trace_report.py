"""The trace replay's command line: run the policies in parallel, print, write JSON and PNG.

``python -m bench.trace_report --help``; the simulation itself is ``bench/trace_sim.py``,
which imports nothing from here. One process per run (policy × trace) on a pool of
``--jobs`` workers: a run is single-threaded, CPU-bound Python.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.trace_sim import (
    DEFAULT_SLOS_S,
    RUNS,
    SIM_POLICIES,
    TRACE_BLOCK_SIZE,
    TTFT_VARIANTS,
    SimConfig,
    TraceRequest,
    cost_model_from_timing,
    distinct_blocks,
    json_safe,
    load_trace,
    simulate,
    summarize,
    trace_path,
    unbounded_block_hit_ratio,
    unbounded_token_hits,
)
from publishers.engine.timing import TimingModel
from router.policy import RoutingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HIT_GOAL = 0.95  # ttft's hit ratio over the pooled cache's
STORE = "+store"  # the suffix of a run with the shared store (and of its pooled reference)
# the router's defaults, without and with a store, and the reference each is held to
DEFAULT_RUNS = {"ttft": "pooled", f"ttft{STORE}": f"pooled{STORE}"}
# Mooncake FAST'25, Figure 5: average TTFT (s), conversation trace, 16 prefill nodes.
PAPER_TTFT_S = {"random": 19.65, "load-balancing": 5.27, "local": 3.58, "global": 3.07}
# Our runs standing for the paper's four schedulers: as the brief maps them, and as the
# paper defines them (§4.1 local = Algorithm 1 without, §4.2 global = with cache balancing,
# every scheduler in front of Mooncake's store).
PAPER_MAPPINGS = {
    "brief": ("random", "least_loaded", "max_prefix", "ttft"),
    "paper": tuple(f"{name}{STORE}" for name in ("random", "least_loaded", "ttft-local", "ttft")),
}

_TRACES: dict[tuple[str, int | None, float], list[TraceRequest]] = {}  # per worker process


def _requests(trace: str, limit: int | None, time_scale: float) -> list[TraceRequest]:
    key = (trace, limit, time_scale)
    if key not in _TRACES:
        _TRACES[key] = load_trace(trace_path(trace), limit, time_scale)
    return _TRACES[key]


def _run(task: tuple[str, str, int | None, float, SimConfig, tuple[float, ...]]) -> dict:
    """One run in a worker; returns its summary plus the sorted TTFTs for the plot."""
    trace, name, limit, time_scale, config, slos = task
    result = simulate(_requests(trace, limit, time_scale), config, name.removesuffix(STORE))
    result.policy = name
    return {"trace": trace, **summarize(result, slos), "ttfts": sorted(result.ttfts)}


def run_names(policies: Sequence[str], store: bool, store_off: bool = True) -> list[str]:
    """The runs of one trace: the pooled reference and every policy, without the store
    (variants of ttft aside: they differ from it only with one) and, with ``store``, with
    it (``+store``)."""
    names = []
    if store_off:
        names += ["pooled", *(name for name in policies if name not in TTFT_VARIANTS)]
    if store:
        names += [f"{name}{STORE}" for name in ("pooled", *policies)]
    return names


# -- goals -------------------------------------------------------------------------------


def evaluate_goals(trace: str, runs: dict[str, dict]) -> dict[str, Any]:
    """The brief's targets for this trace, each with the figures behind it: the router's
    default (``ttft``, with the store's default balancing when there is one) against the
    pooled cache of equal capacity, and its TTFT against every other run."""
    timed = {name: run for name, run in runs.items() if "ttft_mean_s" in run}
    goals: dict[str, Any] = {}
    for name, reference in DEFAULT_RUNS.items():
        if name not in timed or reference not in runs:
            continue
        run, pooled = timed[name], runs[reference]["hit_ratio"]
        policies = [
            o for other, o in timed.items() if other.removesuffix(STORE) not in TTFT_VARIANTS
        ]
        goals[name] = {
            "reference": reference,
            "hit_vs_pooled": run["hit_ratio"] / pooled if pooled else math.nan,
            "hit_goal_met": run["hit_ratio"] >= HIT_GOAL * pooled,
            "lowest_mean_and_p90_of_policies": lowest_mean_and_p90(run, policies),
            "lowest_mean_and_p90_of_all": lowest_mean_and_p90(run, timed.values()),
        }
    if trace == "conversation":
        goals["paper_ordering"] = {
            label: _ordering(timed, names)
            for label, names in PAPER_MAPPINGS.items()
            if all(name in timed for name in names)
        }
    return goals


def lowest_mean_and_p90(run: dict, others: Any, figure: str = "ttft") -> bool:
    """Is ``run``'s mean and p90 ``figure`` at most every other run's? (The issue's bar for
    the router's default, here and in ``bench.router_compare``.)"""
    mean, p90 = f"{figure}_mean_s", f"{figure}_p90_s"
    return all(run[mean] <= o[mean] and run[p90] <= o[p90] for o in others)


def _ordering(timed: dict[str, dict], names: Sequence[str]) -> dict[str, Any]:
    """Is mean TTFT strictly decreasing along ``names``, each step by at least the paper's
    ratio?"""
    ours = [timed[name]["ttft_mean_s"] for name in names]
    paper = list(PAPER_TTFT_S.values())
    steps = [
        {
            "from": names[i],
            "to": names[i + 1],
            "ratio": ours[i] / ours[i + 1],
            "paper_ratio": paper[i] / paper[i + 1],
            "met": ours[i] / ours[i + 1] >= paper[i] / paper[i + 1],
        }
        for i in range(len(names) - 1)
    ]
    return {"mean_ttft_s": dict(zip(names, ours, strict=True)), "steps": steps,
            "met": all(step["met"] for step in steps)}  # fmt: skip


# -- output ------------------------------------------------------------------------------


def format_table(report: dict[str, Any]) -> str:
    """The per-trace table a reader compares policies with."""
    meta, runs = report["setup"], report["runs"]
    slos = list(next(r for r in runs.values() if "slo_attainment" in r)["slo_attainment"])
    pooled = {name: runs[name]["hit_ratio"] for name in DEFAULT_RUNS.values() if name in runs}
    lines = [
        f"{report['trace']}: {meta['requests']:,} requests, {meta['instances']} instances × "
        f"{meta['gpu_blocks_per_instance']:,} GPU blocks of {meta['block_size']} tokens, "
        f"store {meta['store_blocks']:,} blocks, arrivals × {meta['time_scale']:g}"
        + replicas_text(meta),
        f"  unbounded global cache: block hit ratio {report['unbounded']['block_hit_ratio']:.3f}"
        f" (trace ids), token hit ratio {report['unbounded']['token_hit_ratio']:.3f} (engine "
        f"rules); pooled LRU of equal capacity: "
        + ", ".join(f"{name} {hit:.3f}" for name, hit in pooled.items()),
        "  policy               hit  %pooled  mean s   p50 s   p90 s   p99 s  "
        + "".join(f"≤{slo}s  ".rjust(8) for slo in slos)
        + "imbal  wall s",
    ]
    for name, run in runs.items():
        if name.removesuffix(STORE) == "pooled":
            continue
        reference = pooled[f"pooled{STORE}" if name.endswith(STORE) else "pooled"]
        attainment = "".join(f"{run['slo_attainment'][slo]:7.1%} " for slo in slos)
        lines.append(
            f"  {name:18s} {run['hit_ratio']:5.3f} {run['hit_ratio'] / reference:7.1%} "
            f"{run['ttft_mean_s']:7.2f} {run['ttft_p50_s']:7.2f} {run['ttft_p90_s']:7.2f} "
            f"{run['ttft_p99_s']:7.2f} {attainment} {run['imbalance_tokens']:5.2f} "
            f"{run['wall_s']:6.1f}"
        )
    lines += [f"  {line}" for line in format_goals(report["goals"])]
    return "\n".join(lines)


def replicas_text(meta: dict[str, Any]) -> str:
    """What the setup line adds past the defaults: engine speed, replicas, router models."""
    text = ""
    if meta.get("engine_speed", 1.0) != 1.0:
        text += f", engines × {meta['engine_speed']:g}"
    if meta.get("replicas", 1) > 1:
        lag = meta["load_lag_s"]
        shared = "no load sharing" if math.isinf(lag) else f"loads seen {lag:g} s late"
        text += f", {meta['replicas']} router replicas ({shared})"
    if meta.get("in_flight_prefixes"):
        text += ", in-flight prefixes"
        if meta.get("replicas", 1) > 1:
            lag = meta["routed_lag_s"]
            text += " not shared" if math.isinf(lag) else f" seen {lag:g} s late"
    if meta.get("learn_cost"):
        text += ", learned cost model"
    return text


def format_goals(goals: dict[str, Any]) -> list[str]:
    lines = []
    for name in DEFAULT_RUNS:
        if name in goals:
            goal = goals[name]
            lines.append(
                f"goal {name}: hit {goal['hit_vs_pooled']:.1%} of {goal['reference']} "
                f"({'met' if goal['hit_goal_met'] else 'MISSED'}: ≥ {HIT_GOAL:.0%}); lowest "
                f"mean and p90 TTFT of the policies: "
                f"{'yes' if goal['lowest_mean_and_p90_of_policies'] else 'NO'}, "
                f"of all runs: {'yes' if goal['lowest_mean_and_p90_of_all'] else 'NO'}"
            )
    for label, ordering in goals.get("paper_ordering", {}).items():
        steps = ", ".join(
            f"{s['from']}/{s['to']} {s['ratio']:.2f} (paper {s['paper_ratio']:.2f})"
            for s in ordering["steps"]
        )
        verdict = "met" if ordering["met"] else "MISSED"
        lines.append(f"paper ordering, {label} mapping: {verdict}: {steps}")
    return lines


def plot_cdfs(report: dict[str, Any], ttfts: dict[str, list[float]], path: Path) -> str:
    """A TTFT CDF per policy; returns what happened (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            f"PNG skipped: matplotlib is not installed (pip install matplotlib, or the "
            f"project's bench extra); the table and JSON have every figure ({path.name})"
        )
    figure, axes = plt.subplots(figsize=(8, 5))
    for name, values in ttfts.items():
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.plot(values, fractions, label=name, linewidth=1.4)
    setup = report["setup"]
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (s, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(
        f"{report['trace']} trace: {setup['requests']:,} requests, "
        f"{setup['instances']} prefill instances"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"wrote {path}"


# -- driver ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.trace_report", description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    add = parser.add_argument
    add("--trace", action="append", help="conversation, synthetic or a path (repeatable); "
        "default: both")  # fmt: skip
    add("--policies", nargs="+", default=list(RUNS), choices=[*SIM_POLICIES, *TTFT_VARIANTS])
    add("--limit", type=int, help="replay only the first N requests")
    add("--time-scale", type=float, default=1.0, help="multiply arrival times (<1: more load)")
    add("--instances", type=int, default=8)
    add("--block-size", type=int, default=TRACE_BLOCK_SIZE, help="the engines' block size")
    add("--gpu-blocks", type=int, help="per instance; default: distinct blocks / instances")
    add("--cpu-blocks", type=int, default=0, help="per-instance CPU offload tier")
    add("--store-blocks", type=int, default=0, help="shared Mooncake-store tier (0: none); "
        "every policy then runs without and with it")  # fmt: skip
    add("--store-only", action="store_true", help="with --store-blocks: skip the runs without")
    add("--balance-threshold", type=float, default=1.5, help="ttft-global's threshold")
    add("--overlap-weight", type=float, default=1.0, help="kv_cost")
    add("--temperature", type=float, default=0.0, help="kv_cost")
    add("--reject-slo-s", type=float, help="ttft rejects (429) past this estimated TTFT")
    add("--slo-s", type=float, nargs="+", default=list(DEFAULT_SLOS_S),
        help="TTFT SLOs to report attainment for")  # fmt: skip
    add("--cold-start", action="store_true", help="no warm-up request on the instances")
    add("--queue-seconds", action="store_true", help="what-if: queue estimated seconds")
    add("--verify", action="store_true", help="check the index against the engines")
    add("--engine-speed", type=float, default=1.0, help="GPU FLOPs relative to the "
        "TimingModel's default engine (router_replay runs 2)")  # fmt: skip
    add("--replicas", type=int, default=1, help="router replicas; request i goes to i mod N")
    add("--load-lag-s", type=float, default=0.0, help="trace seconds until a replica sees "
        "another's load (inf: no sharing); router_replay's wall seconds × its speedup")  # fmt: skip
    add("--in-flight-prefixes", action="store_true", help="routed prompts count as hits on "
        "their instance until their prefill starts (the router's pending prefixes)")  # fmt: skip
    add("--learn-cost", action="store_true", help="each router replica learns its cost "
        "model from its own TTFTs, as the router does by default (CostLearner)")  # fmt: skip
    add("--routed-lag-s", type=float, help="with --in-flight-prefixes: trace seconds until "
        "the other replicas see a routed prompt (default: --load-lag-s; inf: never)")  # fmt: skip
    add("--seed", type=int, default=0)
    add("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    add("--json", type=Path, default=RESULTS_DIR / "trace_replay.json")
    add("--png-dir", type=Path, default=RESULTS_DIR)
    add("--no-plot", action="store_true")
    return parser.parse_args(argv)


def config_from(args: argparse.Namespace) -> SimConfig:
    routing = RoutingParams(
        overlap_weight=args.overlap_weight,
        temperature=args.temperature,
        ttft_slo_s=args.reject_slo_s,
    )
    return SimConfig(
        num_instances=args.instances,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        store_blocks=args.store_blocks,
        routing=routing,
        global_balance_threshold=args.balance_threshold,
        seed=args.seed,
        queue_seconds=args.queue_seconds,
        warm_start=not args.cold_start,
        verify=args.verify,
        timing=replace(TimingModel(), gpu_flops=TimingModel().gpu_flops * args.engine_speed),
        replicas=args.replicas,
        load_lag_s=args.load_lag_s,
        in_flight_prefixes=args.in_flight_prefixes,
        routed_lag_s=args.routed_lag_s,
        learn_cost=args.learn_cost,
    )


def trace_setup(trace: str, requests: list[TraceRequest], config: SimConfig, args) -> dict:
    reused, total = unbounded_token_hits(requests, warm_start=config.warm_start)
    return {
        "trace": trace,
        "setup": {
            "requests": len(requests),
            "distinct_blocks": distinct_blocks(requests),
            "instances": config.num_instances,
            "gpu_blocks_per_instance": config.gpu_blocks_for(requests),
            "store_blocks": config.store_blocks_for(requests),
            "block_size": config.block_size,
            "time_scale": args.time_scale,
            "limit": args.limit,
            "engine_speed": args.engine_speed,
            "replicas": config.replicas,
            "load_lag_s": config.load_lag_s,
            "in_flight_prefixes": config.in_flight_prefixes,
            "routed_lag_s": config.routed_lag,
            "learn_cost": config.learn_cost,
        },
        "unbounded": {
            "block_hit_ratio": unbounded_block_hit_ratio(requests),
            "token_hit_ratio": reused / total if total else 0.0,
        },
        "runs": {},
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = config_from(args)
    traces = args.trace or ["conversation", "synthetic"]
    slos = tuple(args.slo_s)
    names = run_names(
        list(dict.fromkeys(args.policies)), config.store_blocks > 0, not args.store_only
    )
    reports = {}
    for trace in traces:
        requests = load_trace(trace_path(trace), args.limit, args.time_scale)
        reports[trace] = trace_setup(trace, requests, config, args)
    without_store = replace(config, store_blocks=0)
    tasks = [
        (t, n, args.limit, args.time_scale, config if n.endswith(STORE) else without_store, slos)
        for t in traces
        for n in names
    ]
    started = time.perf_counter()
    finished: dict[tuple[str, str], dict] = {}
    context = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
    with context.Pool(max(1, args.jobs)) as pool:
        for run in pool.imap_unordered(_run, tasks):
            finished[(run["trace"], run["policy"])] = run
            print(f"  {run['trace']}/{run['policy']}: {run['wall_s']:.1f} s", file=sys.stderr)
    wall_s = time.perf_counter() - started
    ttfts: dict[str, dict[str, list[float]]] = {trace: {} for trace in traces}
    for trace in traces:
        for name in names:
            run = finished[(trace, name)]
            ttfts[trace][name] = run.pop("ttfts")
            reports[trace]["runs"][name] = {k: v for k, v in run.items() if k != "trace"}
        reports[trace]["goals"] = evaluate_goals(trace, reports[trace]["runs"])
    for trace in traces:
        print(format_table(reports[trace]), end="\n\n")
        if not args.no_plot:
            names_with_times = {n: v for n, v in ttfts[trace].items() if v}
            path = args.png_dir / f"trace_{Path(trace).stem}_ttft_cdf.png"
            print(plot_cdfs(reports[trace], names_with_times, path))
    print(f"{len(tasks)} runs in {wall_s:.1f} s on {args.jobs} processes")
    write_json(args.json, reports, config, args, wall_s)
    print(f"wrote {args.json}")
    mismatches = sum(len(r.get("mismatches", [])) for rep in reports.values()
                     for r in rep["runs"].values())  # fmt: skip
    if mismatches:
        print(f"conductor index and engines disagreed {mismatches}+ times (see JSON)")
        return 1
    return 0


def write_json(path: Path, reports: dict, config: SimConfig, args, wall_s: float) -> None:
    document = {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("json", "png_dir")},
            "timing": asdict(config.timing),
            "cost_model": asdict(cost_model_from_timing(config.timing)),
            "routing": {**asdict(replace(config.routing, cost=None)), "cost": "cost_model"},
        },
        "wall_s": wall_s,
        "platform": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "traces": reports,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(document), indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
