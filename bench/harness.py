"""What every benchmark shares: one rule for each figure, so figures compare.

* statistics: ``percentile`` (linear interpolation between closest ranks, numpy's default,
  ``statistics.quantiles(method="inclusive")``; the trace simulator's figures are
  deterministic and were published with this rule, and the latency benchmarks, which used
  nearest rank before, move by less than the gap between two neighbouring samples, far
  below their run-to-run noise), ``bucket_quantile`` (Prometheus' ``histogram_quantile``
  over a service's own histogram) and ``latency_summary``;
* the machine: ``machine`` (what ran the figures, and how busy it was), ``CpuSample`` (the
  cores other processes used during a measurement), ``rss_bytes`` and ``mib``;
* a conductor under test: ``running_service`` (an empty ``python -m conductor`` on a free
  port), ``Http`` (a keep-alive client), ``register_all``, and its own numbers read off
  ``/metrics`` (``metric_sum``, ``server_side``); ``deadline_loop`` bounds every wait and
  ``BenchError`` says the numbers would be meaningless;
* the workload shape the conductor benchmarks send: blocks of 16 tokens, 16-block events
  in batches of 20, a 4,096-token query prompt whose prefixes the first eight instances
  hold (``prefix_holdings``), and ``engine_hash``.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import platform
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zmq

from conductor.lane_http import LANE_ROUTES
from publishers.local import HOST, LocalService

BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16  # one event = one 256-token prompt, as a vLLM engine step stores it
EVENT_TOKENS = BLOCK_SIZE * BLOCKS_PER_EVENT
BATCH_EVENTS = 20
QUERY_BLOCKS = 256  # the 4,096-token prompt of the latency measurements
PUB_SNDHWM = 1_000_000  # far above what we queue: a PUB at its HWM drops silently
MASK64 = 0xFFFFFFFFFFFFFFFF
JSON_TYPE = "application/json"
SERVICE_START_S = 30.0  # a service's start-up, until its routes answer


# -- statistics -------------------------------------------------------------------------
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


def latency_summary(samples_ns: list[int], elapsed: float) -> dict[str, float]:
    ordered = sorted(samples_ns)
    ms = [s / 1e6 for s in ordered]
    return {
        "requests": len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": ms[-1],
        "mean_ms": sum(ms) / len(ms),
        "requests_per_s": len(ms) / elapsed,
    }


def mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


# -- the machine ------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """Where the figures come from, and how busy the machine was as they were written."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "zmq": zmq.zmq_version(),
        "pyzmq": zmq.__version__,
    }


# -- a conductor under test ------------------------------------------------------------
class Http:
    """A minimal keep-alive client: sequential requests, ``/query`` and ``/query_by_hash``
    on a TCP connection of their own, everything else on another.

    That is how a router holds its conductor connections (``router.conductor_client``):
    our service answers a connection that only queries in its query lane and hands any
    other to aiohttp for good (``conductor.query_lane``), so a shared connection would time
    aiohttp instead. Every service gets the same two connections.
    ``http.client`` adds little overhead of its own, so the latency measured is mostly the
    service's (plus loopback and the client's parsing).
    """

    QUERY_PATHS = frozenset({"/query", "/query_by_hash"})

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.port = port
        self.timeout = timeout
        self.queries = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.others = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = JSON_TYPE,
        extra_headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": content_type} if body is not None else {}
        headers |= extra_headers or {}
        conn = self.queries if path in LANE_ROUTES else self.others
        try:
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        except (http.client.HTTPException, OSError):
            conn.close()  # reconnect on the next call
            raise

    def json(self, method: str, path: str, payload: Any = None) -> Any:
        body = None if payload is None else json.dumps(payload).encode()
        status, data = self.raw(method, path, body)
        if status != 200:
            raise BenchError(f"{method} {path} -> {status}: {data[:300]!r}")
        return json.loads(data)

    def metrics(self) -> str:
        status, data = self.raw("GET", "/metrics")
        if status != 200:
            raise BenchError(f"/metrics -> {status}")
        return data.decode()

    def close(self) -> None:
        self.queries.close()
        self.others.close()


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSample:
    """Machine-wide and own CPU time, to tell how much else ran during a measurement.

    Loopback latency on a 2-core machine moves with whatever else runs there (test
    suites, other benchmarks), so every figure is reported with that background load.
    """

    wall: float
    busy: float  # seconds of CPU used by every process on the machine
    steal: float  # seconds the hypervisor gave our vCPUs to someone else
    own: float  # seconds used by this benchmark and the service

    @classmethod
    def take(cls, pids: Sequence[int]) -> CpuSample:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
        own = 0
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            own += int(stat[11]) + int(stat[12])  # utime + stime, all threads
        busy = user + nice + system + irq + softirq
        return cls(time.monotonic(), busy / CLOCK_TICKS, steal / CLOCK_TICKS, own / CLOCK_TICKS)

    def load_since(self, before: CpuSample) -> dict[str, float]:
        """Average cores used by other processes, and stolen, between two samples."""
        wall = max(self.wall - before.wall, 1e-9)
        others = (self.busy - before.busy) - (self.own - before.own)
        return {
            "other_cores": max(0.0, others / wall),
            "steal_cores": (self.steal - before.steal) / wall,
            "own_cores": (self.own - before.own) / wall,
        }


@contextmanager
def running_service() -> Iterator[tuple[subprocess.Popen, Http]]:
    """Start an empty service on a free port; always stop it on the way out."""
    with tempfile.TemporaryDirectory(prefix="conductor-bench-") as run_dir:
        config = Path(run_dir) / "conductor_config.json"
        config.write_text("{}")
        service = LocalService(Path(run_dir), "conductor", "conductor", "--config", str(config))
        try:
            try:
                service.wait_ready()
            except (RuntimeError, TimeoutError) as error:  # it exited, or never listened
                raise BenchError(str(error)) from None
            client = Http(service.port)  # after the wait: a taken port moves the service
            try:
                yield service.process, client
            finally:
                client.close()
        finally:
            service.stop()


def vllm_registration(endpoint: str, instance_id: str, model: str, **extra: Any) -> dict[str, Any]:
    """A ``/register`` body for a vLLM stream of ``BLOCK_SIZE``-token blocks at DP rank 0,
    with ``extra``'s fields (a replay endpoint, a hash profile)."""
    return {
        "endpoint": endpoint,
        "type": "vLLM",
        "modelname": model,
        "instance_id": instance_id,
        "block_size": BLOCK_SIZE,
        "dp_rank": 0,
        **extra,
    }


def write_json(path: Path, result: Any) -> None:
    """A benchmark's whole result as indented JSON (paths and the like as strings)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nJSON written to {path}")


def stop_group(process: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM to a process started in a session of its own, and to its group (a wrapper's
    children too); SIGKILL if it has not exited within ``timeout``."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout)


class BenchError(RuntimeError):
    """A wait timed out or the service lost data: the numbers would be meaningless."""


@dataclass
class ServiceProcess:
    """One service's process (its own session, so a wrapper's children stop with it)."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    name: str = "the service"

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        port: int,
        log_path: Path,
        cpus: str | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "the service",
    ) -> ServiceProcess:
        """``taskset -c CPUS`` execs the service, so the pid measured is the service's."""
        prefix = ["taskset", "-c", cpus] if cpus else []
        with log_path.open("wb") as log:  # the child keeps its own descriptor
            try:
                process = subprocess.Popen(
                    [*prefix, *command],
                    env={**os.environ, **(env or {})},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as error:
                raise BenchError(f"cannot start {name} {command[0]!r}: {error}") from None
        return cls(process, port, log_path, name)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(
        self,
        path: str,
        timeout: float = SERVICE_START_S,
        ready: Callable[[bytes], bool] = lambda body: True,
    ) -> None:
        """Until ``GET path`` answers 200 with a body ``ready`` accepts (an open port
        alone may precede the routes)."""
        url = f"http://{HOST}:{self.port}{path}"
        for _ in deadline_loop(timeout, f"{url} to answer", 0.05):
            if self.process.poll() is not None:
                raise BenchError(
                    f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200 and ready(response.read()):
                        return
            except (OSError, ValueError, urllib.error.URLError):
                pass

    def stop(self) -> None:
        stop_group(self.process)


def deadline_loop(timeout: float, what: str, interval: float = 0.002) -> Iterator[None]:
    """Yield until ``timeout`` seconds passed, sleeping ``interval`` between rounds.

    Every wait of the benchmark goes through here, so none can hang forever.
    """
    end = time.monotonic() + timeout
    while True:
        yield
        if time.monotonic() > end:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class Registrable(Protocol):
    """An event stream the benchmark registers: its instance and its ``/register`` body."""

    @property
    def instance_id(self) -> str: ...

    def registration(self) -> dict[str, Any]: ...


def register_all(client: Http, publishers: Sequence[Registrable], timeout: float = 20.0) -> None:
    """Register every publisher and wait until each SUB socket is connected.

    A PUB drops what it sends before the subscriber joined (ZMQ's slow joiner), so nothing
    may be published before ``/services`` says "connected".
    """
    for publisher in publishers:
        client.json("POST", "/register", publisher.registration())
    wanted = {p.instance_id for p in publishers}
    for _ in deadline_loop(timeout, "subscribers to connect", 0.01):
        services = client.json("GET", "/services")["services"]
        connected = {s["InstanceID"] for s in services if s.get("State") == "connected"}
        if wanted <= connected:
            break
    time.sleep(0.05)  # the subscription frame follows the TCP connect by a round trip


# -- reading the service's own numbers --------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metric_sum(text: str, name: str, label_filter: str = "") -> float:
    """Sum of every sample of ``name`` (over all streams) whose labels contain the filter."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name and label_filter in (match.group(2) or ""):
            total += float(match.group(3))
    return total


def query_histogram(text: str, route: str = "/query") -> dict[float, float]:
    """Cumulative bucket counts of ``conductor_query_seconds`` for one route."""
    buckets: dict[float, float] = {}
    pattern = re.compile(r'le="([^"]+)"')
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) != "conductor_query_seconds_bucket":
            continue
        labels = match.group(2) or ""
        if f'route="{route}"' in labels:
            le = pattern.search(labels)
            if le:
                buckets[float(le.group(1))] = float(match.group(3))
    return buckets


def server_side(before: str, after: str, route: str = "/query") -> dict[str, float]:
    """Mean and bucket-interpolated p50/p99 of the service's own timing, between scrapes.

    The buckets are coarse (0.1, 0.25, 0.5, 1, 2.5 ms...), so the percentiles are estimates;
    the mean (from _sum/_count) is exact.
    """
    label = f'route="{route}"'
    count = metric_sum(after, "conductor_query_seconds_count", label) - metric_sum(
        before, "conductor_query_seconds_count", label
    )
    seconds = metric_sum(after, "conductor_query_seconds_sum", label) - metric_sum(
        before, "conductor_query_seconds_sum", label
    )
    start, end = query_histogram(before, route), query_histogram(after, route)
    cumulative = sorted((le, end[le] - start.get(le, 0.0)) for le in end)
    result = {"count": count, "mean_ms": 1000 * seconds / count if count else math.nan}
    for q in (0.5, 0.99):
        result[f"p{round(q * 100)}_ms_est"] = 1000 * bucket_quantile(cumulative, q)
    return result


# -- the workload shape ----------------------------------------------------------------
def prefix_holdings(instance: int) -> int:
    """Blocks of the query prompt instance ``instance`` holds: 128, 112, ..., 16, then none.

    One instance has half the prompt, seven more have shorter shared prefixes (a common
    system prompt), the rest hold only unrelated prompts: the walk runs 129 blocks deep.
    """
    return max(0, QUERY_BLOCKS // 2 - 16 * instance) if instance < 8 else 0


def engine_hash(key: int) -> int:
    """A unique-looking uint64 per key: an odd multiplier is a bijection mod 2**64."""
    return (key * 0x9E3779B97F4A7C15) & MASK64
