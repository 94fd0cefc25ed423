"""Smoke test of ``bench.limits_burst``: a router with a keys file in front of real engine
simulators, each phase a second long, the limited burst refused with ``Retry-After`` and the
unlimited one admitted whole, the steady key served throughout."""

from __future__ import annotations

import json
from pathlib import Path

from bench.limits_burst import PHASES
from tests.support.bench_run import run_bench


def test_every_phase_is_measured(tmp_path: Path) -> None:
    report_path = tmp_path / "burst.json"
    flags = ["--seconds", "1", "--warm-up-s", "0.5", "--rate", "5", "--factor", "4"]
    flags += ["--prompt-tokens", "100", "--time-scale", "0.05"]
    output = run_bench("bench.limits_burst", *flags, "--json", str(report_path), budget_s=90)
    report = json.loads(report_path.read_text())
    results = report["results"]
    for name in PHASES:
        steady = results[name]["steady"]
        assert (steady["sent"], steady["errors"]) == (5, 0), name
        assert steady["p99_ms"] > 0 and steady["engine_p50_ms"] > 0, name
    limited, unlimited = results["limited"]["burst"], results["unlimited"]["burst"]
    assert limited["rejected_429"] > 0 and limited["retry_after_missing"] == 0
    assert (unlimited["admitted"], unlimited["rejected_429"]) == (20, 0)
    assert report["goal"]["burst_within_its_rate"] and report["goal"]["every_429_has_retry_after"]
    assert results["unloaded-both"]["sent"] == 10
    assert "| unloaded-again |" in output
