"""``mooncake-demo`` runs the whole stack and shows the conductor paying off."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.processes import REPO


def test_demo_runs_and_conductor_guided_routing_hits_more():
    result = subprocess.run(
        [sys.executable, "-m", "publishers.demo", "--requests", "80", "--documents", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    hits = dict(
        re.findall(
            r"^\s+(round robin|conductor-guided)\s+prefix-cache hit\s+([\d.]+)%",
            result.stdout,
            re.MULTILINE,
        )
    )
    assert set(hits) == {"round robin", "conductor-guided"}, result.stdout
    assert float(hits["conductor-guided"]) > float(hits["round robin"])
    assert "context demo-model (block size 16)" in result.stdout
