"""Benchmark of the conductor service over its real interfaces.

The service runs as a subprocess (``python -m conductor``) and is driven exactly as in
production: raw pyzmq PUB sockets publish vLLM 0.33 event batches and
a keep-alive HTTP client asks ``/query``. Measured:

1. ingest throughput: blocks/s and events/s from the first send until the last event's
   prompt is queryable;
2. ``/query`` latency of a 4,096-token prompt against 8 and 64 instances at growing index
   sizes (client-side percentiles, plus the service's own ``conductor_query_seconds``);
3. resident memory per indexed block.

With ``--peer COMMAND`` the same phases also run against another conductor that speaks the
Go service's API (``bench.conductor_peer``), fed vLLM <= 0.23 array events, the layout the Go
decoder reads; our service's ingest is then measured with those events too, and the run
ends with a side-by-side table of ratios (``bench.conductor_compare``).

Usage: ``python -m bench.conductor_bench [--quick] [--json PATH] [--peer COMMAND
[--peer-env KEY=VALUE ...]]``. ``--quick`` scales every size down ~10x for a smoke check. A
readable table goes to stdout, everything to JSON.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import shlex
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.conductor_compare import compare, print_comparison
from bench.conductor_peer import PeerError, PeerSpec, parse_env, running_peer
from bench.harness import (
    BATCH_EVENTS,
    BLOCK_SIZE,
    BLOCKS_PER_EVENT,
    EVENT_TOKENS,
    JSON_TYPE,
    MASK64,
    PUB_SNDHWM,
    QUERY_BLOCKS,
    BenchError,
    CpuSample,
    Http,
    deadline_loop,
    engine_hash,
    latency_summary,
    machine,
    metric_sum,
    mib,
    prefix_holdings,
    register_all,
    rss_bytes,
    running_service,
    server_side,
    vllm_registration,
    write_json,
)
from conductor.wire.events import BlockStored, Tier
from publishers.encoding import Layout, encode_batch

MODEL = "bench-model"
VOCAB = 128_000
SETUP_WINDOW_BATCHES = 250  # batches in flight while building an index (bounds the backlog)
MEMORY_TARGET_BLOCKS = 1_000_000
MSGPACK_TYPE = "application/msgpack"  # the service answers msgpack to msgpack requests
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "conductor.json"

TARGETS = {
    "ingest_blocks_per_s_min": 300_000,
    "query_p50_ms_max": 0.8,
    "query_p99_ms_max": 3.0,
    "bytes_per_block_max": 300,
}


@dataclass(frozen=True)
class Scale:
    """Every size of one run; ``QUICK`` is ``FULL`` scaled down ~10x."""

    name: str
    ingest_events: int
    index_sizes: tuple[int, ...]  # blocks indexed per latency measurement, ascending
    instance_counts: tuple[int, ...]
    requests: int  # timed /query requests per cell, after warm-up
    warmup: int
    floor_requests: int  # 1-block queries: the HTTP + framework floor
    ingest_runs: int  # fresh service each; the median run is reported (a run is ~1 s)


FULL = Scale("full", 20_000, (10_000, 100_000, 1_000_000), (8, 64), 3_000, 300, 1_000, 3)
QUICK = Scale("quick", 2_000, (1_000, 10_000, 100_000), (8, 64), 300, 50, 100, 1)


@dataclass
class Target:
    """A conductor under test: ours, or a peer assumed to speak only the Go service's API.

    A peer has no ``/metrics``, ``/health`` or msgpack ``/query``, and its ``/services``
    has no connection state, so it is checked through ``/query`` answers alone.
    """

    name: str
    process: subprocess.Popen
    client: Http
    layout: Layout  # the event encoding it is fed
    is_peer: bool

    @property
    def pids(self) -> list[int]:
        return [os.getpid(), self.process.pid]

    def publishers(self, context: zmq.Context, count: int) -> list[Publisher]:
        return [Publisher(context, f"i{n}", self.layout, self.is_peer) for n in range(count)]

    def register(self, publishers: list[Publisher]) -> int:
        """Register and wait until every stream is received; returns the blocks it stored."""
        if not self.is_peer:
            register_all(self.client, publishers)
            return 0
        return register_by_probe(self.client, publishers)


@contextmanager
def running_target(peer: PeerSpec | None, layout: Layout) -> Iterator[Target]:
    """Our service (``peer`` None) or the peer, empty on a free port, stopped on the way out."""
    if peer is None:
        with running_service() as (process, client):
            yield Target("ours", process, client, layout, is_peer=False)
        return
    with tempfile.TemporaryDirectory(prefix="conductor-peer-") as run_dir:
        with running_peer(peer, Path(run_dir)) as started:
            client = Http(started.port)
            try:
                yield Target("peer", started.process, client, layout, is_peer=True)
            finally:
                client.close()


# -- publishers and events --------------------------------------------------------------
END_OF_REPLAY = MASK64.to_bytes(8, "big")


class Publisher:
    """One engine's event stream: a raw PUB that binds, like vLLM with a ``*`` endpoint.

    ``layout`` is the producer whose event encoding it sends. With ``replay`` it also binds
    a ROUTER that answers replay requests as vLLM does with an empty buffer (only the end
    marker): the Go service refuses a registration without a replay endpoint, and a
    conductor that catches up on connection must get an answer.
    """

    def __init__(
        self, context: zmq.Context, instance_id: str, layout: Layout = "vllm", replay: bool = False
    ) -> None:
        self.instance_id = instance_id
        self.layout = layout
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, PUB_SNDHWM)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay: zmq.Socket | None = None
        if replay:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.seq = 0
        self.parent: int | None = None  # last engine hash of the previous chained event

    def registration(self) -> dict[str, Any]:
        replay = {"replay_endpoint": self.replay_endpoint} if self.replay is not None else {}
        return vllm_registration(self.endpoint, self.instance_id, MODEL, **replay)

    def payload(self, events: Sequence[BlockStored]) -> bytes:
        """A ``KVEventBatch`` ``[ts, events, dp_rank]`` as the ``layout`` producer sends it."""
        return encode_batch(events, time.time(), 0, self.layout)

    def send(self, payload: bytes) -> None:
        """Frames ``[topic, seq (8 B big-endian), payload]``; seq counts batches from 0."""
        self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), payload], copy=False)
        self.seq += 1

    def answer_replays(self) -> None:
        """Answer every pending ``[identity, b"", start_seq]`` request with the end marker."""
        while self.replay is not None:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 3 and frames[1] == b"":  # anything else vLLM ignores too
                self.replay.send_multipart([frames[0], b"", b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self.socket.close(0)
        if self.replay is not None:
            self.replay.close(0)


_engine_hashes = itertools.count(1)


def engine_hashes(count: int) -> list[int]:
    """Unique uint64 engine hashes (``engine_hash`` of a running counter).

    Hashes below 2**32 are skipped: msgpack packs them as uint32, and the Go service
    rejects a parent hash that does not decode as a uint64.
    """
    made: list[int] = []
    while len(made) < count:
        value = engine_hash(next(_engine_hashes))
        if value >> 32:
            made.append(value)
    return made


class TokenSource:
    """Distinct, random-looking 256-token prompts, cheap to make in bulk.

    Prompt ``i`` is a slice of one random pool at a pseudo-random offset, with its first
    token replaced by ``i``: distinct first blocks give distinct prefix chains.
    """

    POOL = 1 << 16

    def __init__(self, seed: int = 1234) -> None:
        rng = random.Random(seed)
        self.pool = [rng.randrange(VOCAB) for _ in range(self.POOL + EVENT_TOKENS)]
        self.ids = itertools.count(VOCAB)  # never equal to a pool token

    def prompt(self) -> list[int]:
        prompt_id = next(self.ids)
        offset = (prompt_id * 7919) % self.POOL
        tokens = self.pool[offset : offset + EVENT_TOKENS]
        tokens[0] = prompt_id
        return tokens


def stored_event(hashes: list[int], tokens: list[int], parent: int | None) -> BlockStored:
    """A GPU ``BlockStored``; every layout adds the fields its producer sends."""
    return BlockStored(hashes, parent, tokens, BLOCK_SIZE, Tier.GPU, group_idx=0)


def fresh_events(tokens: TokenSource, count: int) -> list[tuple[list[int], BlockStored]]:
    """``count`` independent one-prompt events, with their tokens (to query them later)."""
    made = []
    for _ in range(count):
        prompt = tokens.prompt()
        made.append((prompt, stored_event(engine_hashes(BLOCKS_PER_EVENT), prompt, None)))
    return made


def batches(items: Sequence[Any], size: int = BATCH_EVENTS) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# -- registration -----------------------------------------------------------------------
PROBE_TOKEN = 1 << 24  # above every prompt id TokenSource hands out


def query_prompt() -> list[int]:
    """The 4,096-token prompt of the latency measurements (every run, every service)."""
    rng = random.Random(99)
    return [rng.randrange(VOCAB) for _ in range(QUERY_BLOCKS * BLOCK_SIZE)]


def probe_tokens(position: int) -> list[int]:
    """A one-block prompt no other event carries, distinct per stream."""
    return [PROBE_TOKEN + position] + [PROBE_TOKEN] * (BLOCK_SIZE - 1)


def register_by_probe(client: Http, publishers: list[Publisher], timeout: float = 20.0) -> int:
    """Register, then resend a one-block probe on each stream until ``/query`` shows it.

    Without a connection state to read, a probe that arrived is the only proof that the
    SUB socket joined (a PUB drops what it sends before that). Returns the blocks stored.
    """
    for publisher in publishers:
        client.json("POST", "/register", publisher.registration())
    probes = {}
    for number, publisher in enumerate(publishers):
        tokens = probe_tokens(number)
        payload = publisher.payload([stored_event(engine_hashes(1), tokens, None)])
        body = query_body(tokens, publisher.instance_id)
        probes[publisher.instance_id] = (publisher, payload, body)
    pending = dict(probes)
    for _ in deadline_loop(timeout, "the peer to receive every stream", 0.02):
        for publisher, payload, _ in pending.values():
            publisher.answer_replays()
            publisher.send(payload)
        pending = {
            name: probe
            for name, probe in pending.items()
            if matched(client, probe[2], name) != BLOCK_SIZE
        }
        if not pending:
            break
    return len(publishers)


def verify_clean(client: Http, blocks_expected: int, events_expected: int) -> dict[str, float]:
    """Fail loudly if the service lost, dropped or rejected anything we sent."""
    text = client.metrics()
    seen = {
        "blocks_stored": metric_sum(text, "conductor_blocks_stored_total"),
        "events_applied": metric_sum(text, "conductor_events_applied_total"),
        "gaps": metric_sum(text, "conductor_sequence_gaps_total"),
        "orphaned": metric_sum(text, "conductor_orphaned_events_total"),
        "dropped": metric_sum(text, "conductor_dropped_events_total"),
        "decode_errors": metric_sum(text, "conductor_decode_errors_total"),
    }
    expected = {"blocks_stored": blocks_expected, "events_applied": events_expected}
    problems = [f"{k}={seen[k]:.0f} (want {v})" for k, v in expected.items() if seen[k] != v]
    problems += [f"{k}={seen[k]:.0f}" for k in ("gaps", "orphaned", "dropped", "decode_errors")]
    problems = [p for p in problems if not p.endswith("=0")]
    if problems:
        raise BenchError("service lost or rejected events: " + ", ".join(problems))
    return seen


# -- queries ----------------------------------------------------------------------------
def query_body(tokens: list[int], instance_id: str | None = None) -> bytes:
    payload: dict[str, Any] = {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": tokens}
    if instance_id is not None:
        payload["instance_id"] = instance_id
    return json.dumps(payload, separators=(",", ":")).encode()


def msgpack_query_body(tokens: list[int]) -> bytes:
    """The same query as msgpack with tokens packed as little-endian int32 (C++ rewrite).

    Parsing 4,096 JSON numbers into Python ints is the largest part of a JSON query; this
    encoding, which the service already accepts, shows what a router would gain.
    """
    packed = struct.pack(f"<{len(tokens)}i", *tokens)
    return msgpack.packb({"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": packed})


def post_query(client: Http, body: bytes) -> dict[str, Any]:
    status, data = client.raw("POST", "/query", body)
    if status != 200:
        raise BenchError(f"/query -> {status}: {data[:300]!r}")
    return json.loads(data)


def matched(client: Http, body: bytes, instance_id: str) -> int:
    """Tokens of the prompt in ``body`` that ``instance_id`` holds (``longest_matched``)."""
    answer = post_query(client, body)
    return answer.get("default", {}).get(instance_id, {}).get("longest_matched", 0)


def warm_up(client: Http, body: bytes, count: int, content_type: str = JSON_TYPE) -> None:
    """Untimed requests first: connection, caches and the allocator settle."""
    for _ in range(count):
        client.raw("POST", "/query", body, content_type)


def time_queries(
    client: Http, body: bytes, count: int, content_type: str = JSON_TYPE
) -> dict[str, float]:
    """Sequential keep-alive POST /query; the client-side round trip of each request."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    started = time.perf_counter()
    for _ in range(count):
        t0 = clock()
        status, _ = client.raw("POST", "/query", body, content_type)
        samples.append(clock() - t0)
        if status != 200:
            raise BenchError(f"/query -> {status}")
    return latency_summary(samples, time.perf_counter() - started)


# -- 1. ingest --------------------------------------------------------------------------
def bench_ingest(
    scale: Scale,
    context: zmq.Context,
    peer: PeerSpec | None = None,
    layout: Layout = "vllm",
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Blocks/s from the first send until the last event's prompt answers in full.

    Batches are applied in sequence order, so the last prompt being queryable means every
    earlier one was applied; the first prompt and our service's counters are checked too,
    and on a peer (no counters) the last prompt of every batch.
    """
    tokens = TokenSource(seed=1)
    made = fresh_events(tokens, scale.ingest_events)
    first_body = query_body(made[0][0], "i0")
    last_body = query_body(made[-1][0], "i0")
    with running_target(peer, layout) as target:
        (publisher,) = target.publishers(context, 1)
        try:
            payloads = [publisher.payload([event for _, event in chunk]) for chunk in batches(made)]
            target.register([publisher])
            client, polls, slowest_poll = target.client, 0, 0.0
            cpu_before = CpuSample.take(target.pids)
            started = time.perf_counter()
            for payload in payloads:
                publisher.send(payload)
            sent = time.perf_counter()
            for _ in deadline_loop(timeout, "the last ingested prompt to be queryable"):
                t0 = time.perf_counter()
                done = matched(client, last_body, "i0") == EVENT_TOKENS
                slowest_poll = max(slowest_poll, time.perf_counter() - t0)
                polls += 1
                if done:
                    break
            elapsed = time.perf_counter() - started
            load = CpuSample.take(target.pids).load_since(cpu_before)
            if matched(client, first_body, "i0") != EVENT_TOKENS:
                raise BenchError("the first ingested prompt is not queryable")
            blocks = scale.ingest_events * BLOCKS_PER_EVENT
            if target.is_peer:
                counters = {"batches_checked": verify_batches(client, made)}
            else:
                counters = verify_clean(client, blocks, scale.ingest_events)
            rss_after = rss_bytes(target.process.pid)  # unpaced burst: includes ZMQ's queue
        finally:
            publisher.close()
    return {
        "target": target.name,
        "layout": layout,
        "events": scale.ingest_events,
        "blocks": blocks,
        "batches": len(payloads),
        "events_per_batch": BATCH_EVENTS,
        "payload_bytes": sum(len(p) for p in payloads),
        "send_s": sent - started,
        "elapsed_s": elapsed,
        "blocks_per_s": blocks / elapsed,
        "events_per_s": scale.ingest_events / elapsed,
        "polls": polls,
        "load": load,
        "slowest_poll_ms": slowest_poll * 1000,
        "rss_after_bytes": rss_after,
        "counters": counters,
    }


def verify_batches(client: Http, made: list[tuple[list[int], BlockStored]]) -> int:
    """The last prompt of every batch answers in full: no batch was dropped (the Go service
    drops a whole batch it cannot decode). Returns the batches checked."""
    chunks = batches(made)
    for number, chunk in enumerate(chunks):
        if matched(client, query_body(chunk[-1][0], "i0"), "i0") != EVENT_TOKENS:
            raise BenchError(f"batch {number} of the ingest is not queryable on the peer")
    return len(chunks)


@dataclass(frozen=True)
class Contender:
    """One ingest configuration: who is measured, fed which event layout."""

    key: str
    peer: PeerSpec | None
    layout: Layout


def bench_ingest_runs(
    scale: Scale, context: zmq.Context, contenders: Sequence[Contender]
) -> dict[str, dict[str, Any]]:
    """Repeat the ingest run, contenders interleaved so they share the machine's noise.

    One short run on a shared VM is noisy (bench/results/ gives each run's figure); the
    median run of each is reported.
    """
    runs: dict[str, list[dict[str, Any]]] = {c.key: [] for c in contenders}
    for _ in range(scale.ingest_runs):
        for contender in contenders:
            run = bench_ingest(scale, context, contender.peer, contender.layout)
            runs[contender.key].append(run)
    medians = {}
    for key, measured in runs.items():
        median = sorted(measured, key=lambda run: run["blocks_per_s"])[len(measured) // 2]
        medians[key] = {**median, "runs_blocks_per_s": [run["blocks_per_s"] for run in measured]}
    return medians


# -- 2.-4. query latency and memory -----------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One batch to send, and the last prompt in it (queryable once the batch is applied)."""

    publisher: Publisher
    payload: bytes
    last_prompt: list[int]


@dataclass
class QueryIndex:
    """A conductor with ``instances`` publishers and the blocks each was told to hold."""

    target: Target
    publishers: list[Publisher]
    tokens: TokenSource = field(default_factory=TokenSource)
    query_tokens: list[int] = field(default_factory=list)
    holdings: int = 0  # (instance, block) pairs the grid asked for
    events: int = 0
    probe_blocks: int = 0  # a peer's proofs of subscription (``register_by_probe``)
    next_instance: int = 0

    @property
    def stored(self) -> int:
        """Every (instance, block) pair stored: ``conductor_blocks_stored_total``."""
        return self.holdings + self.probe_blocks

    @property
    def client(self) -> Http:
        return self.target.client

    def send_window(self, jobs: list[Job], timeout: float) -> None:
        """Send batches, keeping at most one window queued ahead of the service.

        Without pacing, the SUB's receive queue (100,000 messages) would hold gigabytes
        and the resident-memory figure would measure ZMQ buffers, not the index.
        """
        windows = batches(jobs, SETUP_WINDOW_BATCHES)
        for number, window in enumerate(windows):
            for job in window:
                job.publisher.send(job.payload)
            if number > 0:
                self.wait_applied(windows[number - 1], timeout)
        if windows:
            self.wait_applied(windows[-1], timeout)

    def wait_applied(self, window: Sequence[Job], timeout: float) -> None:
        """Until each stream's last batch in ``window`` is queryable (streams apply in order).

        Streams are checked one at a time, so a poll costs the service one query.
        """
        last = {job.publisher.instance_id: job.last_prompt for job in window}
        pending = list(last.items())
        for _ in deadline_loop(timeout, f"{len(window)} batches to be applied", 0.01):
            while pending and self.holds(*pending[-1]):
                pending.pop()
            if not pending:
                return

    def holds(self, instance_id: str, prompt: list[int]) -> bool:
        return matched(self.client, query_body(prompt, instance_id), instance_id) == len(prompt)

    def load_query_prefixes(self, timeout: float) -> None:
        """Each instance stores its share of the query prompt as chained 16-block events."""
        self.query_tokens = query_prompt()
        for publisher, blocks in zip(
            self.publishers, [prefix_holdings(n) for n in range(len(self.publishers))], strict=True
        ):
            events = []
            for start in range(0, blocks, BLOCKS_PER_EVENT):
                hashes = engine_hashes(BLOCKS_PER_EVENT)
                chunk = self.query_tokens[
                    start * BLOCK_SIZE : (start + BLOCKS_PER_EVENT) * BLOCK_SIZE
                ]
                events.append(stored_event(hashes, chunk, publisher.parent))
                publisher.parent = hashes[-1]
            if events:
                publisher.send(publisher.payload(events))
            self.holdings += blocks
            self.events += len(events)
        body = query_body(self.query_tokens)
        for _ in deadline_loop(timeout, "the query prompt's prefixes to be indexed", 0.01):
            if self.answer(body) == self.expected_answer():
                return

    def grow_to(self, holdings: int, timeout: float) -> None:
        """Add unrelated one-prompt events, round-robin over instances, up to ``holdings``."""
        count = max(0, holdings - self.holdings) // BLOCKS_PER_EVENT
        per_instance: list[list[tuple[list[int], BlockStored]]] = [[] for _ in self.publishers]
        for _ in range(count):
            prompt = self.tokens.prompt()
            event = stored_event(engine_hashes(BLOCKS_PER_EVENT), prompt, None)
            per_instance[self.next_instance].append((prompt, event))
            self.next_instance = (self.next_instance + 1) % len(self.publishers)
        self.holdings += count * BLOCKS_PER_EVENT
        self.events += count
        streams = [
            [
                Job(publisher, publisher.payload([e for _, e in chunk]), chunk[-1][0])
                for chunk in batches(made)
            ]
            for publisher, made in zip(self.publishers, per_instance, strict=True)
        ]
        jobs = [  # round-robin over the streams, each stream in its own order
            job for row in itertools.zip_longest(*streams) for job in row if job is not None
        ]
        self.send_window(jobs, timeout)

    def expected_answer(self) -> dict[str, int]:
        holds = [prefix_holdings(n) for n in range(len(self.publishers))]
        return {p.instance_id: n * BLOCK_SIZE for p, n in zip(self.publishers, holds, strict=True)}

    def answer(self, body: bytes, content_type: str = JSON_TYPE) -> dict[str, int]:
        """``longest_matched`` per instance, from a 200 answer."""
        status, data = self.client.raw("POST", "/query", body, content_type)
        if status != 200:
            raise BenchError(f"/query -> {status}: {data[:300]!r}")
        if content_type == MSGPACK_TYPE:  # answered in upstream C++'s shape
            hits = msgpack.unpackb(data)["instances"]
        else:
            hits = json.loads(data).get("default", {})
        return {name: m["longest_matched"] for name, m in hits.items()}

    def check_answer(self, body: bytes, content_type: str = JSON_TYPE) -> None:
        """The timed query must return the right thing, or its latency means nothing."""
        got = self.answer(body, content_type)
        if got != self.expected_answer():
            raise BenchError(f"wrong /query answer: {got}")


def measure_cell(index: QueryIndex, scale: Scale) -> dict[str, Any]:
    """Latency of the 4,096-token query (and a 1-block floor) at the index's current size.

    Our service also gets the same query as msgpack and its own timing; a peer only JSON.
    """
    target, client = index.target, index.client
    body = query_body(index.query_tokens)
    index.check_answer(body)
    warm_up(client, body, scale.warmup)
    before = "" if target.is_peer else client.metrics()
    cpu_before = CpuSample.take(target.pids)
    result = time_queries(client, body, scale.requests)
    load = CpuSample.take(target.pids).load_since(cpu_before)
    cell: dict[str, Any] = {"instances": len(index.publishers), "blocks": index.stored}
    if not target.is_peer:
        cell["server"] = server_side(before, client.metrics())
        packed = msgpack_query_body(index.query_tokens)
        index.check_answer(packed, MSGPACK_TYPE)
        warm_up(client, packed, scale.warmup, MSGPACK_TYPE)
        cell["msgpack_int32"] = time_queries(client, packed, scale.requests, MSGPACK_TYPE)
    floor_body = query_body(index.query_tokens[:BLOCK_SIZE])
    warm_up(client, floor_body, 50)
    cell["floor_1_block"] = time_queries(client, floor_body, scale.floor_requests)
    if not target.is_peer:
        counters = verify_clean(client, index.stored, index.events)
        cell["blocks"] = int(counters["blocks_stored"])
        cell["distinct_blocks"] = client.json("GET", "/health")["blocks"]
    return {
        **cell,
        "query_tokens": len(index.query_tokens),
        "request_bytes": len(body),
        "client": result,
        "load": load,
        "rss_bytes": rss_bytes(target.process.pid),
    }


def bench_queries(
    scale: Scale,
    context: zmq.Context,
    instances: int,
    report: Callable[[dict[str, Any]], None],
    peer: PeerSpec | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """One conductor, ``instances`` publishers, the index grown through every size."""
    with running_target(peer, "vllm-legacy" if peer else "vllm") as target:
        publishers = target.publishers(context, instances)
        try:
            rss_empty = rss_bytes(target.process.pid)
            probes = target.register(publishers)
            rss_registered = rss_bytes(target.process.pid)
            index = QueryIndex(target, publishers, probe_blocks=probes)
            index.load_query_prefixes(timeout)
            cells = []
            for size in scale.index_sizes:
                started = time.perf_counter()
                index.grow_to(size, timeout)
                cell = measure_cell(index, scale)
                cell["target"] = target.name
                cell["build_s"] = time.perf_counter() - started
                cell["rss_empty_bytes"] = rss_empty
                cell["rss_registered_bytes"] = rss_registered
                cell["bytes_per_block_delta"] = (cell["rss_bytes"] - rss_empty) / cell["blocks"]
                cell["bytes_per_block_total"] = cell["rss_bytes"] / cell["blocks"]
                report(cell)
                cells.append(cell)
        finally:
            for publisher in publishers:
                publisher.close()
    return {
        "target": target.name,
        "instances": instances,
        "rss_empty_bytes": rss_empty,
        "cells": cells,
    }


# -- output -----------------------------------------------------------------------------
LAYOUT_NAMES = {"vllm": "vLLM 0.33 maps", "vllm-legacy": "vLLM <= 0.23 arrays"}


def print_ingest(result: dict[str, Any]) -> None:
    print(
        f"\n== ingest: {result['target']} (one publisher, {LAYOUT_NAMES[result['layout']]}, "
        "16 blocks/event, 20 events/batch)"
    )
    print(
        f"  {result['events']:,} events / {result['blocks']:,} blocks in "
        f"{result['elapsed_s']:.3f} s (publisher sent all in {result['send_s']:.3f} s)"
    )
    print(
        f"  {result['blocks_per_s']:,.0f} blocks/s   {result['events_per_s']:,.0f} events/s   "
        f"target >= {TARGETS['ingest_blocks_per_s_min']:,} blocks/s   "
        f"slowest /query poll during ingest {result['slowest_poll_ms']:.1f} ms"
    )
    runs = ", ".join(f"{rate:,.0f}" for rate in result["runs_blocks_per_s"])
    print(
        f"  median of {len(result['runs_blocks_per_s'])} runs (blocks/s: {runs}); "
        f"RSS after the burst {mib(result['rss_after_bytes'])} MiB"
    )
    load = result["load"]
    print(
        f"  CPU: service+bench {load['own_cores']:.2f} cores, other processes "
        f"{load['other_cores']:.2f}, stolen {load['steal_cores']:.2f}"
    )


QUERY_HEADER = (
    f"  {'svc':<4} {'inst':>4} {'blocks':>9} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7} "
    f"{'req/s':>7} {'srv mean':>8} {'srv p99~':>8} {'mp p50':>7} {'mp p99':>7} {'1-blk p50':>9} "
    f"{'RSS MiB':>8} {'B/blk':>6} {'build s':>7} {'bg cpu':>6}"
)


def print_cell(cell: dict[str, Any]) -> None:
    """One row; a peer has no server-side timing and no msgpack query (``-``)."""
    c, f = cell["client"], cell["floor_1_block"]
    s, m = cell.get("server"), cell.get("msgpack_int32")
    own = (
        f"{s['mean_ms']:>8.3f} {s['p99_ms_est']:>8.3f} {m['p50_ms']:>7.3f} {m['p99_ms']:>7.3f}"
        if s and m
        else f"{'-':>8} {'-':>8} {'-':>7} {'-':>7}"
    )
    print(
        f"  {cell['target']:<4} {cell['instances']:>4} {cell['blocks']:>9,} {c['p50_ms']:>7.3f} "
        f"{c['p90_ms']:>7.3f} {c['p99_ms']:>7.3f} {c['max_ms']:>7.2f} "
        f"{c['requests_per_s']:>7.0f} {own} {f['p50_ms']:>9.3f} {mib(cell['rss_bytes']):>8} "
        f"{cell['bytes_per_block_total']:>6.0f} {cell['build_s']:>7.1f} "
        f"{cell['load']['other_cores'] + cell['load']['steal_cores']:>6.2f}",
        flush=True,
    )


def headline(scale: Scale, result: dict[str, Any]) -> dict[str, Any]:
    """The four numbers the brief asks for, with their targets."""
    by_instances = {run["instances"]: run["cells"] for run in result["query"]}
    small = by_instances[min(scale.instance_counts)][1]  # 8 instances, 100,000 blocks
    large = by_instances[max(scale.instance_counts)][-1]  # 64 instances, 1,000,000 blocks
    ingest = result["ingest"]
    return {
        "ingest_blocks_per_s": ingest["blocks_per_s"],
        "ingest_events_per_s": ingest["events_per_s"],
        "query_8": {"blocks": small["blocks"], **small["client"]},
        "query_8_msgpack": small["msgpack_int32"],
        "query_64": {"blocks": large["blocks"], **large["client"]},
        "query_64_msgpack": large["msgpack_int32"],
        "memory": {
            "blocks": large["blocks"],
            "rss_empty_bytes": large["rss_empty_bytes"],
            "rss_bytes": large["rss_bytes"],
            "bytes_per_block_delta": large["bytes_per_block_delta"],
            "bytes_per_block_total": large["bytes_per_block_total"],
        },
        "pass": {
            "ingest": ingest["blocks_per_s"] >= TARGETS["ingest_blocks_per_s_min"],
            "query_p50": small["client"]["p50_ms"] <= TARGETS["query_p50_ms_max"],
            "query_p99": small["client"]["p99_ms"] <= TARGETS["query_p99_ms_max"],
            # per-block memory only means something once the index dwarfs the interpreter
            "memory": large["bytes_per_block_total"] <= TARGETS["bytes_per_block_max"]
            if large["blocks"] >= MEMORY_TARGET_BLOCKS
            else None,
        },
    }


def print_headline(summary: dict[str, Any]) -> None:
    def verdict(ok: bool | None) -> str:
        return {True: "PASS", False: "MISS", None: "n/a below 1M blocks"}[ok]

    ok, q8, q64, mem = summary["pass"], summary["query_8"], summary["query_64"], summary["memory"]
    print("\n== summary")
    print(
        f"  ingest           {summary['ingest_blocks_per_s']:>12,.0f} blocks/s "
        f"({summary['ingest_events_per_s']:,.0f} events/s)   [{verdict(ok['ingest'])} "
        f">= {TARGETS['ingest_blocks_per_s_min']:,}]"
    )
    for name, q, check in (("8 inst", q8, True), ("64 inst", q64, False)):
        marks = (
            f"   [p50 {verdict(ok['query_p50'])} <= {TARGETS['query_p50_ms_max']} ms, "
            f"p99 {verdict(ok['query_p99'])} <= {TARGETS['query_p99_ms_max']} ms]"
            if check
            else ""
        )
        print(
            f"  /query {name:<8} {q['blocks']:>9,} blocks: p50 {q['p50_ms']:.3f} ms  "
            f"p90 {q['p90_ms']:.3f}  p99 {q['p99_ms']:.3f}  max {q['max_ms']:.2f}  "
            f"{q['requests_per_s']:,.0f} req/s{marks}"
        )
        packed = summary["query_8_msgpack" if check else "query_64_msgpack"]
        print(
            f"  {'':<17} {'':>9}  as msgpack + int32 tokens: p50 {packed['p50_ms']:.3f} ms  "
            f"p99 {packed['p99_ms']:.3f}"
        )
    print(
        f"  memory at {mem['blocks']:,} blocks: RSS {mib(mem['rss_bytes'])} MiB "
        f"(empty {mib(mem['rss_empty_bytes'])} MiB): "
        f"{mem['bytes_per_block_delta']:.0f} B/block over empty, "
        f"{mem['bytes_per_block_total']:.0f} B/block total   "
        f"[{verdict(ok['memory'])} <= {TARGETS['bytes_per_block_max']}]"
    )


NOISY_CORES = 0.25


def warn_if_noisy(result: dict[str, Any]) -> None:
    """Latency on a shared 2-core box is only comparable when nothing else was running."""
    runs = [result, *([result["peer"]] if "peer" in result else [])]
    ingests = [run[key] for run in runs for key in ("ingest", "ingest_legacy") if key in run]
    cells = [cell for run in runs for query in run["query"] for cell in query["cells"]]
    loads = [measured["load"] for measured in (*ingests, *cells)]
    worst = max(load["other_cores"] + load["steal_cores"] for load in loads)
    if worst > NOISY_CORES:
        print(
            f"\n  note: other processes used up to {worst:.2f} cores during a measurement; "
            "rerun on a quiet machine before comparing numbers"
        )


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, PeerSpec | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~10x smaller, for smoke checks")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    parser.add_argument(
        "--peer",
        metavar="COMMAND",
        help="also measure this conductor (e.g. the Go binary's path; split like a shell "
        "line): it gets CONDUCTOR_CONFIG_PATH (a file with its port) and CONDUCTOR_LOG_LEVEL",
    )
    parser.add_argument(
        "--peer-env",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="an extra environment variable for the peer (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.peer is None:
        if args.peer_env:
            parser.error("--peer-env needs --peer")
        return args, None
    try:
        command = tuple(shlex.split(args.peer))
        env = parse_env(args.peer_env)
    except ValueError as error:
        parser.error(str(error))
    if not command:
        parser.error("--peer needs a command")
    return args, PeerSpec(command, env)


def run(scale: Scale, context: zmq.Context, peer: PeerSpec | None) -> dict[str, Any]:
    """Every phase; with a peer, ingest runs interleaved and the query grids side by side."""
    result: dict[str, Any] = {"scale": asdict(scale), "machine": machine()}
    contenders = [Contender("ours", None, "vllm")]
    if peer is not None:
        contenders += [
            Contender("ours_legacy", None, "vllm-legacy"),
            Contender("peer", peer, "vllm-legacy"),
        ]
        result["peer"] = {"command": list(peer.command), "env": dict(peer.env), "query": []}
    ingest = bench_ingest_runs(scale, context, contenders)
    result["ingest"] = ingest["ours"]
    if peer is not None:
        result["ingest_legacy"] = ingest["ours_legacy"]
        result["peer"]["ingest"] = ingest["peer"]
    for measured in ingest.values():
        print_ingest(measured)
    print("\n== /query of a 4,096-token prompt (256 blocks), sequential keep-alive, ms")
    print(
        f"  ({scale.requests:,} timed requests per row after {scale.warmup} warm-up; "
        "srv = conductor_query_seconds, ~ = bucket estimate; mp = the same query as msgpack "
        "with int32-packed tokens; B/blk = RSS / blocks)"
    )
    print("  (bg cpu = cores used by other processes or stolen while timing: noise)")
    print(QUERY_HEADER)
    result["query"] = []
    for instances in scale.instance_counts:
        result["query"].append(bench_queries(scale, context, instances, print_cell))
        if peer is not None:
            result["peer"]["query"].append(
                bench_queries(scale, context, instances, print_cell, peer)
            )
    result["summary"] = headline(scale, result)
    result["targets"] = TARGETS
    print_headline(result["summary"])
    if peer is not None:
        result["comparison"] = compare(result)
        print_comparison(result["comparison"])
    warn_if_noisy(result)
    return result


def main(argv: list[str] | None = None) -> int:
    args, peer = parse_args(argv)
    scale = QUICK if args.quick else FULL
    print(f"conductor benchmark ({scale.name}): {machine()}")
    if peer is not None:
        print(f"peer: {shlex.join(peer.command)}")
    context = zmq.Context()
    try:
        result = run(scale, context, peer)
    except (BenchError, PeerError, OSError, http.client.HTTPException) as error:
        print(f"benchmark failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        context.term()
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
