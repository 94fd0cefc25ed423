"""The benchmarks' one percentile rule and the package's shape (no path edits, no circle)."""

from __future__ import annotations

import ast
import math
import statistics
from pathlib import Path

import pytest

from bench.harness import bucket_quantile, percentile

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_percentile_interpolates_between_closest_ranks_as_numpy_does() -> None:
    ordered = [1.0, 2.0, 4.0, 8.0, 16.0]
    assert percentile(ordered, 0) == 1.0
    assert percentile(ordered, 50) == 4.0
    assert percentile(ordered, 90) == pytest.approx(8.0 + 0.6 * 8.0)  # position 3.6
    assert percentile(ordered, 100) == 16.0
    assert math.isnan(percentile([], 50))
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    assert [percentile(ordered, q) for q in (25, 75, 99)] == pytest.approx(
        [cuts[24], cuts[74], cuts[98]]
    )


def test_bucket_quantile_is_prometheus_histogram_quantile() -> None:
    cumulative = [(0.001, 50.0), (0.01, 90.0), (0.1, 100.0), (math.inf, 100.0)]
    assert bucket_quantile(cumulative, 0.5) == pytest.approx(0.001)
    assert bucket_quantile(cumulative, 0.7) == pytest.approx(0.001 + 0.009 * 0.5)
    assert math.isnan(bucket_quantile([(0.1, 0.0)], 0.5))
    assert bucket_quantile([(0.1, 1.0), (math.inf, 10.0)], 0.99) == 0.1  # in +Inf: its floor


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_bench_is_a_package_without_path_edits_or_an_import_circle() -> None:
    assert (BENCH / "__init__.py").exists()
    for module in BENCH.glob("*.py"):
        assert "sys.path" not in module.read_text(), module.name
    assert "bench.trace_sim" in _imports(BENCH / "trace_report.py")
    assert "bench.trace_report" not in _imports(BENCH / "trace_sim.py")
