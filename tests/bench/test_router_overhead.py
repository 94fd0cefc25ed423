"""Smoke test of ``bench.router_overhead``: every way of getting a prompt's ids through a
real router in front of real engine simulators, a few prompts each, and a report whose
figures are all there and positive."""

from __future__ import annotations

import json
from pathlib import Path

from bench.router_overhead import MODES
from tests.support.bench_run import run_bench


def test_every_mode_is_measured(tmp_path: Path) -> None:
    report_path = tmp_path / "overhead.json"
    flags = ["--requests", "8", "--prompt-tokens", "120", "--burst", "4", "--engines", "1"]
    output = run_bench("bench.router_overhead", *flags, "--json", str(report_path), budget_s=120.0)
    results = json.loads(report_path.read_text())["results"]
    assert list(results) == list(MODES)
    for mode, figures in results.items():
        for phase in ("idle", "burst"):
            assert figures[phase]["p50_ms"] > 0, (mode, phase)
    assert "| local-embedded |" in output
