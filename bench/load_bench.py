"""The conductor under load: ``/query`` latency while many publishers stream events into it.

Two scenarios, each on a fresh ``python -m conductor`` subprocess driven over its real
interfaces (``bench.load_streams`` has the publishers, run in worker processes):

* ``paced``: 64 publishers send vLLM batches at a fixed aggregate rate (200,000 blocks/s by
  default) and evict as full caches do, while this process times a 4,096-token ``/query``
  (sequential keep-alive requests alternating JSON and msgpack with int32-packed tokens;
  msgpack ones, as the router's, ask for the instances with a hit alone).
  Reported: the ingest rate the conductor achieved, query percentiles (loaded, then idle
  for comparison), its loop lag, CPU seconds per 1,000 blocks ingested (from a window
  without queries), RSS.
* ``trace``: 1,000 publishers (1,000 ZMQ streams, each with a replay endpoint), carrying
  the conversation trace's requests at ``--speedup``; each request is also queried at its
  arrival, as a router would. Reported: registration time, idle cost of 1,000 streams,
  gaps and replays, the same latency, lag, CPU and memory figures.

Every run checks the conductor's counters against what was sent (events, blocks stored and
removed; no unrepaired gap, drop or decode error) and exits 1 if anything was lost.

    python -m bench.load_bench                       # both, ~3 min on 2 cores
    python -m bench.load_bench --scenario paced --py-spy bench/results   # with a profile
    python -m bench.load_bench --quick               # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgpack

from bench import pyspy
from bench.harness import (
    BenchError,
    CpuSample,
    Http,
    bucket_quantile,
    deadline_loop,
    latency_summary,
    machine,
    metric_sum,
    mib,
    register_all,
    rss_bytes,
    running_service,
    server_side,
    write_json,
)
from bench.load_streams import (
    BLOCK_SIZE,
    MODEL,
    StreamInfo,
    WorkerSpec,
    WorkerStats,
    prefix_holdings,
    query_prompt,
    worker_main,
)
from bench.soak import LAG_METRIC, lag_buckets, worst_bucket
from bench.trace_sim import load_trace, prompt_tokens, trace_path
from conductor.api import HITS_ONLY_HEADER
from conductor.hashing import token_bytes

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "load.json"
STREAMS_PER_WORKER = 250  # one worker thread keeps up with this many trace streams
JSON_TYPE, MSGPACK_TYPE = "application/json", "application/msgpack"
TARGETS = {
    "paced_ingest_blocks_per_s_min": 200_000,
    "paced_query_p99_ms_max": 2.0,
    "trace_query_p99_ms_max": 5.0,
}


# -- worker processes -------------------------------------------------------------------
def split(total: int, workers: int) -> list[tuple[int, int]]:
    """``(first stream, streams)`` per worker, as even as possible."""
    bounds = [total * w // workers for w in range(workers + 1)]
    return [(first, end - first) for first, end in zip(bounds, bounds[1:], strict=False)]


class Fleet:
    """The publisher workers; every wait is bounded and the processes die with the run."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        context = multiprocessing.get_context("spawn")  # no inherited ZMQ or HTTP state
        self.pipes: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self.streams: list[StreamInfo] = []
        for spec in specs:
            parent, child = context.Pipe()
            process = context.Process(target=worker_main, args=(spec, child), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)

    def wait_bound(self, timeout: float = 120.0) -> None:
        """Every worker built its workload and bound its streams."""
        for pipe in self.pipes:
            self.streams += receive(pipe, timeout, "a worker to bind its streams")

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes if process.pid is not None]

    def go(self, start: float) -> None:
        for pipe in self.pipes:
            pipe.send(("go", start))

    def stop(self, timeout: float = 60.0) -> WorkerStats:
        """What every worker sent, summed; a worker still sending stops there. The streams
        stay open (a closed one's blocks leave the index) until ``close``."""
        for pipe in self.pipes:
            pipe.send("stop")
        total = WorkerStats()
        for pipe in self.pipes:
            stats = receive(pipe, timeout, "a worker's stats")
            for item in fields(WorkerStats):
                pair = (getattr(total, item.name), getattr(stats, item.name))
                latest = item.name in ("lag_max_s", "sent_until_s")
                setattr(total, item.name, max(pair) if latest else sum(pair))
        return total

    def close(self) -> None:
        for pipe in self.pipes:
            with suppress(OSError):
                pipe.send("exit")
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)


def receive(pipe: Connection, timeout: float, what: str) -> Any:
    try:
        if pipe.poll(timeout):
            return pipe.recv()
    except EOFError:
        raise BenchError(f"a publisher worker exited while waiting for {what}") from None
    raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextmanager
def fleet(specs: list[WorkerSpec]) -> Iterator[Fleet]:
    publishers = Fleet(specs)
    try:
        publishers.wait_bound()
        yield publishers
    finally:
        publishers.close()


# -- measuring windows ------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """The conductor's counters and everyone's CPU at one moment."""

    at: float
    metrics: str
    scrape_s: float  # how long /metrics took: it grows with the number of streams
    conductor_cpu: float
    client_cpu: float
    machine: CpuSample

    @classmethod
    def take(cls, client: Http, conductor: int, clients: list[int]) -> Snapshot:
        started = time.perf_counter()
        text = client.metrics()
        scrape_s = time.perf_counter() - started
        return cls(
            time.monotonic(),
            text,
            scrape_s,
            CpuSample.take([conductor]).own,
            CpuSample.take(clients).own,
            CpuSample.take([conductor, *clients]),
        )

    def counter(self, name: str) -> float:
        return metric_sum(self.metrics, name)


COUNTERS = {
    "blocks_stored": "conductor_blocks_stored_total",
    "blocks_removed": "conductor_blocks_removed_total",
    "events": "conductor_events_applied_total",
    "batches": "conductor_batches_applied_total",
    "gaps": "conductor_sequence_gaps_total",
    "gaps_unrepaired": "conductor_sequence_gaps_unrepaired_total",
    "replays_requested": "conductor_replays_requested_total",
    "replays_failed": "conductor_replays_failed_total",
    "replayed_batches": "conductor_replayed_batches_applied_total",
    "dropped": "conductor_dropped_events_total",
    "orphaned": "conductor_orphaned_events_total",
    "decode_errors": "conductor_decode_errors_total",
    "disconnects": "conductor_publisher_disconnects_total",
}
MUST_BE_ZERO = ("gaps_unrepaired", "replays_failed", "dropped", "orphaned", "decode_errors")


FULL_GC = 'conductor_gc_pause_seconds_bucket{generation="2",'  # full collections


def histogram_delta(before: str, after: str, series: str = LAG_METRIC) -> list[tuple[float, float]]:
    """The loop-lag histogram's (or ``series``') cumulative buckets between two scrapes."""
    start = dict(lag_buckets(before, series))
    return [(le, count - start.get(le, 0.0)) for le, count in lag_buckets(after, series)]


def window(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    """What happened between two snapshots: rates, CPU, loop lag."""
    wall = max(after.at - before.at, 1e-9)
    delta = {key: after.counter(name) - before.counter(name) for key, name in COUNTERS.items()}
    conductor_s = after.conductor_cpu - before.conductor_cpu
    lag = histogram_delta(before.metrics, after.metrics)
    full_gc = histogram_delta(before.metrics, after.metrics, FULL_GC)
    load = after.machine.load_since(before.machine)
    blocks = delta["blocks_stored"]
    return {
        "seconds": wall,
        "counters": delta,
        "blocks_stored_per_s": blocks / wall,
        "blocks_removed_per_s": delta["blocks_removed"] / wall,
        "conductor_cores": conductor_s / wall,
        "conductor_cpu_ms_per_1k_blocks": 1e6 * conductor_s / blocks if blocks else math.nan,
        "client_cores": (after.client_cpu - before.client_cpu) / wall,
        "background_cores": load["other_cores"] + load["steal_cores"],
        "loop_lag_p99_ms": 1000 * bucket_quantile(lag, 0.99) if lag else math.nan,
        "loop_lag_worst_bucket_ms": 1000 * (worst_bucket(lag) or 0.0),
        "full_gcs": full_gc[-1][1] if full_gc else 0.0,
        "full_gc_worst_bucket_ms": 1000 * (worst_bucket(full_gc) or 0.0),
        "server_query": server_side(before.metrics, after.metrics),
        "metrics_scrape_ms": 1000 * after.scrape_s,
    }


def wait_applied(client: Http, sent: WorkerStats, timeout: float) -> float:
    """Seconds until the conductor applied every event sent (batches apply in order)."""
    started = time.monotonic()
    for _ in deadline_loop(timeout, f"{sent.events:,} events to be applied", 0.05):
        if metric_sum(client.metrics(), COUNTERS["events"]) >= sent.events:
            return time.monotonic() - started
    raise AssertionError("unreachable")


def verify(client: Http, sent: WorkerStats) -> dict[str, float]:
    """Everything sent is in the index, and nothing was dropped or left unrepaired."""
    text = client.metrics()
    seen = {key: metric_sum(text, name) for key, name in COUNTERS.items()}
    expected = {
        "events": sent.events,
        "blocks_stored": sent.blocks_stored,
        "blocks_removed": sent.blocks_removed,
    }
    problems = [f"{k}={seen[k]:,.0f} (sent {v:,})" for k, v in expected.items() if seen[k] != v]
    problems += [f"{k}={seen[k]:.0f}" for k in MUST_BE_ZERO if seen[k]]
    if problems:  # the usual cause: a stream dropped and read again from its replay buffer
        problems += [f"{k}={seen[k]:.0f}" for k in ("disconnects", "gaps", "replays_requested")]
        raise BenchError("the conductor lost or rejected events: " + ", ".join(problems))
    return seen


# -- queries ----------------------------------------------------------------------------
def json_query(tokens: list[int]) -> bytes:
    body = {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": tokens}
    return json.dumps(body, separators=(",", ":")).encode()


def msgpack_query(tokens: list[int]) -> bytes:
    """As the router sends it: msgpack, tokens packed as little-endian int32."""
    return msgpack.packb(
        {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": token_bytes(tokens)}
    )


# name -> (body encoder, content type, other headers): msgpack queries ask, as the router
# does, for the instances with a hit alone (JSON ones get the Go shape, every instance)
ENCODINGS = {
    "json": (json_query, JSON_TYPE, {}),
    "msgpack": (msgpack_query, MSGPACK_TYPE, {HITS_ONLY_HEADER: "1"}),
}


@dataclass(frozen=True)
class Query:
    due_s: float | None  # after the start; None: as soon as the previous one answered
    encoding: str
    body: bytes


def run_queries(
    client: Http, queries: Iterable[Query], start: float, until: float
) -> dict[str, Any]:
    """Sequential keep-alive ``/query``s at their due times until ``until`` (monotonic);
    the round trip of each, per encoding, and how late the client was at worst."""
    samples: dict[str, list[int]] = {name: [] for name in ENCODINGS}
    lag_max, errors, clock = 0.0, 0, time.perf_counter_ns
    began = time.perf_counter()
    for query in queries:
        now = time.monotonic()
        if now >= until:
            break
        if query.due_s is not None:
            wait = start + query.due_s - now
            time.sleep(max(0.0, wait))
            lag_max = max(lag_max, -wait)
        t0 = clock()
        _, content_type, headers = ENCODINGS[query.encoding]
        status, _ = client.raw("POST", "/query", query.body, content_type, headers)
        samples[query.encoding].append(clock() - t0)
        errors += status != 200
    elapsed = time.perf_counter() - began
    result: dict[str, Any] = {name: latency_summary(s, elapsed) for name, s in samples.items() if s}
    all_samples = [s for per in samples.values() for s in per]
    if all_samples:
        result["all"] = latency_summary(all_samples, elapsed)
    result["errors"] = errors
    result["client_lag_max_ms"] = 1000 * max(lag_max, 0.0)
    return result


def alternating(tokens: list[int], rate: float) -> Iterator[Query]:
    """The same prompt forever, JSON and msgpack in turn, ``rate`` a second (0: no pause)."""
    bodies = [(name, encode(tokens)) for name, (encode, _, _) in ENCODINGS.items()]
    number = 0
    while True:
        name, body = bodies[number % len(bodies)]
        yield Query(number / rate if rate else None, name, body)
        number += 1


def trace_queries(trace: str, speedup: float, every: int) -> Iterator[Query]:
    """Every ``every``-th trace request's prompt at its arrival, encodings in turn."""
    for number, request in enumerate(load_trace(trace_path(trace))[::every]):
        name = list(ENCODINGS)[number % len(ENCODINGS)]
        encode = ENCODINGS[name][0]
        yield Query(request.arrival_s / speedup, name, encode(prompt_tokens(request)))


def check_query_answer(client: Http, streams: list[StreamInfo]) -> None:
    """The paced scenario's query must find streams 0-7's prefixes, or its latency is moot."""
    status, data = client.raw("POST", "/query", json_query(query_prompt()), JSON_TYPE)
    if status != 200:
        raise BenchError(f"/query -> {status}: {data[:200]!r}")
    answer = json.loads(data).get("default", {})
    got = {name: hit["longest_matched"] for name, hit in answer.items()}
    expected = {s.instance_id: prefix_holdings(n) * BLOCK_SIZE for n, s in enumerate(streams)}
    if got != expected:
        raise BenchError(f"wrong /query answer: {got}")


# -- the scenarios ----------------------------------------------------------------------
def workers_for(publishers: int, requested: int | None) -> int:
    return requested or max(1, math.ceil(publishers / STREAMS_PER_WORKER))


@contextmanager
def profiled(directory: Path | None, pid: int, seconds: float, name: str) -> Iterator[dict]:
    """py-spy on ``pid`` while the body runs (when asked); its summary lands in the dict."""
    found: dict[str, Any] = {}
    if directory is None:
        yield found
        return
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"load_{name}_pyspy.txt"
    recorder = pyspy.record(pid, seconds, out)
    try:
        yield found
    finally:
        try:
            _, err = recorder.communicate(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            recorder.kill()
            _, err = recorder.communicate()
        if out.exists():
            found.update(pyspy.summarize(out), raw=str(out))
        else:
            found["error"] = err.decode(errors="replace")[-500:]


def registered(
    client: Http, process: subprocess.Popen[bytes], publishers: Fleet, timeout: float
) -> dict[str, Any]:
    """A scenario's first results: the empty service's RSS, then the time until every
    stream is registered and connected."""
    result: dict[str, Any] = {"rss_empty_bytes": rss_bytes(process.pid)}
    started = time.monotonic()
    register_all(client, publishers.streams, timeout=timeout)
    result["registration_s"] = time.monotonic() - started
    return result


def finished(
    client: Http,
    process: subprocess.Popen[bytes],
    publishers: Fleet,
    idle: Iterator[Query],
    idle_s: float,
) -> dict[str, Any]:
    """Stop the publishers, wait until every batch is applied and counted exactly, then
    time queries on the index with nothing else running."""
    sent = publishers.stop()
    result: dict[str, Any] = {
        "drain_s": wait_applied(client, sent, 120),
        "counters": verify(client, sent),
    }
    now = time.monotonic()
    result["idle_queries"] = run_queries(client, idle, now, now + idle_s)
    result.update(
        rss_bytes=rss_bytes(process.pid),
        sent=asdict(sent),
        index_blocks=client.json("GET", "/health")["blocks"],
    )
    return result


def paced(args: argparse.Namespace) -> dict[str, Any]:
    """64 publishers at a fixed rate; the 4,096-token query timed while they ingest."""
    duration = args.warmup_s + args.ingest_only_s + args.loaded_s
    workers = workers_for(args.publishers, args.workers)
    specs = [
        WorkerSpec(first, count, "paced", duration, {
            "rate_blocks_per_s": args.rate * count / args.publishers,
            "capacity_blocks": args.capacity_blocks,
        })
        for first, count in split(args.publishers, workers)
    ]  # fmt: skip
    with running_service() as (process, client), fleet(specs) as publishers:
        result = registered(client, process, publishers, timeout=60)
        clients = [os.getpid(), *publishers.pids]
        start = time.monotonic() + 0.2
        publishers.go(start)
        time.sleep(max(0.0, start + args.warmup_s - time.monotonic()))
        check_query_answer(client, publishers.streams)
        before = Snapshot.take(client, process.pid, clients)
        time.sleep(args.ingest_only_s)
        middle = Snapshot.take(client, process.pid, clients)
        with profiled(args.py_spy, process.pid, args.loaded_s, "paced") as profile:
            until = middle.at + args.loaded_s
            load = alternating(query_prompt(), args.query_rate)
            queries = run_queries(client, load, time.monotonic(), until)
        after = Snapshot.take(client, process.pid, clients)
        time.sleep(max(0.0, start + duration - time.monotonic()))
        result |= finished(client, process, publishers, alternating(query_prompt(), 0), args.idle_s)
        check_query_answer(client, publishers.streams)
        result.update(
            ingest_only=window(before, middle),
            loaded=window(middle, after),
            queries=queries,
            profile=profile,
        )
    return result


def trace(args: argparse.Namespace) -> dict[str, Any]:
    """1,000 streams carrying the trace; each request's prompt queried at its arrival."""
    last = load_trace(trace_path(args.trace))[-1].arrival_s
    duration = min(last, args.trace_seconds or last) / args.speedup
    workers = workers_for(args.trace_publishers, args.workers)
    options = {
        "instances": args.trace_publishers,
        "trace": args.trace,
        "speedup": args.speedup,
        "capacity_blocks": args.trace_capacity_blocks,
        "step_tokens": args.step_tokens,
    }
    specs = [
        WorkerSpec(first, count, "trace", duration, options)
        for first, count in split(args.trace_publishers, workers)
    ]
    with running_service() as (process, client), fleet(specs) as publishers:
        result = registered(client, process, publishers, timeout=300)
        result["rss_registered_bytes"] = rss_bytes(process.pid)
        clients = [os.getpid(), *publishers.pids]
        idle_before = Snapshot.take(client, process.pid, clients)
        time.sleep(args.idle_s)
        idle_after = Snapshot.take(client, process.pid, clients)
        start = time.monotonic() + 0.2
        publishers.go(start)
        before = Snapshot.take(client, process.pid, clients)
        with profiled(args.py_spy, process.pid, duration, "trace") as profile:
            queries = run_queries(
                client,
                trace_queries(args.trace, args.speedup, args.query_every),
                start,
                start + duration,
            )
        time.sleep(max(0.0, start + duration - time.monotonic()))
        after = Snapshot.take(client, process.pid, clients)
        idle = (replace(q, due_s=None) for q in trace_queries(args.trace, 1, args.query_every))
        result |= finished(client, process, publishers, idle, args.idle_s)
        result.update(
            idle=window(idle_before, idle_after),
            loaded=window(before, after),
            queries=queries,
            profile=profile,
            duration_s=duration,
        )
    return result


# -- output -----------------------------------------------------------------------------
def latency_line(label: str, summary: dict[str, Any]) -> str:
    return (
        f"  {label:<22} n={summary['requests']:<6} p50 {summary['p50_ms']:.3f}  "
        f"p90 {summary['p90_ms']:.3f}  p99 {summary['p99_ms']:.3f}  max {summary['max_ms']:.2f} ms"
    )


def print_window(label: str, w: dict[str, Any]) -> None:
    c = w["counters"]
    print(
        f"  {label}: {w['seconds']:.1f} s, {w['blocks_stored_per_s']:,.0f} blocks/s stored, "
        f"{w['blocks_removed_per_s']:,.0f} removed; conductor {w['conductor_cores']:.2f} cores "
        f"= {w['conductor_cpu_ms_per_1k_blocks']:.2f} CPU-ms / 1k blocks; clients "
        f"{w['client_cores']:.2f} cores; bg cpu {w['background_cores']:.2f}\n"
        f"    loop lag p99~ {w['loop_lag_p99_ms']:.1f} ms, worst bucket <= "
        f"{w['loop_lag_worst_bucket_ms']:.0f} ms; full GCs {w['full_gcs']:.0f} (worst <= "
        f"{w['full_gc_worst_bucket_ms']:.0f} ms); gaps {c['gaps']:.0f} (unrepaired "
        f"{c['gaps_unrepaired']:.0f}), replays {c['replays_requested']:.0f}; /metrics scrape "
        f"{w['metrics_scrape_ms']:.1f} ms"
    )


def print_queries(label: str, queries: dict[str, Any]) -> None:
    for name in ("json", "msgpack", "all"):
        if name in queries:
            print(latency_line(f"{label} {name}", queries[name]))
    print(f"    errors {queries['errors']}, client lag max {queries['client_lag_max_ms']:.1f} ms")


def print_profile(profile: dict[str, Any]) -> None:
    if "self_pct" not in profile:
        if profile:
            print(f"  py-spy failed: {profile.get('error')}")
        return
    print(f"  py-spy: {profile['samples']} samples of busy threads ({profile['raw']})")
    for (own, own_pct), (incl, incl_pct) in zip(
        profile["self_pct"][:12], profile["inclusive_pct"][:12], strict=False
    ):
        print(f"    self {own_pct:5.1f}% {own:<52} incl {incl_pct:5.1f}% {incl}")


def report_paced(result: dict[str, Any]) -> None:
    sent = result["sent"]
    print(f"\n== paced: {sent['blocks_stored']:,} blocks stored, {sent['batches']:,} batches")
    print(
        f"  registration {result['registration_s']:.2f} s; drain after the last send "
        f"{result['drain_s']:.2f} s; worker send lag max {1000 * sent['lag_max_s']:.1f} ms"
    )
    print_window("ingest only", result["ingest_only"])
    print_window("ingest + queries", result["loaded"])
    print_queries("loaded", result["queries"])
    print_queries("idle", result["idle_queries"])
    print(
        f"  RSS {mib(result['rss_bytes'])} MiB (empty {mib(result['rss_empty_bytes'])} MiB), "
        f"{result['index_blocks']:,} distinct blocks at the end"
    )
    print_profile(result["profile"])


def report_trace(result: dict[str, Any]) -> None:
    sent = result["sent"]
    print(
        f"\n== trace: {sent['blocks_stored']:,} blocks stored, {sent['blocks_removed']:,} "
        f"removed, {sent['batches']:,} batches in {result['duration_s']:.1f} s"
    )
    print(
        f"  registration of every stream until connected {result['registration_s']:.2f} s; "
        f"RSS {mib(result['rss_empty_bytes'])} MiB empty, "
        f"{mib(result['rss_registered_bytes'])} MiB registered; "
        f"drain {result['drain_s']:.2f} s; worker send lag max "
        f"{1000 * sent['lag_max_s']:.1f} ms; replays served {sent['replays_served']}"
    )
    print_window("idle, streams registered", result["idle"])
    print_window("trace", result["loaded"])
    print_queries("trace", result["queries"])
    print_queries("idle", result["idle_queries"])
    print(f"  RSS {mib(result['rss_bytes'])} MiB, {result['index_blocks']:,} distinct blocks")
    print_profile(result["profile"])


def p99(queries: dict[str, Any]) -> float:
    """Over every encoding; no answered query is a miss."""
    return queries.get("all", {}).get("p99_ms", math.inf)


def verdicts(results: dict[str, Any]) -> dict[str, bool]:
    checks = {}
    if "paced" in results:
        paced_result = results["paced"]
        checks["paced_ingest"] = (
            paced_result["loaded"]["blocks_stored_per_s"]
            >= TARGETS["paced_ingest_blocks_per_s_min"]
        )
        checks["paced_query_p99"] = (
            p99(paced_result["queries"]) <= TARGETS["paced_query_p99_ms_max"]
        )
    if "trace" in results:
        trace_result = results["trace"]
        checks["trace_no_unrepaired_gap"] = trace_result["counters"]["gaps_unrepaired"] == 0
        checks["trace_query_p99"] = (
            p99(trace_result["queries"]) <= TARGETS["trace_query_p99_ms_max"]
        )
    return checks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--scenario", choices=("paced", "trace", "both"), default="both")
    add("--quick", action="store_true", help="a smoke run: few publishers, seconds")
    add("--workers", type=int, help="publisher processes (default: one per 250 streams)")
    add("--idle-s", type=float, default=3.0, help="idle windows (queries / registered streams)")
    add("--py-spy", type=Path, metavar="DIR", help="profile the conductor under load into DIR")
    add("--json", type=Path, default=DEFAULT_JSON)
    paced_group = parser.add_argument_group("paced")
    paced_group.add_argument("--publishers", type=int, default=64)
    paced_group.add_argument("--rate", type=float, default=200_000, help="blocks/s, in total")
    paced_group.add_argument("--capacity-blocks", type=int, default=4096, help="per publisher")
    paced_group.add_argument("--warmup-s", type=float, default=3.0)
    paced_group.add_argument("--ingest-only-s", type=float, default=10.0)
    paced_group.add_argument("--loaded-s", type=float, default=30.0)
    paced_group.add_argument("--query-rate", type=float, default=200, help="per s; 0: no pause")
    trace_group = parser.add_argument_group("trace")
    trace_group.add_argument("--trace-publishers", type=int, default=1000)
    trace_group.add_argument("--trace", default="conversation", help="a name or a path")
    trace_group.add_argument("--speedup", type=float, default=60.0)
    trace_group.add_argument("--trace-seconds", type=float, help="replay only this much")
    trace_group.add_argument("--trace-capacity-blocks", type=int, default=4096)
    trace_group.add_argument("--step-tokens", type=int, default=2048, help="blocks per batch")
    trace_group.add_argument("--query-every", type=int, default=1, help="query every n-th")
    args = parser.parse_args(argv)
    if args.quick:
        args.publishers, args.rate, args.capacity_blocks = 4, 20_000, 1024
        args.warmup_s, args.ingest_only_s, args.loaded_s, args.idle_s = 1.0, 1.0, 2.0, 0.5
        args.trace_publishers, args.trace_seconds = 20, args.trace_seconds or 120.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[str, Any] = {
        "machine": machine(),
        "args": vars(args)
        | {"py_spy": str(args.py_spy) if args.py_spy else None, "json": str(args.json)},
    }
    print(f"conductor load benchmark: {results['machine']}")
    try:
        if args.scenario in ("paced", "both"):
            results["paced"] = paced(args)
            report_paced(results["paced"])
        if args.scenario in ("trace", "both"):
            results["trace"] = trace(args)
            report_trace(results["trace"])
    except (BenchError, OSError, http.client.HTTPException) as error:
        print(f"benchmark failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    results["pass"] = verdicts(results)
    results["targets"] = TARGETS
    print(
        "\n== targets: "
        + ", ".join(f"{name} {'PASS' if ok else 'MISS'}" for name, ok in results["pass"].items())
    )
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
