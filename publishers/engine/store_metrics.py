"""What the simulator's store tier reports on ``/metrics``.

vLLM's ``MooncakeStoreConnector`` exports one row per store call under
``vllm:mooncake_store_operation_*`` (operations ``lookup_exists``, ``load_get``,
``save_exists``, ``save_put``; status ``ok`` or ``error``): time, calls, keys, bytes and
failed keys. The simulator records its real store calls the same way, so whatever learns
from a real engine's store (the router's load bandwidth) learns from a simulated one too.
What only the simulator knows (verification, availability) is under ``sim_store_*``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

OPERATION_BUCKETS = (1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)


@dataclass(slots=True)
class StoreStats:
    """Cumulative counters only the simulator has (the ``sim_store_*`` metrics)."""

    loaded_blocks: int = 0
    saved_blocks: int = 0
    mismatched_blocks: int = 0  # loaded, but not the bytes ``kv_block`` makes: recomputed
    missing_blocks: int = 0  # there at the check, gone at the load: recomputed
    unavailable_calls: int = 0  # the master did not answer, or the tier was down
    up: bool = True


class StoreOperations:
    """vLLM's per-call store metrics; ``record`` is safe from the store's worker thread."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = labels
        names = [*labels, "operation", "status"]
        prefix = "vllm:mooncake_store_operation"
        self._time = Histogram(
            f"{prefix}_time_seconds", "Histogram of Mooncake store communication time.",
            names, buckets=OPERATION_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._calls = Counter(prefix, "Number of Mooncake store communication operations.",
                              names, registry=self.registry)  # fmt: skip
        self._keys = Counter(f"{prefix}_keys", "Number of Mooncake store keys touched by "
                             "operations.", names, registry=self.registry)  # fmt: skip
        self._bytes = Counter(f"{prefix}_bytes", "Number of bytes transferred by Mooncake "
                              "store operations.", names, registry=self.registry)  # fmt: skip
        self._failed = Counter(f"{prefix}_failed_keys", "Number of Mooncake store keys that "
                               "failed in operations.", names, registry=self.registry)  # fmt: skip

    def record(
        self,
        operation: str,
        seconds: float,
        keys: int,
        num_bytes: int = 0,
        failed_keys: int = 0,
        status: str = "ok",
    ) -> None:
        labels = {**self.labels, "operation": operation, "status": status}
        self._time.labels(**labels).observe(seconds)
        self._calls.labels(**labels).inc()
        self._keys.labels(**labels).inc(keys)
        self._bytes.labels(**labels).inc(num_bytes)
        self._failed.labels(**labels).inc(failed_keys)


class StoreCollector(Collector):
    """Both sets, read at scrape time (register it on the engine's registry)."""

    def __init__(self, operations: StoreOperations, stats: StoreStats) -> None:
        self._operations, self._stats = operations, stats

    def collect(self) -> Iterable[Metric]:
        yield from self._operations.registry.collect()
        stats, labels = self._stats, self._operations.labels
        up = GaugeMetricFamily("sim_store_up", "1 while the store's master answers",
                               labels=list(labels))  # fmt: skip
        up.add_metric(list(labels.values()), stats.up)
        yield up
        counters = (
            ("sim_store_loaded_blocks", "Blocks loaded from the store and verified",
             stats.loaded_blocks),
            ("sim_store_saved_blocks", "Blocks put to the store (and announced)",
             stats.saved_blocks),
            ("sim_store_mismatched_blocks", "Loaded blocks with the wrong bytes (recomputed)",
             stats.mismatched_blocks),
            ("sim_store_missing_blocks", "Blocks gone between check and load (recomputed)",
             stats.missing_blocks),
            ("sim_store_unavailable_calls", "Store calls skipped or failed: master down",
             stats.unavailable_calls),
        )  # fmt: skip
        for name, documentation, value in counters:
            family = CounterMetricFamily(name, documentation, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            yield family
