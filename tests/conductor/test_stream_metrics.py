"""The per-stream series are rendered by hand for speed: byte for byte what prometheus-client
writes for the same counters and gauge, and still readable through a registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from conductor.index import ApplyStats, PrefixCacheTable
from conductor.metrics import STREAM_FAMILIES, ConductorMetrics
from conductor.states import SubscriberState
from conductor.stream_metrics import STATE_FAMILY, Family, StreamMetrics

# stream keys as registrations make them, and ones that need every escape of the format
STREAMS = ["a|default|0", "b|tenant-x|3", 'quote"back\\slash\nnewline|t|0', "ünï|default|0"]


def _by_prometheus_client(
    counts: dict[str, dict[tuple[str, str], float]], states: dict[str, str]
) -> str:
    """The same values through prometheus-client's own metrics."""
    registry = CollectorRegistry()
    for family in STREAM_FAMILIES:
        labels = ["stream", family.label] if family.label else ["stream"]
        counter = Counter(family.name, family.doc, labels, registry=registry)
        for (stream, label), value in counts[family.key].items():
            counter.labels(*([stream, label] if family.label else [stream])).inc(value)
    gauge = Gauge(STATE_FAMILY, _state_doc(), ["stream", "state"], registry=registry)
    for stream, state in states.items():
        gauge.labels(stream, state).set(1)
    return generate_latest(registry).decode()


def _state_doc() -> str:
    states = ", ".join(SubscriberState)
    return (
        "State of each stream's subscriber: 1 on the series of the state it is in "
        f"(states: {states})"
    )


def test_render_equals_prometheus_client() -> None:
    metrics = ConductorMetrics(PrefixCacheTable())
    counts: dict[str, dict[tuple[str, str], float]] = {f.key: {} for f in STREAM_FAMILIES}
    states: dict[str, str] = {}
    for n, stream in enumerate(STREAMS):
        stats = ApplyStats(events=n, blocks_stored=10**n * 1_234_567, blocks_removed=0)
        stats.drop("block_size_mismatch")
        stats.drop('odd "reason"')
        metrics.record_apply(stream, stats, replayed=n % 2 == 1)
        metrics.streams.inc("gaps", stream, 2)
        metrics.streams.inc("decode_errors", stream, label="frame")
        metrics.set_subscriber_state(stream, SubscriberState.CONNECTING)
        metrics.set_subscriber_state(stream, list(SubscriberState)[n % len(SubscriberState)])
        for (key, label), value in [
            (("batches", ""), 1),
            (("events", ""), n),
            (("blocks_stored", ""), 10**n * 1_234_567),
            (("blocks_removed", ""), 0),
            (("dropped", "block_size_mismatch"), 1),
            (("dropped", 'odd "reason"'), 1),
            (("gaps", ""), 2),
            (("decode_errors", "frame"), 1),
        ] + ([(("replayed_batches", ""), 1)] if n % 2 == 1 else []):
            counts[key][(stream, label)] = value
        states[stream] = list(SubscriberState)[n % len(SubscriberState)].value
    ours = metrics.streams.render()
    assert sorted(ours.splitlines()) == sorted(_by_prometheus_client(counts, states).splitlines())
    assert ours.endswith("\n")
    # the whole scrape holds them once, beside the service's other series
    scrape = metrics.render().decode()
    assert scrape.count("# TYPE conductor_blocks_stored_total counter") == 1
    assert "# TYPE conductor_index_contexts gauge" in scrape


def test_series_are_readable_and_forgotten_with_their_stream() -> None:
    metrics = ConductorMetrics(PrefixCacheTable())
    metrics.record_apply("s", ApplyStats(events=3, blocks_stored=5), replayed=False)
    metrics.streams.inc("dropped", "s", 4, "instance_down")
    metrics.set_subscriber_state("s", SubscriberState.CONNECTED)
    assert metrics.sample("conductor_blocks_stored_total", {"stream": "s"}) == 5
    assert (
        metrics.sample("conductor_dropped_events_total", {"stream": "s", "reason": "instance_down"})
        == 4
    )
    assert metrics.sample(STATE_FAMILY, {"stream": "s", "state": "connected"}) == 1
    metrics.forget_stream("s")
    assert metrics.sample("conductor_blocks_stored_total", {"stream": "s"}) is None
    assert metrics.sample(STATE_FAMILY, {"stream": "s", "state": "connected"}) is None
    assert 'stream="s"' not in metrics.render().decode()


def test_a_label_sorting_after_stream_is_refused() -> None:
    """The text puts labels in name order; the renderer writes the family's label first."""
    with pytest.raises(ValueError, match="sort before"):
        StreamMetrics([Family("x", "x_total", "doc", "tier")], states=[])
