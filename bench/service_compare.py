"""Our conductor service side by side with other KV-cache indexer services.

Every service (``bench.indexer_services``: ours, NVIDIA Dynamo's standalone indexer,
upstream Mooncake's C++ conductor when ``--cpp`` names its binary) is started empty on a
loopback port and fed the same vLLM 0.33 event batches, byte for byte, over ZMQ PUB sockets
that a publisher process owns (so sending never competes with the timing client for the
GIL). The batches carry vLLM's real ``sha256_cbor`` block hashes: the C++ conductor hashes a
query's tokens and looks those up; ours and Dynamo hash the events' tokens themselves.
Measured, each answer checked (the instances holding the prompt, and how many tokens):

1. ingest: blocks/s from the first send until the last batch of every stream is queryable,
   with 1 and with 8 streams (every batch's prompts are checked afterwards);
2. ``/query`` p50/p99 of a 4,096-token prompt (256 blocks) at 8 and 64 instances as the
   index grows to 100k and 1M blocks, in every query encoding a service speaks (ours:
   JSON and msgpack), and the 1-block query (the HTTP floor);
3. the same query while a paced publisher ingests 200k and 500k blocks/s (8 instances,
   from 1M blocks on), and how long the service took to catch up once it stopped;
4. resident memory per block (RSS delta over the registered, empty service / blocks).

The whole run happens inside a private network namespace: Dynamo and the C++ conductor
bind 0.0.0.0, so the module re-executes itself under ``unshare -n`` (root) with only its
loopback up; every service, publisher and the client share that 127.0.0.1.

Usage: ``python -m bench.service_compare [--quick] [--services ours,dynamo,cpp]
[--dynamo-threads N ...] [--cpp PATH] [--ours-cpus 0 | 0,1] [--ours-arg=--flag ...]
[--json PATH]``. A table of ratios (ours ÷ peer) ends the run; everything goes to JSON.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import zmq

from bench.conductor_bench import (
    SETUP_WINDOW_BATCHES,
    Publisher,
    TokenSource,
    batches,
    probe_tokens,
    query_prompt,
    stored_event,
    time_queries,
    warm_up,
)
from bench.conductor_peer import parse_env
from bench.harness import (
    BATCH_EVENTS,
    BLOCK_SIZE,
    BLOCKS_PER_EVENT,
    EVENT_TOKENS,
    QUERY_BLOCKS,
    BenchError,
    CpuSample,
    deadline_loop,
    latency_summary,
    machine,
    mib,
    prefix_holdings,
    write_json,
)
from bench.indexer_services import (
    HASH_ALGORITHM,
    HASH_SEED,
    Answer,
    Cpp,
    Dynamo,
    IndexerService,
    Ours,
    QueryMode,
    Stream,
    answer,
    dynamo_available,
    dynamo_python,
    in_private_netns,
    tree_rss_bytes,
)
from conductor.vllm_hash import block_keys
from conductor.wire.events import BlockStored
from publishers.encoding import encode_batch

BATCH_BLOCKS = BATCH_EVENTS * BLOCKS_PER_EVENT
NETNS_MARK = "SERVICE_COMPARE_HOST_NETNS"  # the host namespace, for the re-executed run
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "service-compare.json"
WAIT_S = 300.0


@dataclass(frozen=True)
class Scale:
    """Every size of one run; ``QUICK`` is a ~30-second smoke run of the same phases."""

    name: str
    ingest_events: int
    ingest_runs: int  # fresh service each; the median run is reported
    index_sizes: tuple[int, ...]  # blocks indexed per latency measurement, ascending
    instance_counts: tuple[int, ...]
    requests: int  # timed /query requests per cell and encoding, after warm-up
    warmup: int
    floor_requests: int
    rates: tuple[int, ...]  # blocks/s of the paced publisher
    paced_s: float  # how long each rate is held
    paced_instances: int


FULL = Scale("full", 20_000, 3, (100_000, 1_000_000), (8, 64), 3_000, 300, 1_000,
             (200_000, 500_000), 3.0, 8)  # fmt: skip
QUICK = Scale("quick", 2_000, 1, (10_000, 100_000), (8, 64), 300, 50, 100,
              (200_000, 500_000), 0.5, 8)  # fmt: skip


# -- the workload: vLLM's real block hashes ----------------------------------------------
def vllm_keys(tokens: list[int]) -> list[int]:
    """The event hashes vLLM gives ``tokens``' complete blocks (``sha256_cbor``, the chain
    the conductor hashes a profiled query with, in C: a 1M-block index is hashed once per
    run and every service gets the same batches)."""
    return list(block_keys(HASH_ALGORITHM, HASH_SEED, tokens, BLOCK_SIZE))


def one_event_batch(tokens: list[int], parent: int | None = None) -> bytes:
    """A batch of one root event of ``tokens`` with its real vLLM hashes."""
    event = stored_event(vllm_keys(tokens), tokens, parent)
    return encode_batch([event], time.time(), 0, "vllm")


@dataclass(frozen=True)
class Batch:
    """One encoded batch of fresh one-prompt events, and its first and last prompt."""

    payload: bytes
    first: list[int]
    last: list[int]


class BatchPool:
    """Every batch a run sends, made once: the same bytes go to every service."""

    def __init__(self, seed: int = 1) -> None:
        self.tokens = TokenSource(seed)
        self.batches: list[Batch] = []

    def ensure(self, count: int) -> None:
        while len(self.batches) < count:
            prompts = [self.tokens.prompt() for _ in range(BATCH_EVENTS)]
            events = [stored_event(vllm_keys(p), p, None) for p in prompts]
            payload = encode_batch(events, time.time(), 0, "vllm")
            self.batches.append(Batch(payload, prompts[0], prompts[-1]))

    @property
    def payloads(self) -> list[bytes]:
        return [batch.payload for batch in self.batches]


def prefix_payload(tokens: list[int], keys: list[int], blocks: int) -> tuple[bytes, int]:
    """An instance's share of the query prompt: chained 16-block events; (batch, events)."""
    events: list[BlockStored] = []
    for start in range(0, blocks, BLOCKS_PER_EVENT):
        chunk = tokens[start * BLOCK_SIZE : (start + BLOCKS_PER_EVENT) * BLOCK_SIZE]
        parent = keys[start - 1] if start else None
        events.append(stored_event(keys[start : start + BLOCKS_PER_EVENT], chunk, parent))
    return encode_batch(events, time.time(), 0, "vllm"), len(events)


def expected_answer(instances: int, blocks: int = QUERY_BLOCKS) -> Answer:
    """Instance ``n`` (id ``n + 1``) holds ``prefix_holdings(n)`` blocks of the prompt."""
    return {
        str(n + 1): min(prefix_holdings(n), blocks) * BLOCK_SIZE
        for n in range(instances)
        if prefix_holdings(n)
    }


# -- the publisher process --------------------------------------------------------------
Item = tuple[int, int]  # (stream position, batch index in the pool)


def _host_main(conn: Connection, count: int, payloads: list[bytes]) -> None:
    """The child: ``count`` PUB sockets; sends what the parent asks, replies when done."""
    context = zmq.Context()
    publishers = [Publisher(context, str(n + 1)) for n in range(count)]
    try:
        conn.send([p.endpoint for p in publishers])
        while True:
            command, arg = conn.recv()
            if command == "close":
                return
            if command == "bytes":
                for stream, data in arg:
                    publishers[stream].send(data)
                conn.send(time.perf_counter())
            elif command == "send":
                for stream, index in arg:
                    publishers[stream].send(payloads[index])
                conn.send(time.perf_counter())
            elif command == "pace":
                items, interval = arg
                conn.send(_paced(publishers, payloads, items, interval))
    finally:
        for publisher in publishers:
            publisher.close()
        context.term()


def _paced(
    publishers: list[Publisher], payloads: list[bytes], items: list[Item], interval: float
) -> dict[str, float]:
    """Batch ``i`` leaves at ``start + i * interval`` (late ones at once, never skipped)."""
    started = time.perf_counter()
    latest = 0.0
    for number, (stream, index) in enumerate(items):
        due = started + number * interval
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        else:
            latest = max(latest, now - due)
        publishers[stream].send(payloads[index])
    return {"start": started, "end": time.perf_counter(), "latest_s": latest}


class PublisherHost:
    """A publisher process with one PUB socket per stream (instance ``n + 1``)."""

    def __init__(self, count: int, payloads: list[bytes]) -> None:
        context = multiprocessing.get_context("fork")  # the payloads are inherited, not copied
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_host_main, args=(child, count, payloads))
        self.process.start()
        child.close()
        if not self.conn.poll(30):
            raise BenchError("the publisher process did not start")
        self.endpoints: list[str] = self.conn.recv()

    @property
    def pid(self) -> int:
        if self.process.pid is None:
            raise BenchError("the publisher process is not running")
        return self.process.pid

    def streams(self) -> list[Stream]:
        return [Stream(str(n + 1), endpoint) for n, endpoint in enumerate(self.endpoints)]

    def call(self, command: str, arg: Any) -> Any:
        self.conn.send((command, arg))
        return self.conn.recv()

    def send_probes(self, positions: Sequence[int]) -> None:
        self.call("bytes", [(n, one_event_batch(probe_tokens(n))) for n in positions])

    def close(self) -> None:
        try:
            self.conn.send(("close", None))
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@contextmanager
def running(service: IndexerService, streams: int, pool: BatchPool) -> Iterator[PublisherHost]:
    """The service, empty, and a publisher process; both always stopped on the way out."""
    with tempfile.TemporaryDirectory(prefix="service-compare-") as run_dir:
        try:
            service.start(Path(run_dir))  # inside: one that never got ready is stopped too
            host = PublisherHost(streams, pool.payloads)
            try:
                yield host
            finally:
                host.close()
        finally:
            service.stop()


def holds(service: IndexerService, instance_id: str, prompt: list[int]) -> bool:
    return answer(service, prompt).get(instance_id) == len(prompt)


def wait_applied(service: IndexerService, pool: BatchPool, items: Sequence[Item]) -> None:
    """Until each stream's last batch in ``items`` is queryable (streams apply in order)."""
    last = {stream: index for stream, index in items}
    pending = [(str(stream + 1), pool.batches[index].last) for stream, index in last.items()]
    for _ in deadline_loop_s(f"{service.name} to apply {len(items)} batches"):
        while pending and holds(service, *pending[-1]):
            pending.pop()
        if not pending:
            return


def deadline_loop_s(what: str, interval: float = 0.002) -> Iterator[None]:
    """Every wait of a phase: generous, since a service may fall far behind a burst."""
    return deadline_loop(WAIT_S, what, interval)


def round_robin(first: int, count: int, streams: int, offset: int = 0) -> list[Item]:
    """Batches ``first``.. assigned to streams in turn (``offset`` continues a turn)."""
    return [((offset + k) % streams, first + k) for k in range(count)]


def check(service: IndexerService, tokens: list[int], expected: Answer, mode: QueryMode) -> None:
    got = answer(service, tokens, mode)
    if got != expected:
        raise BenchError(f"{service.name} answered {mode.name} /query wrongly: {got}")


# -- 1. ingest --------------------------------------------------------------------------
def bench_ingest(
    service: IndexerService, pool: BatchPool, scale: Scale, streams: int
) -> dict[str, Any]:
    """Blocks/s from the first send until every stream's last batch is queryable."""
    count = scale.ingest_events // BATCH_EVENTS
    items = round_robin(0, count, streams)
    with running(service, streams, pool) as host:
        probes = service.register(host.streams(), host.send_probes)
        pids = [os.getpid(), host.pid, service.pid]
        cpu_before = CpuSample.take(pids)
        started = time.perf_counter()
        host.conn.send(("send", items))
        wait_applied(service, pool, items)
        elapsed = time.perf_counter() - started
        sent = host.conn.recv() - started
        load = CpuSample.take(pids).load_since(cpu_before)
        for stream, index in items:  # every batch, not only the last of each stream
            batch = pool.batches[index]
            for prompt in (batch.first, batch.last):
                if answer(service, prompt) != {str(stream + 1): EVENT_TOKENS}:
                    raise BenchError(f"{service.name}: batch {index} is not queryable")
        counters = service.counters(count * BATCH_BLOCKS, count * BATCH_EVENTS)
        rss = tree_rss_bytes(service.pid)
    return {
        "service": service.name,
        "streams": streams,
        "blocks": count * BATCH_BLOCKS,
        "batches": count,
        "probe_blocks": probes,
        "send_s": sent,
        "elapsed_s": elapsed,
        "blocks_per_s": count * BATCH_BLOCKS / elapsed,
        "load": load,
        "rss_after_bytes": rss,
        "counters": counters,
    }


def bench_ingest_runs(
    services: Sequence[IndexerService], pool: BatchPool, scale: Scale
) -> dict[str, dict[str, Any]]:
    """Runs interleaved across services so they share the machine's noise; medians."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(scale.ingest_runs):
        for streams in (1, 8):
            for service in services:
                run = bench_ingest(service, pool, scale, streams)
                runs.setdefault((service.name, streams), []).append(run)
                print_ingest(run)
    result: dict[str, dict[str, Any]] = {}
    for (name, streams), measured in runs.items():
        median = sorted(measured, key=lambda run: run["blocks_per_s"])[len(measured) // 2]
        result.setdefault(name, {})[f"streams_{streams}"] = {
            **median,
            "runs_blocks_per_s": [run["blocks_per_s"] for run in measured],
        }
    return result


# -- 2.-4. query latency, under load, memory --------------------------------------------
@dataclass
class Index:
    """A running service with ``instances`` streams and what it was told to hold."""

    service: IndexerService
    host: PublisherHost
    pool: BatchPool
    instances: int
    tokens: list[int]
    blocks: int = 0  # (instance, block) pairs stored, probes included
    events: int = 0
    next_batch: int = 0

    def load_prefixes(self) -> None:
        keys = vllm_keys(self.tokens)
        sends = []
        for n in range(self.instances):
            if prefix_holdings(n):
                payload, events = prefix_payload(self.tokens, keys, prefix_holdings(n))
                sends.append((n, payload))
                self.blocks += prefix_holdings(n)
                self.events += events
        self.host.call("bytes", sends)
        expected = expected_answer(self.instances)
        for _ in deadline_loop_s(f"{self.service.name} to index the query's prefixes", 0.01):
            if answer(self.service, self.tokens) == expected:
                return

    def grow_to(self, blocks: int) -> None:
        """Fresh batches round-robin over the streams, a window in flight at a time (so the
        memory figure is the index's, not a receive queue's)."""
        count = max(0, -(-(blocks - self.blocks) // BATCH_BLOCKS))
        items = self.take(count)
        windows = batches(items, SETUP_WINDOW_BATCHES)
        for number, window in enumerate(windows):
            self.host.call("send", list(window))
            if number:
                wait_applied(self.service, self.pool, windows[number - 1])
        if windows:
            wait_applied(self.service, self.pool, windows[-1])

    def take(self, count: int) -> list[Item]:
        items = round_robin(self.next_batch, count, self.instances, self.next_batch)
        self.next_batch += count
        self.blocks += count * BATCH_BLOCKS
        self.events += count * BATCH_EVENTS
        return items


def measure_cell(index: Index, scale: Scale) -> dict[str, Any]:
    """The 4,096-token query and the 1-block floor, in every encoding the service speaks."""
    service, tokens = index.service, index.tokens
    expected, floor_expected = expected_answer(index.instances), expected_answer(index.instances, 1)
    cell: dict[str, Any] = {"service": service.name, "instances": index.instances}
    pids = [os.getpid(), service.pid]
    for mode in service.modes:
        body = mode.body(tokens)
        check(service, tokens, expected, mode)
        warm_up(service.client, body, scale.warmup, mode.content_type)
        before = CpuSample.take(pids)
        timed = time_queries(service.client, body, scale.requests, mode.content_type)
        load = CpuSample.take(pids).load_since(before)
        check(service, tokens, expected, mode)
        floor_body = mode.body(tokens[:BLOCK_SIZE])
        check(service, tokens[:BLOCK_SIZE], floor_expected, mode)
        warm_up(service.client, floor_body, 50, mode.content_type)
        floor = time_queries(service.client, floor_body, scale.floor_requests, mode.content_type)
        cell[mode.name] = {**timed, "load": load, "floor_1_block": floor, "body_bytes": len(body)}
    cell["counters"] = service.counters(index.blocks, index.events)
    cell["blocks"] = index.blocks
    cell["rss_bytes"] = tree_rss_bytes(service.pid)
    return cell


def measure_loaded(index: Index, scale: Scale, rate: int) -> dict[str, Any]:
    """Queries (every encoding in turn, each answer checked) while the publisher process
    sends ``rate`` blocks/s for ``paced_s``; then how long until the service caught up."""
    service, tokens = index.service, index.tokens
    expected = expected_answer(index.instances)
    blocks_before = index.blocks
    count = max(1, round(rate * scale.paced_s / BATCH_BLOCKS))
    items = index.take(count)
    bodies = [(mode, mode.body(tokens)) for mode in service.modes]
    samples: dict[str, list[int]] = {mode.name: [] for mode in service.modes}
    clock = time.perf_counter_ns
    index.host.conn.send(("pace", (items, BATCH_BLOCKS / rate)))
    started = time.perf_counter()
    turn = 0
    while not index.host.conn.poll():
        mode, body = bodies[turn % len(bodies)]
        turn += 1
        t0 = clock()
        status, data = service.client.raw("POST", "/query", body, mode.content_type)
        samples[mode.name].append(clock() - t0)
        if status != 200 or mode.parse(data) != expected:
            raise BenchError(f"{service.name} answered wrongly under load: {status} {data[:200]!r}")
    paced = index.host.conn.recv()
    querying = time.perf_counter() - started
    wait_applied(service, index.pool, items)
    caught_up = time.perf_counter()
    sent_s = paced["end"] - paced["start"]
    result: dict[str, Any] = {
        "service": service.name,
        "instances": index.instances,
        "rate_blocks_per_s": rate,
        "blocks_before": blocks_before,
        "blocks_sent": count * BATCH_BLOCKS,
        "sent_blocks_per_s": count * BATCH_BLOCKS / sent_s,
        "publisher_latest_s": paced["latest_s"],
        "applied_blocks_per_s": count * BATCH_BLOCKS / (caught_up - paced["start"]),
        "catch_up_s": caught_up - paced["end"],
    }
    for name, taken in samples.items():
        if not taken:
            raise BenchError(f"no {name} query completed while ingesting at {rate:,} blocks/s")
        result[name] = latency_summary(taken, querying)
    result["counters"] = service.counters(index.blocks, index.events)
    result["rss_bytes"] = tree_rss_bytes(service.pid)
    return result


def bench_grid(
    service: IndexerService, pool: BatchPool, scale: Scale, instances: int
) -> dict[str, Any]:
    """One service, ``instances`` streams, the index grown through every size; with
    ``paced_instances`` streams the paced phases follow at the largest size."""
    with running(service, instances, pool) as host:
        rss_empty = tree_rss_bytes(service.pid)
        index = Index(service, host, pool, instances, query_prompt())
        index.blocks = service.register(host.streams(), host.send_probes)
        index.events = index.blocks
        rss_registered = tree_rss_bytes(service.pid)
        index.load_prefixes()
        cells = []
        for size in scale.index_sizes:
            started = time.perf_counter()
            index.grow_to(size)
            cell = measure_cell(index, scale)
            cell["build_s"] = time.perf_counter() - started
            cell["bytes_per_block"] = (cell["rss_bytes"] - rss_registered) / cell["blocks"]
            print_cell(cell)
            cells.append(cell)
        loaded = []
        if instances == scale.paced_instances:
            for rate in scale.rates:
                measured = measure_loaded(index, scale, rate)
                print_loaded(measured)
                loaded.append(measured)
    return {
        "service": service.name,
        "instances": instances,
        "rss_empty_bytes": rss_empty,
        "rss_registered_bytes": rss_registered,
        "cells": cells,
        "loaded": loaded,
    }


# -- output -----------------------------------------------------------------------------
def print_ingest(run: dict[str, Any]) -> None:
    print(
        f"  ingest {run['service']:<10} {run['streams']} stream(s): {run['blocks']:,} blocks in "
        f"{run['elapsed_s']:.3f} s = {run['blocks_per_s']:>10,.0f} blocks/s "
        f"(sent in {run['send_s']:.3f} s; RSS after {mib(run['rss_after_bytes'])} MiB; "
        f"bg cpu {run['load']['other_cores']:.2f})",
        flush=True,
    )


def print_cell(cell: dict[str, Any]) -> None:
    for mode in ("json", "msgpack"):
        if mode not in cell:
            continue
        q, f = cell[mode], cell[mode]["floor_1_block"]
        print(
            f"  {cell['service']:<10} {mode:<7} {cell['instances']:>4} {cell['blocks']:>9,} "
            f"{q['p50_ms']:>7.3f} {q['p99_ms']:>7.3f} {q['max_ms']:>7.2f} "
            f"{f['p50_ms']:>9.3f} {mib(cell['rss_bytes']):>8} {cell['bytes_per_block']:>6.0f} "
            f"{cell['build_s']:>7.1f} {q['load']['other_cores'] + q['load']['steal_cores']:>6.2f}",
            flush=True,
        )


def print_loaded(result: dict[str, Any]) -> None:
    for mode in ("json", "msgpack"):
        if mode not in result:
            continue
        q = result[mode]
        print(
            f"  {result['service']:<10} {mode:<7} at {result['rate_blocks_per_s']:>7,} blocks/s "
            f"(sent {result['sent_blocks_per_s']:>9,.0f}, applied "
            f"{result['applied_blocks_per_s']:>9,.0f}, caught up {result['catch_up_s']:.2f} s "
            f"after; from {result['blocks_before']:,} blocks): {q['requests']} queries "
            f"p50 {q['p50_ms']:.3f} p99 {q['p99_ms']:.3f} max {q['max_ms']:.2f} ms",
            flush=True,
        )


Row = tuple[str, float, float, str]  # metric, ours, peer, which way is better


def ratio_rows(ours: dict[str, Any], peer: dict[str, Any]) -> list[Row]:
    """Every figure both measured: ingest, latency per cell, the floor, loaded, memory.

    Ours is compared in each encoding it speaks with the peer's first (its only) one.
    """
    rows: list[Row] = []
    for key in ("streams_1", "streams_8"):
        if key in ours["ingest"] and key in peer["ingest"]:
            rows.append((f"ingest {key.replace('_', ' ')} blocks/s",
                         ours["ingest"][key]["blocks_per_s"],
                         peer["ingest"][key]["blocks_per_s"], "higher"))  # fmt: skip
    peer_mode = peer["modes"][0]
    for ours_grid, peer_grid in zip(ours["grid"], peer["grid"], strict=True):
        for a, b in zip(ours_grid["cells"], peer_grid["cells"], strict=True):
            where = f"{a['instances']} inst {a['blocks']:,} blk"
            for mode in ours["modes"]:
                for stat in ("p50_ms", "p99_ms"):
                    rows.append((f"/query {where} {mode} {stat[:3]} ms", a[mode][stat],
                                 b[peer_mode][stat], "lower"))  # fmt: skip
            for mode in ours["modes"]:
                rows.append((f"1-block floor {where} {mode} p50 ms",
                             a[mode]["floor_1_block"]["p50_ms"],
                             b[peer_mode]["floor_1_block"]["p50_ms"], "lower"))  # fmt: skip
        for a, b in zip(ours_grid["loaded"], peer_grid["loaded"], strict=True):
            where = f"at {a['rate_blocks_per_s']:,} blk/s"
            for mode in ours["modes"]:
                for stat in ("p50_ms", "p99_ms"):
                    rows.append((f"/query {where} {mode} {stat[:3]} ms", a[mode][stat],
                                 b[peer_mode][stat], "lower"))  # fmt: skip
            rows.append((f"applied {where} blocks/s", a["applied_blocks_per_s"],
                         b["applied_blocks_per_s"], "higher"))  # fmt: skip
        if ours_grid["cells"]:
            a, b = ours_grid["cells"][-1], peer_grid["cells"][-1]
            rows.append((f"bytes/block {a['instances']} inst {a['blocks']:,} blk",
                         a["bytes_per_block"], b["bytes_per_block"], "lower"))  # fmt: skip
    return rows


def print_ratios(peer: str, rows: list[Row]) -> None:
    print(f"\n== ours ÷ {peer}")
    print(f"  {'metric':<52} {'ours':>13} {peer:>13} {'ratio':>6}  better")
    for metric, a, b, better in rows:
        ratio = a / b if b else float("nan")
        print(f"  {metric:<52} {a:>13,.3f} {b:>13,.3f} {ratio:>6.2f}  {better}")


NOISY_CORES = 0.25


def warn_if_noisy(result: dict[str, Any]) -> None:
    """Latency on a shared 2-core box compares only when nothing else ran (``bg cpu``)."""
    loads = []
    for service in result["services"].values():
        loads += [run["load"] for run in service.get("ingest", {}).values()]
        for grid in service["grid"]:
            loads += [cell[m]["load"] for cell in grid["cells"] for m in service["modes"]]
    worst = max((load["other_cores"] + load["steal_cores"] for load in loads), default=0.0)
    if worst > NOISY_CORES:
        print(
            f"\n  note: other processes used up to {worst:.2f} cores during a measurement; "
            "rerun on a quiet machine before comparing numbers"
        )


# -- the run ----------------------------------------------------------------------------
def needed_batches(scale: Scale) -> int:
    grid = -(-max(scale.index_sizes) // BATCH_BLOCKS) + 1
    paced = sum(max(1, round(r * scale.paced_s / BATCH_BLOCKS)) for r in scale.rates)
    return max(scale.ingest_events // BATCH_EVENTS, grid + paced)


def run(scale: Scale, services: Sequence[IndexerService]) -> dict[str, Any]:
    pool = BatchPool()
    started = time.perf_counter()
    pool.ensure(needed_batches(scale))
    print(
        f"  {len(pool.batches):,} batches ({len(pool.batches) * BATCH_BLOCKS:,} blocks) "
        f"hashed and encoded in {time.perf_counter() - started:.1f} s",
        flush=True,
    )
    result: dict[str, Any] = {"scale": asdict(scale), "machine": machine(), "services": {}}
    for service in services:
        result["services"][service.name] = {
            "modes": [mode.name for mode in service.modes],
            "grid": [],
            **service.describe(),
        }
    print("\n== ingest (20 events of 16 blocks per batch, unpaced, every batch checked)")
    for name, ingest in bench_ingest_runs(services, pool, scale).items():
        result["services"][name]["ingest"] = ingest
    print("\n== /query of a 4,096-token prompt (256 blocks), sequential keep-alive, ms")
    print(
        f"  {'service':<10} {'enc':<7} {'inst':>4} {'blocks':>9} {'p50':>7} {'p99':>7} "
        f"{'max':>7} {'1-blk p50':>9} {'RSS MiB':>8} {'B/blk':>6} {'build s':>7} {'bg cpu':>6}"
    )
    for instances in scale.instance_counts:
        for service in services:
            grid = bench_grid(service, pool, scale, instances)
            result["services"][service.name]["grid"].append(grid)
    ours = result["services"].get("ours")
    result["ratios"] = {}
    for name, peer in result["services"].items():
        if ours is not None and name != "ours":
            rows = ratio_rows(ours, peer)
            result["ratios"][name] = [
                {"metric": m, "ours": a, "peer": b, "ratio": a / b if b else None, "better": w}
                for m, a, b, w in rows
            ]
            print_ratios(name, rows)
    warn_if_noisy(result)
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~30-second smoke run")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    parser.add_argument(
        "--services",
        default="ours,dynamo,cpp",
        help="comma-separated: ours, dynamo, cpp (default all; cpp needs --cpp)",
    )
    parser.add_argument(
        "--dynamo-threads", type=int, action="append", help="Dynamo's --threads (repeatable; 2)"
    )
    parser.add_argument(
        "--dynamo-python", default=None, help="an interpreter with ai-dynamo-runtime installed"
    )
    parser.add_argument("--cpp", type=Path, help="upstream Mooncake's C++ conductor binary")
    parser.add_argument("--ours-cpus", help="pin ours with taskset -c (e.g. 0 or 0,1)")
    parser.add_argument(
        "--ours-profile", action="store_true",
        help="register ours with the C++ service's hash profile (vLLM's sha256_cbor keys)",
    )  # fmt: skip
    parser.add_argument("--peer-cpus", help="pin every peer with taskset -c")
    parser.add_argument(
        "--ours-arg", action="append", default=[], help="an extra flag for ours (repeatable)"
    )
    parser.add_argument(
        "--ours-env", action="append", default=[], metavar="KEY=VALUE",
        help="an extra environment variable for ours (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        args.ours_env = parse_env(args.ours_env, "--ours-env")
    except ValueError as error:
        parser.error(str(error))
    return args


def build_services(args: argparse.Namespace) -> list[IndexerService]:
    """The services asked for; a peer that cannot run is skipped with a line saying why."""
    wanted = {name.strip() for name in args.services.split(",") if name.strip()}
    unknown = wanted - {"ours", "dynamo", "cpp"}
    if unknown:
        raise SystemExit(f"unknown services: {', '.join(sorted(unknown))}")
    services: list[IndexerService] = []
    if "ours" in wanted:
        ours = Ours(args.ours_cpus, tuple(args.ours_arg), args.ours_env, args.ours_profile)
        services.append(ours)
    if "dynamo" in wanted:
        python = args.dynamo_python or dynamo_python()
        why = dynamo_available(python)
        if why:
            print(f"skipping Dynamo: {why}")
        else:
            for threads in args.dynamo_threads or [2]:
                services.append(Dynamo(threads, python, args.peer_cpus))
    if "cpp" in wanted:
        if args.cpp is None:
            print("skipping upstream C++: no --cpp PATH given")
        elif not os.access(args.cpp, os.X_OK):
            print(f"skipping upstream C++: {args.cpp} is not an executable")
        else:
            services.append(Cpp(args.cpp, args.peer_cpus))
    return services


def reexec_in_netns(argv: list[str]) -> None:
    """Run this module again in a new network namespace with only ``lo`` (up): peers that
    bind 0.0.0.0 are then reachable from nowhere but this benchmark."""
    if os.environ.get(NETNS_MARK):
        raise SystemExit("still in the host's network namespace after unshare -n: refusing")
    os.environ[NETNS_MARK] = os.readlink("/proc/self/ns/net")  # the host's, to compare with
    command = [sys.executable, "-m", "bench.service_compare", *argv]
    script = 'ip link set lo up && exec "$@"'
    try:
        os.execvp("unshare", ["unshare", "-n", "--", "sh", "-c", script, "sh", *command])
    except OSError as error:
        raise SystemExit(f"cannot run unshare -n (root needed): {error}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not in_private_netns(os.environ.get(NETNS_MARK)):
        reexec_in_netns(argv)
    scale = QUICK if args.quick else FULL
    print(f"service comparison ({scale.name}), in a private network namespace: {machine()}")
    services = build_services(args)
    if not services:
        print("nothing to measure", file=sys.stderr)
        return 1
    try:
        result = run(scale, services)
    except (BenchError, OSError, http.client.HTTPException) as error:
        print(f"benchmark failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    result["options"] = vars(args)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
