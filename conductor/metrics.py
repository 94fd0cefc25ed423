"""Prometheus metrics of the service, on a registry of its own (one per app).

A scrape renders every series while the event loop waits, so series are kept few: no
``_created`` series beside each counter, one state series per stream, not one per state
(at 1,000 streams both together made a scrape several times slower), and the per-stream
series, most of a large fleet's, are plain counts rendered by ``stream_metrics`` (faster
again, to render and to count a batch). bench.load_bench reports a scrape's time at 1,000
streams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from .index import ApplyStats, PrefixCacheTable
from .loads import ReplicaLoads
from .routed import RoutedPrompts
from .states import StoreState, SubscriberState
from .stream_metrics import Family, StreamMetrics
from .wire.events import Tier

disable_created_metrics()  # type: ignore[no-untyped-call]  # process-wide: never read


class _IndexCollector(Collector):
    """Block counts per context and tier, read at scrape time (nothing on the hot path)."""

    def __init__(self, table: PrefixCacheTable) -> None:
        self._table = table

    def collect(self) -> Iterable[GaugeMetricFamily]:
        blocks = GaugeMetricFamily(
            "conductor_index_blocks",
            "Distinct prefix blocks indexed, per context and tier",
            labels=["tenant_id", "model", "lora_name", "block_size", "tier"],
        )
        contexts = GaugeMetricFamily("conductor_index_contexts", "Contexts in the index")
        views = self._table.context_views()
        for view in views:
            key = view.key
            for tier, count in zip(Tier, view.blocks, strict=True):
                labels = [key.tenant_id, key.model_name, key.lora_name, str(key.block_size)]
                blocks.add_metric([*labels, tier.name], count)
        contexts.add_metric([], len(views))
        yield blocks
        yield contexts


class RoutedCollector(Collector):
    """What router replicas report, read at scrape time: the routed prompts the query
    answers count (``conductor.routed``), those held and those the table's cap pushed out
    before their time; and how many replicas' loads count (``conductor.loads``)."""

    def __init__(self) -> None:
        self.routed: RoutedPrompts | None = None  # the API's tables, once it has them
        self.loads: ReplicaLoads | None = None

    def collect(self) -> Iterable[Metric]:
        routed, loads = self.routed, self.loads
        if routed is None or loads is None:
            return
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        for family, name, text, value in (
            (gauge, "conductor_routed_prompts", "Prompts routers reported routed, still "
             "counted", len(routed)),
            (counter, "conductor_routed_prompts_dropped", "Routed prompts forgotten before "
             "their time: the table was full", routed.dropped),
            (gauge, "conductor_router_replicas", "Router replicas whose load report still "
             "counts (POST /loads)", len(loads)),
            (counter, "conductor_replica_decision_waits", "Queries that waited for another "
             "router replica's decision on their model", loads.waits),
            (counter, "conductor_replica_decision_wait_timeouts", "Of those, the queries "
             "answered at the wait's bound without it", loads.wait_timeouts),
            (counter, "conductor_replica_decision_wait_seconds", "Time queries spent waiting "
             "for other router replicas' decisions", loads.wait_seconds),
        ):  # fmt: skip
            metric = family(name, text)
            metric.add_metric([], value)
            yield metric


STREAM_FAMILIES = (
    Family("batches", "conductor_batches_applied_total", "Event batches applied"),
    Family("events", "conductor_events_applied_total", "Events applied"),
    Family("blocks_stored", "conductor_blocks_stored_total", "Blocks indexed"),
    Family("blocks_removed", "conductor_blocks_removed_total", "Blocks removed"),
    Family("clears", "conductor_clears_total", "AllBlocksCleared events applied"),
    Family(
        "decode_errors",
        "conductor_decode_errors_total",
        "Frames, batches or events that could not be decoded (skipped)",
        "kind",
    ),
    Family(
        "orphaned",
        "conductor_orphaned_events_total",
        "Stored events whose parent block is unknown",
    ),
    Family("dropped", "conductor_dropped_events_total", "Events not indexed", "reason"),
    Family("ignored", "conductor_ignored_events_total", "Events of KV groups that hold no prefix"),
    Family("gaps", "conductor_sequence_gaps_total", "Sequence gaps detected"),
    Family(
        "gaps_unrepaired",
        "conductor_sequence_gaps_unrepaired_total",
        "Gaps a replay could not fill",
    ),
    Family("replays_requested", "conductor_replays_requested_total", "Replay requests sent"),
    Family("replays_failed", "conductor_replays_failed_total", "Replays that timed out or broke"),
    Family(
        "replayed_batches",
        "conductor_replayed_batches_applied_total",
        "Batches applied from replays",
    ),
    Family(
        "restarts",
        "conductor_publisher_restarts_total",
        "Publisher restarts (sequence went back)",
    ),
    Family(
        "publishers_lost",
        "conductor_publisher_disconnects_total",
        "Connections to a publisher lost (its blocks were cleared)",
    ),
)


class _Joined(Collector):
    """Several collectors as one, so that one registry reads every series."""

    def __init__(self, *parts: Collector) -> None:
        self._parts = parts

    def collect(self) -> Iterable[Metric]:
        for part in self._parts:
            yield from part.collect()


class ConductorMetrics:
    """Every counter the issue names; label ``stream`` is the service key."""

    def __init__(self, table: PrefixCacheTable) -> None:
        # where the service's metrics register: all but the per-stream series (``streams``)
        registry = self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("stream",)) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.stream_task_failures = counter(
            "conductor_stream_task_failures_total",
            "Failures of a stream's tasks (live reader, connection monitor, catch-up), "
            "each retried with backoff",
            ("task",),
        )
        self.streams = StreamMetrics(STREAM_FAMILIES, states=list(SubscriberState))
        self.query_seconds = Histogram(
            "conductor_query_seconds",
            "Time to answer a query inside the service",
            ["route"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1),
            registry=registry,
        )
        self.http_requests = counter(
            "conductor_http_requests_total", "HTTP requests answered", ("route", "status")
        )
        self.plain_queries = Counter(
            "conductor_plain_queries_total",
            "Queries answered from the index straight to their bytes, in C (conductor."
            "plain_query); the others of conductor_http_requests_total went the general way",
            registry=registry,
        )
        self.decoded_batches = Counter(
            "conductor_decoded_batches_total",
            "Event batches the C ingest lane left, from their first event or a later one, to "
            "Python's decoders (a pool's stream; LoRA, CPU or disk blocks; AllBlocksCleared; "
            "bytes hashes; a slot's first batch): see docs/operations.md",
            registry=registry,
        )
        self.services = Gauge(
            "conductor_registered_services", "Registered event streams", registry=registry
        )
        self.store_checks = counter(
            "conductor_kv_store_checks_total",
            "Key-list checks of each Mooncake store master, by outcome",
            ("kv_store", "outcome"),
        )
        self.store_check_seconds = Histogram(
            "conductor_kv_store_check_seconds",
            "Time one check takes: fetch every key of the store, parse, drop the evicted",
            ["kv_store"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.store_keys = Gauge(
            "conductor_kv_store_keys",
            "Keys the store held at its last answered check (unparsable: not a block's)",
            ["kv_store", "kind"],
            registry=registry,
        )
        self.store_blocks_dropped = counter(
            "conductor_kv_store_blocks_dropped_total",
            "Pool blocks dropped without an event: evicted (absent from the store's keys) "
            "or the store down",
            ("kv_store", "reason"),
        )
        self.store_state = Enum(
            "conductor_kv_store_state",
            "State of each store: down while its checks fail",
            ["kv_store"],
            states=[state.value for state in StoreState],
            registry=registry,
        )
        self.routed_reports = counter(
            "conductor_routed_reports_total",
            "POST /routed reports taken, by outcome: recorded, or no_block (a prompt shorter "
            "than a block: nothing to share)",
            ("outcome",),
        )
        self.routed_raised = Counter(
            "conductor_routed_raised_total",
            "Instances whose hit in a query's answer a routed prompt raised (sent there, "
            "its events not indexed yet)",
            registry=registry,
        )
        self._per_store = [
            self.store_checks,
            self.store_check_seconds,
            self.store_keys,
            self.store_blocks_dropped,
            self.store_state,
        ]
        registry.register(_IndexCollector(table))
        self.routed_prompts = RoutedCollector()
        registry.register(self.routed_prompts)
        # what counts outside the loop (conductor.query_thread), added in before a read
        self.gatherers: list[Callable[[], None]] = []
        self._every_series = CollectorRegistry(auto_describe=True)
        self._every_series.register(_Joined(registry, self.streams))

    def render(self) -> bytes:
        """What ``/metrics`` answers: the text format of every series."""
        self._gather()
        return generate_latest(self.registry) + self.streams.render().encode()

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of one series, per stream or not (None when it does not exist)."""
        self._gather()
        return self._every_series.get_sample_value(name, labels)

    def _gather(self) -> None:
        for gather in self.gatherers:
            gather()

    def set_subscriber_state(self, stream: str, state: SubscriberState) -> None:
        self.streams.set_state(stream, state.value)

    def record_apply(self, stream: str, stats: ApplyStats, replayed: bool) -> None:
        inc = self.streams.inc
        inc("batches", stream)
        if replayed:
            inc("replayed_batches", stream)
        inc("events", stream, stats.events)
        inc("blocks_stored", stream, stats.blocks_stored)
        inc("blocks_removed", stream, stats.blocks_removed)
        if stats.clears:
            inc("clears", stream, stats.clears)
        if stats.orphaned:
            inc("orphaned", stream, stats.orphaned)
        if stats.ignored:
            inc("ignored", stream, stats.ignored)
        for reason, count in stats.dropped.items():
            inc("dropped", stream, count, reason)

    def forget_stream(self, stream: str) -> None:
        """Drop a stream's series when it is unregistered (bounded cardinality)."""
        self.streams.forget(stream)

    def forget_store(self, kv_store: str) -> None:
        """Drop a store's label sets when no registration names it any more."""
        _forget(self._per_store, kv_store)


def _forget(metrics: Iterable[MetricWrapperBase], first_label: str) -> None:
    for metric in metrics:
        for labels in list(metric._metrics):  # noqa: SLF001 - no public enumeration
            if labels[0] == first_label:
                metric.remove(*labels)
