"""The benchmarks' statistics and process readings, one rule each, so figures compare.

* ``percentile``: linear interpolation between closest ranks (numpy's default,
  ``statistics.quantiles(method="inclusive")``). The trace simulator's figures are
  deterministic and were published with this rule; the latency benchmarks, which used
  nearest rank before, move by less than the gap between two neighbouring samples, far
  below their run-to-run noise.
* ``bucket_quantile``: Prometheus' ``histogram_quantile`` over a service's own histogram.
* ``rss_bytes``: a process's resident memory, from ``/proc`` (Linux).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (q in [0, 100]) of an ascending sequence; NaN when empty."""
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bucket_quantile(cumulative: Sequence[tuple[float, float]], q: float) -> float:
    """Prometheus' ``histogram_quantile`` (q in [0, 1]) over ``(le, cumulative count)``
    pairs in ascending order: linear interpolation inside the bucket that holds the rank."""
    if not cumulative or cumulative[-1][1] == 0:
        return math.nan
    rank = q * cumulative[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(
                count - lower_count, 1e-9
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def rss_bytes(pid: int) -> int:
    """VmRSS of a process: what it really keeps resident."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ProcessLookupError(f"no VmRSS for pid {pid}")
