"""Smoke test of ``bench.gateway_overhead``: a one-model router and a gateway of two models
with client keys, in front of real engine simulators and a real conductor, a few prompts
each, and a report with every figure of both and their ratios."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gateway_overhead import VARIANTS
from tests.support.bench_run import run_bench


def test_both_routers_are_measured_and_compared(tmp_path: Path) -> None:
    report_path = tmp_path / "gateway.json"
    flags = ["--requests", "8", "--prompt-tokens", "120", "--burst", "4", "--models", "2"]
    flags += ["--engines-per-model", "1", "--keys", "20", "--modes", "ids,local"]
    output = run_bench("bench.gateway_overhead", *flags, "--json", str(report_path), budget_s=120)
    report = json.loads(report_path.read_text())
    assert list(report["results"]) == ["ids", "local"]
    for mode, result in report["results"].items():
        for phase in ("idle", "burst"):
            for variant in VARIANTS:
                figures = result[variant][phase]
                assert figures["p50_ms"] > 0 and figures["client_p99_ms"] > 0, (mode, phase)
            assert result["ratio"][phase]["p99_ms"] > 0, (mode, phase)
    assert report["machine"]["cpus"] and set(report["goal"]) == {"ids", "local"}
    assert "| local | burst |" in output
