"""Running a benchmark as a user does (``python -m bench.X``) within a time budget."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(module: str, *flags: str, budget_s: float) -> str:
    """``python -m module flags`` from the repository; its output. A bench over its budget
    is stopped with its whole process group (its services run in it) and the test fails;
    one that exits non-zero fails it too."""
    bench = subprocess.Popen(
        [sys.executable, "-m", module, *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its conductor, engines and routers share its process group
    )
    try:
        output, _ = bench.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(bench.pid, signal.SIGTERM)  # the bench stops every process it started
        output, _ = bench.communicate(timeout=15)
        pytest.fail(f"{module} took over {budget_s:.0f} s:\n{output[-3000:]}")
    assert bench.returncode == 0, output
    return output
