"""bench/index_bench.py: a tiny run of every phase, so the benchmark keeps working.

Dynamo's side runs only where its bindings are installed; both indexes must give the
same answer to the same walk (the benchmark refuses to report numbers otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import index_bench
from bench.index_bench import Sizes, dynamo_version, memory, query_index, run, throughput

TINY = Sizes(ingest_blocks=640, runs=1, query_blocks=320, queries=5, memory_blocks=640)
NAMES = ["ours", "ours-wire"] + (["dynamo"] if dynamo_version() else [])  # what a run reports
INDEXES = ["ours", "ours-wire", pytest.param("dynamo", marks=pytest.mark.needs("dynamo"))]


@pytest.mark.parametrize("name", INDEXES)
@pytest.mark.parametrize("instances", [1, 8])
def test_both_indexes_answer_the_prompt_alike(name: str, instances: int) -> None:
    """The query phase checks every instance's prefix (128, 112, … blocks) before timing."""
    index, tokens = query_index(name, instances, TINY)
    assert index.walk(index.hash(tokens)) == index.query(tokens)
    assert len(index.hash(tokens)) == index_bench.PROMPT_BLOCKS


@pytest.mark.parametrize("name", INDEXES)
def test_ingest_then_removal_leaves_nothing(name: str) -> None:
    cell = throughput(name, 2, TINY)
    assert cell["ingest"]["median"] > 0 and cell["removal"]["median"] > 0


def test_memory_is_measured_in_a_fresh_process() -> None:
    for traced in (False, True):  # enough blocks for the process's resident size to grow
        result = memory("ours", 1, 20_000, traced)
        assert result["bytes_per_block"] > 0


def test_quick_run_writes_its_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_bench, "QUICK", TINY)
    out = tmp_path / "index.json"
    assert index_bench.main(["--quick", "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert set(document["results"]) == {"1", "8"}
    for row in document["results"].values():
        assert set(row) == set(NAMES)
        assert row["ours"]["memory_traced"]["bytes_per_block"] > 0


def test_run_without_dynamo_reports_ours_only() -> None:
    results = run(TINY, ["ours"])
    assert all(set(row) == {"ours"} for row in results.values())
