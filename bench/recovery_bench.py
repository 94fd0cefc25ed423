"""Conductor recovery at scale (issue #28): how long a restarted conductor takes to answer
every ``/query`` of a sample exactly as before, when its publishers' replay buffers have
rolled over and only a snapshot can give the old blocks back.

Every process is real and every wire is loopback: conductor A (``python -m conductor``
with ``snapshot_path``) is fed ``--blocks`` blocks by ``--engines`` publishers
(``publishers.publisher.KVEventPublisher``, vLLM's wire) whose replay buffers hold only
``BUFFER_STEPS`` batches, far fewer than each sends. Then:

1. ``--sample`` prompts (whole published prompts, prefixes of them, prompts that leave
   them, a group's shared system prompt alone, unknown ones) and A's answers to them;
2. a periodic snapshot write of A: its build time and longest event-loop hold (the
   service's own gauges) and the loop lag meanwhile;
3. conductor B started with ``peers=[A]`` and no file: the time from its process start
   until its HTTP answers, and until it answers every sampled ``/query`` as A does
   (goal: 10 s); its peak RSS;
4. A stopped with SIGTERM (its shutdown snapshot), a few batches published while it is
   down (its publishers' buffers still hold them), A restarted from its file: the time
   until it answers the sample exactly as before and the new batches once replayed; the
   snapshot's size per block, its restore time (from A's log) and the peak RSS.

``python -m bench.recovery_bench [--blocks N] [--engines N] [--sample N] [--json PATH]``
prints a table and writes everything to JSON (default ``bench/results/recovery.json``).
It exits 1 when a wait times out or the conductor lost or rejected events; answers that
never match are reported (and fail the goals), not an error.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.conductor_bench import TokenSource, batches, engine_hashes, stored_event
from bench.harness import (
    BATCH_EVENTS,
    BLOCK_SIZE,
    BLOCKS_PER_EVENT,
    EVENT_TOKENS,
    BenchError,
    CpuSample,
    Http,
    deadline_loop,
    machine,
    metric_sum,
    mib,
    register_all,
    rss_bytes,
    write_json,
)
from bench.load_bench import COUNTERS, histogram_delta, json_query, verify
from bench.load_streams import StreamInfo, WorkerStats
from bench.soak import worst_bucket
from conductor.snapshot import read_file
from conductor.wire.events import BlockStored
from publishers.local import LocalService
from publishers.publisher import KVEventPublisher

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "recovery.json"
GOAL_PEER_S = 10.0  # issue #28: a conductor started with a peer answers as it within this
BUFFER_STEPS = 4  # each publisher's replay buffer, in batches: it rolls over many times
LATE_ENGINES = 8  # engines that publish while A is down ...
LATE_BATCHES = 2  # ... this many batches each (<= BUFFER_STEPS: the replay has them)
GROUPS = 8  # engines e, e + 8, ... share a system prompt, as a fleet serving one app would
SHARED_BLOCKS = 32  # that system prompt: 512 tokens
PROMPT_EVENTS = (1, 8)  # a prompt continues the system prompt by 1 to 8 16-block events
SEND_WINDOW_EVENTS = 10_000  # events sent ahead of the conductor at most (~160k blocks)
START_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 120.0  # past this an answer that does not match is reported as such
TENANT = "default"
# the sample's mix (the rest are whole published prompts)
KINDS = (("prefix", 0.2), ("diverging", 0.15), ("shared", 0.05), ("miss", 0.1))


# -- the workload -------------------------------------------------------------------------
@dataclass(frozen=True)
class Query:
    """One sampled prompt and what its owner must match (to check the workload itself)."""

    kind: str
    tokens: list[int]
    engine: int | None  # the engine whose prompt it comes from; None: a miss
    owner_matched: int  # tokens that engine matches


@dataclass
class Workload:
    """Every engine's events: its group's system prompt, then prompts that continue it
    (each a chain of 16-block events), up to its share of the blocks. The sample is drawn
    from the plan first, so only its prompts' tokens are kept."""

    blocks: int
    engines: int
    sample: int
    seed: int = 28
    tokens: TokenSource = field(default_factory=TokenSource)
    shared: list[list[int]] = field(default_factory=list)  # each group's system prompt
    plans: list[list[int]] = field(default_factory=list)  # engine -> prompt lengths (blocks)
    wanted: set[tuple[int, int]] = field(default_factory=set)  # (engine, prompt) sampled
    kept: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # their tokens
    tails: list[int] = field(default_factory=list)  # engine -> its system prompt's last hash
    rng: random.Random = field(init=False)
    picks: list[tuple[str, int, int]] = field(init=False)  # kind, engine, prompt (-1: none)
    last_hash: int = field(init=False, default=0)  # of the last chain made

    def __post_init__(self) -> None:
        rng = self.rng = random.Random(self.seed)
        self.shared = [self._fresh(SHARED_BLOCKS * BLOCK_SIZE) for _ in range(GROUPS)]
        for engine in range(self.engines):
            budget = self.blocks // self.engines + (engine < self.blocks % self.engines)
            budget -= SHARED_BLOCKS
            if budget <= 0:
                raise ValueError(f"each engine needs more than {SHARED_BLOCKS} blocks")
            plan = []
            while budget > 0:
                length = min(budget, BLOCKS_PER_EVENT * rng.randint(*PROMPT_EVENTS))
                plan.append(length)
                budget -= length
            self.plans.append(plan)
        self.picks = [self._pick() for _ in range(self.sample)]
        self.wanted = {(engine, prompt) for kind, engine, prompt in self.picks if engine >= 0}

    def _pick(self) -> tuple[str, int, int]:
        """A sample entry's kind and published prompt (-1, -1: none)."""
        draw, kind = self.rng.random(), "whole"
        for name, share in KINDS:
            if draw < share:
                kind = name
                break
            draw -= share
        if kind == "miss":
            return kind, -1, -1
        engine = self.rng.randrange(self.engines)
        return kind, engine, self.rng.randrange(len(self.plans[engine]))

    def _fresh(self, count: int) -> list[int]:
        """``count`` tokens no published block starts with (each 256 a new prompt id)."""
        made: list[int] = []
        while len(made) < count:
            made += self.tokens.prompt()
        return made[:count]

    def group(self, engine: int) -> int:
        return engine % GROUPS

    def events(self, engine: int) -> Iterator[BlockStored]:
        """The engine's events in order: the system prompt, then each planned prompt."""
        yield from self._chain(self.shared[self.group(engine)], None)
        self.tails.append(self.last_hash)  # engines are started in order
        for number, length in enumerate(self.plans[engine]):
            tokens = self._fresh(length * BLOCK_SIZE)
            if (engine, number) in self.wanted:
                self.kept[(engine, number)] = self.shared[self.group(engine)] + tokens
            yield from self._chain(tokens, self.tails[engine])

    def late_events(self, engine: int, count: int) -> tuple[list[BlockStored], list[int]]:
        """``count`` one-event prompts on the system prompt, and the last one's tokens."""
        made, tokens = [], []
        for _ in range(count):
            tokens = self._fresh(EVENT_TOKENS)
            made += list(self._chain(tokens, self.tails[engine]))
        return made, self.shared[self.group(engine)] + tokens

    def _chain(self, tokens: list[int], parent: int | None) -> Iterator[BlockStored]:
        """A prompt's blocks as 16-block events, each the child of the one before."""
        hashes = engine_hashes(len(tokens) // BLOCK_SIZE)
        for start in range(0, len(hashes), BLOCKS_PER_EVENT):
            chunk = hashes[start : start + BLOCKS_PER_EVENT]
            span = tokens[start * BLOCK_SIZE : (start + len(chunk)) * BLOCK_SIZE]
            yield stored_event(chunk, span, parent)
            parent = chunk[-1]
        self.last_hash = hashes[-1]

    def queries(self) -> list[Query]:
        """The sample, once every engine's events were made."""
        made = []
        shared_tokens = SHARED_BLOCKS * BLOCK_SIZE
        for kind, engine, number in self.picks:
            if kind == "miss":
                made.append(Query(kind, self._fresh(self.rng.randint(1, 64) * 16), None, 0))
                continue
            prompt = self.kept[(engine, number)]
            if kind == "whole":
                made.append(Query(kind, prompt, engine, len(prompt)))
            elif kind == "prefix":  # cut anywhere, mostly inside a block
                cut = self.rng.randint(1, len(prompt) - 1)
                made.append(Query(kind, prompt[:cut], engine, cut - cut % BLOCK_SIZE))
            elif kind == "diverging":  # the prompt up to a block, then something new
                kept = BLOCK_SIZE * self.rng.randint(1, len(prompt) // BLOCK_SIZE - 1)
                tail = self._fresh(self.rng.randint(1, 32) * BLOCK_SIZE)
                made.append(Query(kind, prompt[:kept] + tail, engine, kept))
            else:  # the system prompt alone, whole or cut
                cut = self.rng.randint(1, shared_tokens)
                made.append(Query(kind, prompt[:cut], engine, cut - cut % BLOCK_SIZE))
        return made


@dataclass
class Engine:
    """One engine's publisher with a small replay buffer, and its registration."""

    number: int
    publisher: KVEventPublisher
    sent: int = 0  # batches

    @property
    def info(self) -> StreamInfo:
        replay = self.publisher.replay_endpoint
        assert replay is not None
        return StreamInfo(f"engine-{self.number}", self.publisher.endpoint, replay)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    def registration(self) -> dict[str, Any]:
        return self.info.registration()


def start_engines(count: int) -> list[Engine]:
    loopback = "tcp://127.0.0.1:0"
    return [
        Engine(n, KVEventPublisher(loopback, loopback, buffer_steps=BUFFER_STEPS, bind=True))
        for n in range(count)
    ]


def publish(engines: Sequence[Engine], batches_of: list[list[Sequence[BlockStored]]]) -> int:
    """One batch per engine that has one left; returns the events published."""
    events = 0
    for engine, pending in zip(engines, batches_of, strict=True):
        if pending:
            batch = pending.pop(0)
            engine.publisher.publish(batch)
            engine.sent += 1
            events += len(batch)
    return events


def ingest(client: Http, engines: Sequence[Engine], workload: Workload) -> dict[str, Any]:
    """Every engine's events, round-robin, at most ``SEND_WINDOW_EVENTS`` ahead of the
    conductor; returns what was sent and how fast the conductor applied it."""
    streams = [batches(list(workload.events(e.number)), BATCH_EVENTS) for e in engines]
    queues: list[list[Sequence[BlockStored]]] = [list(s) for s in streams]
    sent = WorkerStats()
    sent.events = sum(len(b) for s in streams for b in s)
    sent.blocks_stored = sum(len(e.block_hashes) for s in streams for b in s for e in b)
    sent.batches = sum(len(s) for s in streams)
    started = time.monotonic()
    published = 0
    while any(queues):
        published += publish(engines, queues)
        if published - applied_events(client) > SEND_WINDOW_EVENTS:
            for _ in deadline_loop(60, "the conductor to keep up", 0.01):
                if published - applied_events(client) <= SEND_WINDOW_EVENTS // 2:
                    break
    for _ in deadline_loop(120, f"{sent.events:,} events to be applied", 0.02):
        if applied_events(client) >= sent.events:
            break
    seconds = time.monotonic() - started
    seen = verify(client, sent)
    return {
        "events": sent.events,
        "blocks": sent.blocks_stored,
        "batches": sent.batches,
        "seconds": seconds,
        "blocks_per_s": sent.blocks_stored / seconds,
        "counters": seen,
    }


def applied_events(client: Http) -> float:
    return metric_sum(client.metrics(), COUNTERS["events"])


# -- conductors ---------------------------------------------------------------------------
@dataclass
class Conductor:
    """A ``python -m conductor`` process, and when it was started (monotonic)."""

    service: LocalService
    started: float
    started_wall: datetime  # local time, as the log's
    client: Http | None = None

    @classmethod
    def start(cls, run_dir: Path, name: str, *flags: str) -> Conductor:
        config = run_dir / "conductor_config.json"
        config.write_text("{}")
        started, started_wall = time.monotonic(), datetime.now()
        service = LocalService(run_dir, name, "conductor", "--config", str(config), *flags)
        return cls(service, started, started_wall)

    @property
    def pid(self) -> int:
        return self.service.process.pid

    def wait_http(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds from the process start until ``/health`` answers 200."""
        client = Http(self.service.port, timeout=5.0)
        for _ in deadline_loop(timeout, f"{self.service.name} to answer HTTP", 0.005):
            if self.service.process.poll() is not None:
                raise BenchError(f"{self.service.name} exited:\n{self.service.log_tail()}")
            try:
                if client.raw("GET", "/health")[0] == 200:
                    break
            except (OSError, http.client.HTTPException):
                continue
        self.client = client
        return time.monotonic() - self.started

    @property
    def http(self) -> Http:
        assert self.client is not None, "wait_http first"
        return self.client

    def metric(self, name: str) -> float:
        return metric_sum(self.http.metrics(), name)

    def peak_rss(self) -> int:
        """VmHWM: the most the process ever had resident."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise ProcessLookupError(self.pid)

    def stop(self) -> float:
        """SIGTERM (which writes the shutdown snapshot), seconds until it exited."""
        if self.client is not None:
            self.client.close()
        return self.service.stop(timeout=30.0)


def ask(client: Http, tokens: list[int]) -> Any:
    status, data = client.raw("POST", "/query", json_query(tokens))
    if status != 200:
        raise BenchError(f"/query -> {status}: {data[:300]!r}")
    return json.loads(data)


def matched(answer: Any, instance_id: str) -> int:
    return int(answer.get(TENANT, {}).get(instance_id, {}).get("longest_matched", 0))


def check_answers(workload: Workload, queries: Sequence[Query], got: Sequence[Any]) -> None:
    """The workload is what the bench thinks it is: each query's owner matches what it
    published, and its group's other engines the system prompt at most."""
    for query, answer in zip(queries, got, strict=True):
        if query.engine is None:
            wrong = [name for name in answer.get(TENANT, {}) if matched(answer, name)]
        else:
            mates = min(query.owner_matched, SHARED_BLOCKS * BLOCK_SIZE)
            wrong = [
                f"engine-{e}"
                for e in range(workload.engines)
                if matched(answer, f"engine-{e}")
                != (
                    query.owner_matched
                    if e == query.engine
                    else mates
                    if workload.group(e) == workload.group(query.engine)
                    else 0
                )
            ]
        if wrong:
            raise BenchError(f"a {query.kind} query is answered unexpectedly for {wrong[:4]}")


def until_answered(
    conductor: Conductor, prompts: Sequence[list[int]], expected: Sequence[Any]
) -> dict[str, Any]:
    """Ask each prompt again until its answer equals the expected one; the time (from the
    process start) when the last one did, then one more pass over all of them."""
    pending = list(range(len(prompts)))
    passes = 0
    end = time.monotonic() + ANSWER_TIMEOUT_S
    while pending and time.monotonic() < end:
        passes += 1
        pending = [i for i in pending if ask(conductor.http, prompts[i]) != expected[i]]
        if pending:
            time.sleep(0.01)
    answered_s = time.monotonic() - conductor.started
    final = [ask(conductor.http, prompt) for prompt in prompts]
    different = [i for i, answer in enumerate(final) if answer != expected[i]]
    return {
        "all_matched": not pending and not different,
        "answered_s": answered_s if not pending else None,
        "passes": passes,
        "mismatched": len(set(pending) | set(different)),
    }


# -- snapshot figures ---------------------------------------------------------------------
SNAPSHOT_GAUGES = {
    "bytes": "conductor_snapshot_bytes",
    "blocks": "conductor_snapshot_blocks",
    "build_s": "conductor_snapshot_build_seconds",
    "longest_step_s": "conductor_snapshot_longest_step_seconds",
    "written_at": "conductor_snapshot_written_timestamp_seconds",
}


def snapshot_gauges(metrics: str) -> dict[str, float]:
    return {key: metric_sum(metrics, name) for key, name in SNAPSHOT_GAUGES.items()}


def periodic_write(conductor: Conductor, interval_s: float) -> dict[str, Any]:
    """The next periodic write after now: the service's gauges for its build, and the
    worst loop lag (bucket) between before it and after it."""
    before = conductor.http.metrics()
    marker = time.time()
    for _ in deadline_loop(interval_s + 60, "a periodic snapshot write", 0.05):
        after = conductor.http.metrics()
        if metric_sum(after, SNAPSHOT_GAUGES["written_at"]) > marker:
            break
    figures = snapshot_gauges(after)
    figures["loop_lag_worst_bucket_s"] = worst_bucket(histogram_delta(before, after)) or 0.0
    return figures


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
# start-up log lines: the snapshot read (fetched or loaded, and parsed), its registrations
# made and blocks restored, the HTTP socket serving
LOG_STEPS = {"chosen": "snapshot chosen", "restored": "snapshot restored", "listening": "listening"}


def log_steps(conductor: Conductor) -> dict[str, float | None]:
    """Seconds from the process start to each ``LOG_STEPS`` line of its log (the log's
    clock has milliseconds; None: no such line)."""
    found: dict[str, float | None] = dict.fromkeys(LOG_STEPS)
    for line in conductor.service.log().splitlines():
        match = _LOG_TIME.match(line)
        for step, text in LOG_STEPS.items():
            if match and found[step] is None and text in line:
                at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
                found[step] = (at - conductor.started_wall).total_seconds()
    return found


def restart_figures(conductor: Conductor, http_s: float) -> dict[str, Any]:
    steps = log_steps(conductor)
    chosen, restored = steps["chosen"], steps["restored"]
    return {
        "http_s": http_s,
        "log_s": steps,
        # from the snapshot read until its blocks are back in the index
        "restore_s": restored - chosen if chosen is not None and restored is not None else None,
        "restored_blocks": conductor.metric("conductor_snapshot_restored_blocks"),
    }


# -- the run ------------------------------------------------------------------------------
def run(blocks: int, engines_count: int, sample: int, interval_s: float) -> dict[str, Any]:
    result: dict[str, Any] = {
        "options": {
            "blocks": blocks,
            "engines": engines_count,
            "sample": sample,
            "snapshot_interval_s": interval_s,
            "buffer_steps": BUFFER_STEPS,
        },
        "machine": machine(),
    }
    workload = Workload(blocks, engines_count, sample)
    before, own_before = CpuSample.take([]), _own_cpu()
    engines = start_engines(engines_count)
    conductors: list[Conductor] = []
    try:
        with tempfile.TemporaryDirectory(prefix="conductor-recovery-") as tmp:
            run_dir = Path(tmp)
            result |= phases(run_dir, workload, engines, conductors, interval_s)
    finally:
        for conductor in conductors:
            conductor.service.kill()
        for engine in engines:
            engine.publisher.close()
    load = CpuSample.take([]).load_since(before)
    wall = max(time.monotonic() - before.wall, 1e-9)
    # the machine's busy cores minus this process and its (reaped) conductors: noise
    result["background_cores"] = max(0.0, load["other_cores"] - (_own_cpu() - own_before) / wall)
    result["steal_cores"] = load["steal_cores"]
    result["load_average_after"] = os.getloadavg()
    return result


def _own_cpu() -> float:
    """CPU seconds of this process and of its children that exited."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def phases(
    run_dir: Path,
    workload: Workload,
    engines: list[Engine],
    conductors: list[Conductor],
    interval_s: float,
) -> dict[str, Any]:
    snapshot_path = run_dir / "a.snapshot"
    a_flags = (
        "--snapshot-path",
        str(snapshot_path),
        "--snapshot-interval-s",
        str(interval_s),
        "--state-file",
        str(run_dir / "a.state.json"),
    )
    result: dict[str, Any] = {}

    print(f"conductor A: {len(engines)} engines, {workload.blocks:,} blocks ...", flush=True)
    a = Conductor.start(run_dir, "conductor-a", *a_flags)
    conductors.append(a)
    result["empty_start_http_s"] = a.wait_http()
    register_all(a.http, engines)
    result["ingest"] = ingest(a.http, engines, workload)
    rolled = [e.instance_id for e in engines if e.sent <= BUFFER_STEPS]
    if rolled:
        raise BenchError(f"replay buffers did not roll over on {rolled[:4]}: use more blocks")
    result["a_rss_bytes"] = rss_bytes(a.pid)

    queries = workload.queries()
    prompts = [q.tokens for q in queries]
    began = time.monotonic()
    expected = [ask(a.http, prompt) for prompt in prompts]
    result["sample_pass_s"] = time.monotonic() - began  # one pass, sequential: a floor
    check_answers(workload, queries, expected)
    result["sample"] = dict(sorted(_count(q.kind for q in queries).items()))

    print("periodic snapshot write ...", flush=True)
    result["periodic_write"] = write = periodic_write(a, interval_s)

    print("conductor B from peer A ...", flush=True)
    b = Conductor.start(run_dir, "conductor-b", "--peers", a.service.url, "--state-file", "")
    conductors.append(b)
    peer = restart_figures(b, b.wait_http())
    peer |= until_answered(b, prompts, expected)
    peer["peak_rss_bytes"], peer["rss_bytes"] = b.peak_rss(), rss_bytes(b.pid)
    peer["gaps_unrepaired"] = b.metric(COUNTERS["gaps_unrepaired"])
    served = snapshot_gauges(a.http.metrics())  # the build B fetched, unless A wrote since
    peer["served_build"] = served if served["written_at"] == write["written_at"] else None
    result["peer"] = peer
    b.stop()

    print("conductor A from its own snapshot ...", flush=True)
    result["shutdown_s"] = a.stop()
    snapshot = read_file(snapshot_path)
    behind = [key for key, seq in _sequences(engines).items() if snapshot.sequences.get(key) != seq]
    if behind:
        raise BenchError(f"the shutdown snapshot misses batches of {behind[:4]}")
    size = snapshot_path.stat().st_size
    result["snapshot"] = {
        "bytes": size,
        "blocks": snapshot.block_count(),
        "bytes_per_block": size / snapshot.block_count(),
    }
    late_prompts = []
    for engine in engines[:LATE_ENGINES]:  # while A is down: only the replay delivers them
        for _ in range(LATE_BATCHES):
            events, tokens = workload.late_events(engine.number, BATCH_EVENTS)
            engine.publisher.publish(events)
            engine.sent += 1
            late_prompts.append((engine.number, tokens))
    for engine in engines:
        if not engine.publisher.flush(10.0):
            raise BenchError(f"{engine.instance_id} did not send its batches")
    late_expected = [late_answer(workload, number, tokens) for number, tokens in late_prompts]

    restarted = Conductor.start(run_dir, "conductor-a2", *a_flags)
    conductors.append(restarted)
    own = restart_figures(restarted, restarted.wait_http())
    # the few late prompts first: their time is the replays', not the sample pass's
    late = until_late(restarted, late_prompts, late_expected)
    own |= until_answered(restarted, prompts, expected)
    own |= {"late_batches": len(late_prompts), "late": late}
    times = (own["answered_s"], late["answered_s"])
    own["recovered_s"] = None if None in times else max(times)  # both, as the issue asks
    own["peak_rss_bytes"], own["rss_bytes"] = restarted.peak_rss(), rss_bytes(restarted.pid)
    own["replayed_batches"] = restarted.metric(COUNTERS["replayed_batches"])
    own["gaps_unrepaired"] = restarted.metric(COUNTERS["gaps_unrepaired"])
    result["own"] = own
    restarted.stop()
    result["goals"] = goals(result)
    return result


def late_answer(workload: Workload, engine: int, tokens: list[int]) -> dict[str, int]:
    """Each engine's ``longest_matched`` for a prompt published while A was down."""
    shared = SHARED_BLOCKS * BLOCK_SIZE
    group = workload.group(engine)
    return {
        f"engine-{e}": len(tokens) if e == engine else shared if workload.group(e) == group else 0
        for e in range(workload.engines)
    }


def until_late(
    conductor: Conductor,
    prompts: list[tuple[int, list[int]]],
    expected: list[dict[str, int]],
) -> dict[str, Any]:
    """The time (from the process start) until every late batch's last prompt is answered
    as its engines hold it: the replays applied."""

    def answered(i: int) -> bool:
        answer = ask(conductor.http, prompts[i][1])
        return {name: matched(answer, name) for name in expected[i]} == expected[i]

    pending = list(range(len(prompts)))
    end = time.monotonic() + ANSWER_TIMEOUT_S
    while pending and time.monotonic() < end:
        pending = [i for i in pending if not answered(i)]
        if pending:
            time.sleep(0.01)
    return {
        "all_matched": not pending,
        "answered_s": time.monotonic() - conductor.started if not pending else None,
        "mismatched": len(pending),
    }


def _sequences(engines: Sequence[Engine]) -> dict[str, int]:
    """Each stream's last batch, by the conductor's service key."""
    return {f"{e.instance_id}|{TENANT}|0": e.sent - 1 for e in engines}


def _count(kinds: Iterator[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def goals(result: dict[str, Any]) -> dict[str, bool]:
    peer, own = result["peer"], result["own"]
    return {
        "peer_within_10s": bool(
            peer["all_matched"]
            and peer["answered_s"] is not None
            and peer["answered_s"] <= GOAL_PEER_S
        ),
        "own_snapshot_exact": bool(own["all_matched"] and own["late"]["all_matched"]),
    }


# -- output -------------------------------------------------------------------------------
def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.1f} ms"


def print_report(result: dict[str, Any]) -> None:
    options, ingested = result["options"], result["ingest"]
    write, peer, own, snap = result["periodic_write"], result["peer"], result["own"], None
    snap = result["snapshot"]
    mark = {True: "met", False: "NOT met"}
    rows = [
        ("indexed blocks / engines", f"{ingested['blocks']:,} / {options['engines']}"),
        ("ingest (incl. pacing)", f"{ingested['blocks_per_s']:,.0f} blocks/s"),
        ("sample", ", ".join(f"{k} {v}" for k, v in result["sample"].items())),
        ("RSS of A after ingest", f"{mib(result['a_rss_bytes'])} MiB"),
        ("empty conductor: start to HTTP", _s(result["empty_start_http_s"])),
        ("one pass of the sample's /query on A", _s(result["sample_pass_s"])),
        ("snapshot size", f"{mib(snap['bytes'])} MiB, {snap['bytes_per_block']:.1f} B/block"),
        ("periodic write: build (gauge)", _s(write["build_s"])),
        ("  longest loop hold (gauge)", _ms(write["longest_step_s"])),
        ("  loop lag, worst bucket", f"<= {_ms(write['loop_lag_worst_bucket_s'])}"),
        ("A's shutdown (SIGTERM, writes it)", _s(result["shutdown_s"])),
        ("peer B: start to snapshot read (log)", _s(peer["log_s"]["chosen"])),
        ("  restore (log: read->restored)", _s(peer["restore_s"])),
        ("  start to HTTP", _s(peer["http_s"])),
        ("  start to every answer as A's", _s(peer["answered_s"])),
        ("  answers matched", f"{peer['all_matched']} ({peer['mismatched']} differ)"),
        ("  RSS peak / after", f"{mib(peer['peak_rss_bytes'])} / {mib(peer['rss_bytes'])} MiB"),
        ("A from its file: start to read (log)", _s(own["log_s"]["chosen"])),
        ("  restore (log: read->restored)", _s(own["restore_s"])),
        ("  start to HTTP", _s(own["http_s"])),
        ("  start to late batches answered", _s(own["late"]["answered_s"])),
        ("  start to every answer as before", _s(own["answered_s"])),
        (
            "  answers matched",
            f"{own['all_matched']} ({own['mismatched']} differ), late "
            f"{own['late']['all_matched']} ({own['replayed_batches']:.0f} batches replayed)",
        ),
        ("  RSS peak / after", f"{mib(own['peak_rss_bytes'])} / {mib(own['rss_bytes'])} MiB"),
        (
            "other processes' CPU meanwhile",
            f"{result['background_cores']:.2f} cores (steal {result['steal_cores']:.2f})",
        ),
        ("goal: peer answers as A within 10 s", mark[result["goals"]["peer_within_10s"]]),
        ("goal: own snapshot + replays exact", mark[result["goals"]["own_snapshot_exact"]]),
    ]
    width = max(len(name) for name, _ in rows)
    print("\n== conductor recovery")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="blocks to index")
    parser.add_argument("--engines", type=int, default=64, help="publishers")
    parser.add_argument("--sample", type=int, default=1_000, help="prompts queried")
    parser.add_argument(
        "--snapshot-interval", type=float, default=10.0, help="A's snapshot_interval_s"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    args = parser.parse_args(argv)
    if args.engines < 1 or args.sample < 1:
        parser.error("--engines and --sample must be positive")
    needed = args.engines * (SHARED_BLOCKS + BLOCKS_PER_EVENT * BATCH_EVENTS * (BUFFER_STEPS + 1))
    if args.blocks < needed:
        parser.error(f"--blocks must be at least {needed:,} for the buffers to roll over")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args.blocks, args.engines, args.sample, args.snapshot_interval)
    except (BenchError, OSError, http.client.HTTPException) as error:
        print(f"benchmark failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print_report(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
