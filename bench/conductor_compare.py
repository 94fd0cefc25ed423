"""Our conductor against the benchmark's peer: ratios ours / peer from one run's results.

Ingest compares runs fed the same events (vLLM <= 0.23 arrays, the layout the Go decoder
reads), interleaved in one run. ``/query`` compares the same cell (instance count and index
size) with the same JSON body; our msgpack query (int32-packed tokens) is set against the
peer's JSON too, since JSON is all the Go service reads. A ratio below 1 means ours is
faster (latency) or smaller (memory); for ingest, above 1 means ours is faster.
"""

from __future__ import annotations

import math
from typing import Any

GOALS = {"ingest_ratio_min": 2.0, "query_ratio_max": 0.5}  # issue 10, against the Go service


def pair(ours: float, peer: float) -> dict[str, float]:
    return {"ours": ours, "peer": peer, "ratio": ours / peer if peer else math.nan}


def compare_cell(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    json_p50, json_p99 = peer["client"]["p50_ms"], peer["client"]["p99_ms"]
    packed = ours["msgpack_int32"]
    cell = {
        "instances": ours["instances"],
        "blocks": ours["blocks"],
        "peer_blocks": peer["blocks"],
        "p50_ms": pair(ours["client"]["p50_ms"], json_p50),
        "p99_ms": pair(ours["client"]["p99_ms"], json_p99),
        "msgpack_p50_ms": pair(packed["p50_ms"], json_p50),
        "msgpack_p99_ms": pair(packed["p99_ms"], json_p99),
        "floor_1_block_p50_ms": pair(
            ours["floor_1_block"]["p50_ms"], peer["floor_1_block"]["p50_ms"]
        ),
        "bytes_per_block_total": pair(ours["bytes_per_block_total"], peer["bytes_per_block_total"]),
        "bytes_per_block_delta": pair(ours["bytes_per_block_delta"], peer["bytes_per_block_delta"]),
    }
    goal = GOALS["query_ratio_max"]
    cell["pass"] = {
        "p50": cell["p50_ms"]["ratio"] <= goal,
        "p99": cell["p99_ms"]["ratio"] <= goal,
        "msgpack_p50": cell["msgpack_p50_ms"]["ratio"] <= goal,
        "msgpack_p99": cell["msgpack_p99_ms"]["ratio"] <= goal,
    }
    return cell


def compare(result: dict[str, Any]) -> dict[str, Any]:
    """The ``comparison`` section of the JSON: ingest, then every cell of the grid."""
    ingest = pair(result["ingest_legacy"]["blocks_per_s"], result["peer"]["ingest"]["blocks_per_s"])
    cells = [
        compare_cell(ours, peer)
        for ours_run, peer_run in zip(result["query"], result["peer"]["query"], strict=True)
        for ours, peer in zip(ours_run["cells"], peer_run["cells"], strict=True)
    ]
    return {
        "goals": GOALS,
        "ingest_blocks_per_s": {**ingest, "pass": ingest["ratio"] >= GOALS["ingest_ratio_min"]},
        "query": cells,
    }


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_comparison(comparison: dict[str, Any]) -> None:
    goals, ingest = comparison["goals"], comparison["ingest_blocks_per_s"]
    print(
        "\n== side by side with the peer: ratio = ours / peer "
        f"(goals: ingest >= {goals['ingest_ratio_min']}x, /query p50 and p99 "
        f"<= {goals['query_ratio_max']}x)"
    )
    print(
        f"  ingest, vLLM <= 0.23 arrays: ours {ingest['ours']:,.0f} blocks/s, peer "
        f"{ingest['peer']:,.0f} blocks/s: x{ingest['ratio']:.2f}   [{verdict(ingest['pass'])}]"
    )
    print(
        f"  {'inst':>4} {'blocks':>9} | {'p50 ours':>8} {'peer':>7} {'x':>5} | {'p99 ours':>8} "
        f"{'peer':>7} {'x':>5} | {'mp p50 x':>8} {'mp p99 x':>8} | {'1-blk x':>7} | "
        f"{'B/blk ours':>10} {'peer':>6} {'x':>5}"
    )
    for cell in comparison["query"]:
        p50, p99, memory = cell["p50_ms"], cell["p99_ms"], cell["bytes_per_block_total"]
        print(
            f"  {cell['instances']:>4} {cell['blocks']:>9,} | {p50['ours']:>8.3f} "
            f"{p50['peer']:>7.3f} {p50['ratio']:>5.2f} | {p99['ours']:>8.3f} {p99['peer']:>7.3f} "
            f"{p99['ratio']:>5.2f} | {cell['msgpack_p50_ms']['ratio']:>8.2f} "
            f"{cell['msgpack_p99_ms']['ratio']:>8.2f} | "
            f"{cell['floor_1_block_p50_ms']['ratio']:>7.2f} | {memory['ours']:>10.0f} "
            f"{memory['peer']:>6.0f} {memory['ratio']:>5.2f}"
        )
    print("  (mp = our msgpack query against the peer's JSON one; B/blk = RSS / blocks)")
