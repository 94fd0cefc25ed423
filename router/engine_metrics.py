"""Numbers the engines report, read line by line and checked where they enter.

An engine's ``/metrics`` text is parsed one line at a time: a line that does not parse, or
whose value is not finite, is skipped and counted, and the rest of the scrape still counts
(a whole-text parser would lose every number to one odd line). Every number the router
acts on passes ``in_range`` first: NaN, infinities, negatives and absurdly large values
would otherwise poison the load and cost estimates of every later request.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass

SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
# running + waiting requests, as each engine kind names them (an engine shows one pair)
IN_FLIGHT = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)
MAX_IN_FLIGHT = 1e6  # requests one engine may say it holds


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def in_range(value: float, high: float, low: float = 0.0) -> bool:
    """Finite and within ``low..high`` (an int of any size too)."""
    if isinstance(value, int):
        return low <= value <= high
    return math.isfinite(value) and low <= value <= high


def _labels(text: str | None) -> dict[str, str] | None:
    """``a="x",b="y"`` as a dict; None when it does not parse."""
    if not text or not text.strip():
        return {}
    labels, end = {}, 0
    for match in LABEL.finditer(text):
        if match.start() != end:
            return None
        labels[match.group(1)] = match.group(2)
        end = match.end()
    return labels if end == len(text) else None


def parse_metrics(text: str, wanted: Collection[str] | None = None) -> tuple[list[Sample], int]:
    """The samples of a Prometheus text and how many non-comment lines were skipped. With
    ``wanted``, only those metrics' labels and values are read (a scrape's other lines,
    most of them, are only checked for their shape): the router scrapes every engine
    every few seconds, and reading every label of every line was most of that work."""
    samples, skipped = [], 0
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = SAMPLE.match(line.strip())
        if match is None:
            skipped += 1
            continue
        if wanted is not None and match.group("name") not in wanted:
            continue
        labels = _labels(match.group("labels"))
        try:
            value = float(match.group("value"))
        except ValueError:
            value = math.nan
        if labels is None or not math.isfinite(value):
            skipped += 1
            continue
        samples.append(Sample(match.group("name"), labels, value))
    return samples, skipped


def engine_in_flight(samples: list[Sample]) -> tuple[int, int]:
    """Running + waiting requests (vLLM's or SGLang's ``IN_FLIGHT`` gauges), and how many
    of their values were out of range (ignored)."""
    total, rejected = 0.0, 0
    for sample in samples:
        if sample.name in IN_FLIGHT:
            if in_range(sample.value, MAX_IN_FLIGHT):
                total += sample.value
            else:
                rejected += 1
    return int(total), rejected
