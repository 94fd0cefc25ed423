"""Smoke test of ``bench.router_overhead``: every way of getting a prompt's ids through a
real router in front of real engine simulators, a few prompts each, and a report whose
figures are all there and positive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.router_overhead import MODES

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 120.0


def test_every_mode_is_measured(tmp_path: Path) -> None:
    report_path = tmp_path / "overhead.json"
    flags = ["--requests", "8", "--prompt-tokens", "120", "--burst", "4", "--engines", "1"]
    run = subprocess.Popen(
        [sys.executable, "-m", "bench.router_overhead", *flags, "--json", str(report_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its conductor, engines and routers share its process group
    )
    try:
        output, _ = run.communicate(timeout=BUDGET_S)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGTERM)
        output, _ = run.communicate(timeout=15)
        pytest.fail(f"the bench took over {BUDGET_S:.0f} s:\n{output[-3000:]}")
    assert run.returncode == 0, output
    results = json.loads(report_path.read_text())["results"]
    assert list(results) == list(MODES)
    for mode, figures in results.items():
        for phase in ("idle", "burst"):
            assert figures[phase]["p50_ms"] > 0, (mode, phase)
    assert "| local-embedded |" in output
