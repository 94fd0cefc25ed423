"""Soak: a conductor under every kind of churn at once, for a bounded time (10 min default).

A real conductor process; in this process, publishers on the vLLM wire (real ZMQ PUB and
replay ROUTER sockets), each the model of one engine's paged prefix cache: it caches the
blocks of prompts built from a few shared documents and evicts the least recently used,
publishing exact ``BlockStored`` / ``BlockRemoved`` events, so the test always knows what
every engine holds. Together, until the end:

* every publisher stores and evicts (``--batches-per-s`` each);
* ``--query-concurrency`` clients send ``/query`` for random prompts;
* a churn loop unregisters and re-registers a publisher (its index refills from the replay
  buffer), restarts one (a new process would count its batches from 0: it starts empty,
  and the conductor must notice), or both, every ``--churn-interval-s``.

At the end publishing stops and, once the conductor has caught up, every (publisher,
document) prompt's ``/query`` answer is compared with what the publisher holds: the index
must be exact. Reported: the conductor's RSS over time and its slope (after warm-up),
``/query`` latency percentiles, the loop-lag p99 and worst bucket from the conductor's
``conductor_event_loop_lag_seconds``, counts of churn actions, and mismatches.

    python -m bench.soak [--duration-s 600] [--publishers 8] [--out bench/results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import zmq

from bench.harness import bucket_quantile, percentile, rss_bytes
from conductor.hashing import prefix_hashes
from conductor.wire.events import BlockRemoved, BlockStored
from publishers.local import HOST, LocalService
from publishers.publisher import KVEventPublisher

MODEL = "soak-model"
BLOCK_SIZE = 16
REPLAY_BUFFER = 1_000_000  # batches: a re-registered stream refills from its buffer, whole
LAG_METRIC = "conductor_event_loop_lag_seconds_bucket"


@dataclass
class CacheModel:
    """One engine's prefix cache, least recently used first: prefix hash -> physical copies.

    As vLLM does, a prompt stores every block after its first missing one, so a block that
    is still cached further down the chain is stored (and announced) again: a second copy,
    evicted on its own (the conductor counts copies the same way).
    """

    name: str
    capacity: int
    blocks: OrderedDict[int, int] = field(default_factory=OrderedDict)

    def admit(self, hashes: list[int], tokens: list[int]) -> list[BlockStored | BlockRemoved]:
        """Cache a prompt's blocks; returns the events that say so, evictions first."""
        new_from = next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))
        for known in hashes[:new_from]:
            self.blocks.move_to_end(known)
        fresh = hashes[new_from:]
        events: list[BlockStored | BlockRemoved] = []
        wanted = set(hashes)
        overflow = sum(self.blocks.values()) + len(fresh) - self.capacity
        evicted: list[int] = []
        for block in list(self.blocks):
            if overflow <= 0:
                break
            if block not in wanted:
                copies = self.blocks.pop(block)
                evicted += [block] * copies
                overflow -= copies
        if evicted:
            events.append(BlockRemoved(evicted))
        if fresh:
            parent = hashes[new_from - 1] if new_from else None
            start = new_from * BLOCK_SIZE
            events.append(
                BlockStored(fresh, parent, tokens[start : start + len(fresh) * BLOCK_SIZE])
            )
            for block in fresh:
                self.blocks[block] = self.blocks.get(block, 0) + 1
                self.blocks.move_to_end(block)
        return events

    def matched_tokens(self, hashes: list[int]) -> int:
        held = next((i for i, h in enumerate(hashes) if h not in self.blocks), len(hashes))
        return held * BLOCK_SIZE


@dataclass
class SoakPublisher:
    """A cache model behind a real publisher; ``restart`` replaces both, as a new engine
    process would (same endpoints, sequence from 0, nothing cached)."""

    cache: CacheModel
    publisher: KVEventPublisher

    @classmethod
    def start(cls, name: str, capacity: int, endpoint: str, replay: str) -> SoakPublisher:
        publisher = KVEventPublisher(endpoint, replay, buffer_steps=REPLAY_BUFFER, bind=True)
        return cls(CacheModel(name, capacity), publisher)

    async def restart(self, timeout: float = 5.0) -> None:
        endpoint, replay = self.publisher.endpoint, self.publisher.replay_endpoint
        self.publisher.close()
        deadline = time.monotonic() + timeout
        while True:  # ZMQ releases the old listeners in its I/O thread, a little later
            try:
                self.publisher = KVEventPublisher(
                    endpoint, replay, buffer_steps=REPLAY_BUFFER, bind=True
                )
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        self.cache = CacheModel(self.cache.name, self.cache.capacity)

    def registration(self) -> dict[str, Any]:
        return {
            "endpoint": self.publisher.endpoint,
            "replay_endpoint": self.publisher.replay_endpoint,
            "type": "vLLM",
            "modelname": MODEL,
            "instance_id": self.cache.name,
            "block_size": BLOCK_SIZE,
        }


class Workload:
    """Prompts made of a shared document and a question: long shared prefixes."""

    def __init__(self, documents: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.documents = [
            [self.rng.randrange(1, 32_000) for _ in range(self.rng.randrange(256, 2048))]
            for _ in range(documents)
        ]

    def prompt(self) -> list[int]:
        document = self.rng.choice(self.documents)
        question = [self.rng.randrange(1, 32_000) for _ in range(self.rng.randrange(16, 256))]
        return document + question


@dataclass
class Report:
    churn: dict[str, int] = field(default_factory=lambda: {"reregister": 0, "restart": 0})
    query_ms: list[float] = field(default_factory=list)
    query_errors: int = 0
    rss: list[tuple[float, int]] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace, conductor: LocalService) -> None:
        self.args = args
        self.conductor = conductor
        self.url = conductor.url
        self.workload = Workload(args.documents, args.seed)
        self.report = Report()
        self.publishers = [
            SoakPublisher.start(
                f"engine-{i}", args.capacity_blocks, f"tcp://{HOST}:0", f"tcp://{HOST}:0"
            )
            for i in range(args.publishers)
        ]
        self.by_name = {p.cache.name: p for p in self.publishers}
        self.busy: set[str] = set()  # being unregistered / restarted: not published to
        self.running = True

    async def call(self, http: aiohttp.ClientSession, path: str, body: dict) -> Any:
        async with http.post(f"{self.url}{path}", json=body) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{path} answered {response.status}: {payload}")
            return payload

    async def publish_loop(self, soak: SoakPublisher) -> None:
        interval = 1 / self.args.batches_per_s
        while self.running:
            if soak.cache.name not in self.busy:
                tokens = self.workload.prompt()
                events = soak.cache.admit(prefix_hashes(tokens, BLOCK_SIZE), tokens)
                if events:
                    soak.publisher.publish(events)
            await asyncio.sleep(interval)

    async def query_loop(self, http: aiohttp.ClientSession) -> None:
        while self.running:
            tokens = self.workload.prompt()
            body = {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": tokens}
            started = time.perf_counter()
            try:
                await self.call(http, "/query", body)
                self.report.query_ms.append((time.perf_counter() - started) * 1000)
            except (aiohttp.ClientError, RuntimeError):
                self.report.query_errors += 1

    async def churn_loop(self, http: aiohttp.ClientSession) -> None:
        rng = random.Random(self.args.seed + 1)
        while self.running:
            await asyncio.sleep(self.args.churn_interval_s)
            soak = rng.choice(self.publishers)
            name = soak.cache.name
            self.busy.add(name)
            action = rng.choice(("reregister", "restart", "both"))
            if action in ("reregister", "both"):
                await self.call(http, "/unregister", {"instance_id": name})
                self.report.churn["reregister"] += 1
            if action in ("restart", "both"):
                await soak.restart()
                self.report.churn["restart"] += 1
            if action in ("reregister", "both"):
                await self.call(http, "/register", soak.registration())
            self.busy.discard(name)

    async def sample_rss(self) -> None:
        started = time.monotonic()
        while self.running:
            rss = rss_bytes(self.conductor.process.pid)
            self.report.rss.append((time.monotonic() - started, rss))
            await asyncio.sleep(self.args.rss_interval_s)

    async def mismatches(self, http: aiohttp.ClientSession) -> list[str]:
        """Every (publisher, document) prompt whose answer differs from the cache model."""
        wrong = []
        for document in self.workload.documents:
            hashes = prefix_hashes(document, BLOCK_SIZE)
            body = {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": document}
            answer = (await self.call(http, "/query", body)).get("default", {})
            for soak in self.publishers:
                expected = soak.cache.matched_tokens(hashes)
                got = answer.get(soak.cache.name, {}).get("GPU", 0)
                if got != expected:
                    wrong.append(f"{soak.cache.name}: expected {expected}, got {got}")
        return wrong

    async def settle(self, http: aiohttp.ClientSession, timeout: float = 30.0) -> list[str]:
        """Mismatches once the conductor has applied everything (or after ``timeout``)."""
        for soak in self.publishers:
            soak.publisher.flush()
        deadline = time.monotonic() + timeout
        while True:
            wrong = await self.mismatches(http)
            if not wrong or time.monotonic() > deadline:
                return wrong
            await asyncio.sleep(0.2)

    async def run(self) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for soak in self.publishers:
                await self.call(http, "/register", soak.registration())
            tasks = [
                *(asyncio.create_task(self.publish_loop(p)) for p in self.publishers),
                *(
                    asyncio.create_task(self.query_loop(http))
                    for _ in range(self.args.query_concurrency)
                ),
                asyncio.create_task(self.churn_loop(http)),
                asyncio.create_task(self.sample_rss()),
            ]
            await asyncio.sleep(self.args.duration_s)
            self.running = False
            await asyncio.gather(*tasks)
            wrong = await self.settle(http)
            async with http.get(f"{self.url}/metrics") as response:
                metrics = await response.text()
            async with http.get(f"{self.url}/health") as response:
                health = await response.json()
        for soak in self.publishers:
            soak.publisher.close()
        return self.summary(wrong, metrics, health)

    def summary(self, wrong: list[str], metrics: str, health: dict) -> dict[str, Any]:
        report, args = self.report, self.args
        ordered = sorted(report.query_ms)
        lag = lag_buckets(metrics)
        return {
            "duration_s": args.duration_s,
            "publishers": args.publishers,
            "churn": report.churn,
            "queries": len(ordered),
            "query_errors": report.query_errors,
            "query_ms": {q: round(percentile(ordered, q), 3) for q in (50, 90, 99, 99.9)}
            if ordered
            else {},
            "loop_lag_ms": {
                "p99": round(bucket_quantile(lag, 0.99) * 1000, 2) if lag else None,
                "worst_bucket_le": worst_bucket(lag),
            },
            "rss_mib": {
                "start": round(report.rss[0][1] / 2**20, 1) if report.rss else None,
                "end": round(report.rss[-1][1] / 2**20, 1) if report.rss else None,
                "slope_mib_per_hour": rss_slope(report.rss, args.warmup_fraction),
            },
            "index_blocks_at_end": health.get("blocks"),
            "mismatches": len(wrong),
            "mismatch_examples": wrong[:5],
        }


def lag_buckets(metrics: str, series: str = LAG_METRIC) -> list[tuple[float, float]]:
    """``(le, cumulative count)`` of the conductor's loop-lag histogram (or of another
    histogram series: its name and the labels before ``le``), ``[]`` if absent."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(series):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    return sorted(buckets)


def worst_bucket(buckets: list[tuple[float, float]]) -> float | None:
    """The upper bound of the highest bucket any lag fell into (seconds)."""
    previous = 0.0
    worst = None
    for bound, count in buckets:
        if count > previous:
            worst = bound
        previous = count
    return worst


def rss_slope(samples: list[tuple[float, int]], warmup_fraction: float) -> float | None:
    """Least-squares slope of RSS after the warm-up, in MiB per hour."""
    kept = samples[int(len(samples) * warmup_fraction) :]
    if len(kept) < 3:
        return None
    n = len(kept)
    mean_t = sum(t for t, _ in kept) / n
    mean_r = sum(r for _, r in kept) / n
    spread = sum((t - mean_t) ** 2 for t, _ in kept)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in kept) / spread
    return round(slope * 3600 / 2**20, 2)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="conductor-soak-") as run_dir:
        config = Path(run_dir) / "conductor_config.json"
        config.write_text("{}")
        conductor = LocalService(
            Path(run_dir),
            "conductor",
            "conductor",
            "--config",
            str(config),
            env={"CONDUCTOR_LOG_LEVEL": "WARNING", "CONDUCTOR_STATE_FILE": ""},
        )
        try:
            await asyncio.to_thread(conductor.wait_ready)
            result = await Soak(args, conductor).run()
            result["conductor_exit_ok"] = conductor.process.poll() is None
        finally:
            conductor.stop()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600)
    parser.add_argument("--publishers", type=int, default=8)
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--capacity-blocks", type=int, default=2_000, help="per publisher")
    parser.add_argument("--batches-per-s", type=float, default=50, help="per publisher")
    parser.add_argument("--query-concurrency", type=int, default=4)
    parser.add_argument("--churn-interval-s", type=float, default=2.0)
    parser.add_argument("--rss-interval-s", type=float, default=1.0)
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    result = asyncio.run(soak(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if result["mismatches"] or not result["conductor_exit_ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
