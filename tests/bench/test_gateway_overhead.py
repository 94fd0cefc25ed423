"""Smoke test of ``bench.gateway_overhead``: today's one-model router, the same with keys,
two models, and the gateway of two models with keys, in front of real engine simulators and
a real conductor, a few prompts each, and a report with every figure and ratio."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gateway_overhead import PHASES, REFERENCE, VARIANTS
from tests.support.bench_run import run_bench


def test_every_router_is_measured_and_compared(tmp_path: Path) -> None:
    report_path = tmp_path / "gateway.json"
    flags = ["--requests", "8", "--prompt-tokens", "120", "--burst", "4", "--models", "2"]
    flags += ["--engines-per-model", "1", "--keys", "20", "--modes", "ids,local"]
    flags += ["--variants", ",".join(VARIANTS), "--json", str(report_path)]
    output = run_bench("bench.gateway_overhead", *flags, budget_s=150)
    report = json.loads(report_path.read_text())
    assert list(report["results"]) == ["ids", "local"]
    for mode, result in report["results"].items():
        assert set(result["ratio"]) == set(VARIANTS) - {REFERENCE}
        for phase in PHASES:
            for variant in VARIANTS:
                figures = result[variant][phase]
                assert figures["p50_ms"] > 0 and figures["client_p99_ms"] > 0, (mode, variant)
            assert result["ratio"]["gateway"][phase]["p99_ms"] > 0, (mode, phase)
    assert report["machine"]["cpus"] and set(report["goal"]) == {"ids", "local"}
    assert "| local | burst | gateway |" in output
