"""Smoke test of the router replay: the whole stack as processes, a small slice, quickly.

The benchmark's numbers are only worth reading if every request made it through router,
conductor and engines, and if the figures it reports are well-formed; this runs
``--quick`` exactly as a user would and checks both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 60.0


def test_quick_replay_completes_without_errors(tmp_path: Path) -> None:
    report_path = tmp_path / "router_replay.json"
    replay = subprocess.Popen(
        [sys.executable, "bench/router_replay.py", "--quick", "--json", str(report_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its conductor, engines and router share its process group
    )
    try:
        output, _ = replay.communicate(timeout=BUDGET_S)
    except subprocess.TimeoutExpired:
        os.killpg(replay.pid, signal.SIGTERM)  # the bench stops every process it started
        output, _ = replay.communicate(timeout=15)
        pytest.fail(f"the quick replay took over {BUDGET_S:.0f} s:\n{output[-3000:]}")
    assert replay.returncode == 0, output

    report = json.loads(report_path.read_text())
    runs = report["runs"]
    assert list(runs) == report["setup"]["policies"] and len(runs) == 2
    for policy, run in runs.items():
        assert run["errors"] == 0, (policy, run["error_samples"])
        assert run["served"] + run["rejected"] == run["requests"] == report["setup"]["requests"]
        assert 0.0 <= run["hit_ratio"] <= 1.0, policy
        assert run["ttft_p50_s"] is not None and run["ttft_p50_s"] > 0, policy
        served = sum(entry["requests"] for entry in run["instances"].values())
        assert served == run["served"], policy  # every answer named a configured engine
