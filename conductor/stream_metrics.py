"""The per-stream series of ``/metrics``: plain counts, rendered straight to the text format.

With 1,000 registered streams these are ~9,000 of a scrape's series. prometheus-client
renders each through its generic path while the event loop waits, so a scrape stalled
queries (bench.load_bench reports a scrape's time at 1,000 streams); here a
stream's label text is escaped once and a series costs one format. The output is exactly
prometheus-client's (tests/conductor/test_stream_metrics.py compares them), and the
collector interface still serves ``registry.get_sample_value``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import cast

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

STATE_FAMILY = "conductor_subscriber_state"
_go_float = cast(Callable[[float], str], floatToGoString)  # how the library writes a value


@dataclass(frozen=True, slots=True)
class Family:
    """A counter keyed by stream, and by one more label when ``label`` is set."""

    key: str  # what the service calls it
    name: str  # the exposed name, ending in _total
    doc: str
    label: str = ""


class StreamMetrics(Collector):
    """Counters per stream, and each stream's subscriber state (one series, value 1)."""

    def __init__(self, families: Iterable[Family], states: Iterable[str]) -> None:
        self._families = {family.key: family for family in families}
        if any(family.label >= "stream" for family in self._families.values()):
            raise ValueError("a family's own label must sort before 'stream' (render order)")
        self._counts: dict[str, dict[tuple[str, str], float]] = {k: {} for k in self._families}
        self._states: dict[str, str] = {}
        self._state_doc = (
            "State of each stream's subscriber: 1 on the series of the state it is in "
            f"(states: {', '.join(states)})"
        )
        self._label_text: dict[str, str] = {}  # stream -> its escaped label value

    def inc(self, key: str, stream: str, amount: float = 1, label: str = "") -> None:
        counts = self._counts[key]
        series = (stream, label)
        counts[series] = counts.get(series, 0) + amount

    def set_state(self, stream: str, state: str) -> None:
        self._states[stream] = state

    def forget(self, stream: str) -> None:
        """Drop a stream's series (it was unregistered: bounded cardinality)."""
        for counts in self._counts.values():
            for key in [key for key in counts if key[0] == stream]:
                del counts[key]
        self._states.pop(stream, None)
        self._label_text.pop(stream, None)

    # -- exposition ----------------------------------------------------------------------
    def render(self) -> str:
        """The text format (0.0.4) of every series, as prometheus-client writes it."""
        lines: list[str] = []
        for key, family in self._families.items():
            name = family.name
            lines.append(_header(name, family.doc, "counter"))
            for (stream, label), value in self._counts[key].items():
                text = self._escaped(stream)
                labels = (
                    f'{family.label}="{_escape(label)}",stream="{text}"'
                    if family.label
                    else f'stream="{text}"'
                )
                lines.append(f"{name}{{{labels}}} {_go_float(value)}\n")
        lines.append(_header(STATE_FAMILY, self._state_doc, "gauge"))
        for stream, state in self._states.items():
            lines.append(
                f'{STATE_FAMILY}{{state="{_escape(state)}",stream="{self._escaped(stream)}"}} 1.0\n'
            )
        return "".join(lines)

    def collect(self) -> Iterator[Metric]:
        for key, family in self._families.items():
            labels = ["stream", family.label] if family.label else ["stream"]
            metric = CounterMetricFamily(family.name, family.doc, labels=labels)
            for (stream, label), value in self._counts[key].items():
                metric.add_metric([stream, label] if family.label else [stream], value)
            yield metric
        state = GaugeMetricFamily(STATE_FAMILY, self._state_doc, labels=["stream", "state"])
        for stream, current in self._states.items():
            state.add_metric([stream, current], 1)
        yield state

    def _escaped(self, stream: str) -> str:
        text = self._label_text.get(stream)
        if text is None:
            text = self._label_text[stream] = _escape(stream)
        return text


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _header(name: str, doc: str, kind: str) -> str:
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"
