"""``python -m bench.load_bench``, shortened, and the pieces whose mistakes would not show
as a failure: a workload that removes what it never stored, or a profile mis-summed."""

from __future__ import annotations

import json
from collections import Counter

import msgpack

from bench import pyspy
from bench.load_bench import main, split
from bench.load_streams import PacedWorkload, TraceWorkload, prefix_holdings


def held_after(sends: list, streams: int) -> list[Counter]:
    """Replay the payloads as the conductor would: per stream, engine hash -> copies."""
    held = [Counter() for _ in range(streams)]
    for send in sends:
        _, events, _ = msgpack.unpackb(send.batch.payload)
        for event in events:
            for block in event["block_hashes"]:
                if event["type"] == "BlockStored":
                    held[send.stream][block] += 1
                else:
                    assert held[send.stream][block] > 0, "removed a block it does not hold"
                    held[send.stream][block] -= 1
    return held


def test_a_paced_stream_stays_at_its_capacity_and_keeps_its_query_prefix() -> None:
    workload = PacedWorkload(0, 2, rate_blocks_per_s=6_400, capacity_blocks=640, duration_s=2)
    sends = list(workload.sends())
    assert [s.due_s for s in sends] == sorted(s.due_s for s in sends)
    assert len(sends) == 21 + 20  # 10 batches a second each: at 0, 0.1 .. 2.0 and 0.05 .. 1.95
    held = held_after(sends, 2)
    for stream in range(2):
        blocks = sum(1 for copies in held[stream].values() if copies)
        assert blocks == 640 + prefix_holdings(stream)  # capacity (2 batches) + the prefix
        assert max(held[stream].values()) == 1


def test_trace_streams_only_remove_what_they_hold() -> None:
    workload = TraceWorkload(
        0, 3, instances=3, trace="conversation", speedup=1, capacity_blocks=512,
        step_tokens=256, duration_s=60,
    )  # fmt: skip
    sends = list(workload.sends())
    assert sends and all(s.batch.stored <= 256 // 16 for s in sends)
    held_after(sends, 3)
    assert sum(s.batch.removed for s in sends) > 0


def test_split_covers_every_stream_once() -> None:
    assert split(10, 3) == [(0, 3), (3, 3), (6, 4)]
    assert sum(count for _, count in split(1000, 4)) == 1000


def test_pyspy_summary_ranks_self_and_inclusive_time(tmp_path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "run (/x/a/service.py);ingest (/x/conductor/manager.py);apply (/x/conductor/index.py) 30\n"
        "run (/x/a/service.py);query (/x/conductor/api.py);walk (/x/conductor/index.py) 10\n"
        "garbage line\n"
    )
    summary = pyspy.summarize(raw)
    assert summary["samples"] == 40
    assert summary["self_pct"][0] == ("conductor/index.py:apply", 75.0)
    assert ("conductor/manager.py:ingest", 75.0) in summary["inclusive_pct"]
    assert all(name != "a/service.py:run" for name, _ in summary["inclusive_pct"])  # the trunk


def test_a_quick_run_loses_nothing(tmp_path) -> None:
    out = tmp_path / "load.json"
    assert main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for scenario in ("paced", "trace"):
        sent, seen = result[scenario]["sent"], result[scenario]["counters"]
        assert seen["blocks_stored"] == sent["blocks_stored"] > 0
        assert seen["events"] == sent["events"]
        assert seen["gaps_unrepaired"] == 0
    assert result["paced"]["loaded"]["blocks_stored_per_s"] > 0
    assert result["paced"]["queries"]["all"]["requests"] > 0
    assert result["trace"]["sent"]["blocks_removed"] > 0
