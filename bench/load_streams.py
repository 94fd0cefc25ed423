"""The load benchmark's publishers: many vLLM event streams driven from a few processes.

A worker process owns a share of the streams. Each stream is what vLLM's
``ZmqEventPublisher`` is on the wire: a PUB socket sending ``[topic, seq (8 B BE), batch]``
and a ROUTER answering replay requests from a buffer of the last batches, so the conductor
can repair any gap. One thread serves all of a worker's streams (a thread per publisher,
as ``publishers.publisher.KVEventPublisher`` has, would make 1,000 streams measure the
GIL), sending each batch at its due time and answering replays while it waits.

Two workloads, both deterministic, each built and encoded inside the worker before the
start (so the parent sends nothing but start and stop, and a worker's CPU during the run
is sending):

* ``PacedWorkload``: every stream sends 20-event batches (16 blocks, 256 tokens each) at a
  fixed aggregate rate, and evicts the oldest ones once its cache is full, so the index
  stays at a steady size; the payloads repeat cyclically, so few are encoded. Streams
  0-7 first store prefixes of one 4,096-token prompt, the query the parent times.
* ``TraceWorkload``: the conversation trace's requests, each on the instance a prefix-
  affine router would pick, cached by an LRU model of that engine's prefix cache
  (``bench.soak.CacheModel``): evictions first, then the new blocks in engine steps of
  ``step_tokens``, sent at the request's arrival time over ``speedup``.

Protocol over a ``multiprocessing`` pipe: the worker sends its streams' ``StreamInfo``
list once they are bound, waits (serving replays) for ``("go", monotonic start)``, runs
its schedule, answers ``"stop"`` with its ``WorkerStats`` (cutting the schedule short if it
is still running) and keeps its streams open, serving replays, until ``"exit"``.
"""

from __future__ import annotations

import hashlib
import itertools
import resource
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from bench.harness import (
    BATCH_EVENTS,
    BLOCK_SIZE,
    BLOCKS_PER_EVENT,
    EVENT_TOKENS,
    PUB_SNDHWM,
    QUERY_BLOCKS,
    engine_hash,
    prefix_holdings,
    vllm_registration,
)
from bench.soak import CacheModel
from bench.trace_sim import TRACE_BLOCK_SIZE, load_trace, prompt_tokens, trace_path
from conductor.wire.events import BlockRemoved, BlockStored, Event
from publishers.encoding import encode_batch
from publishers.publisher import replay_replies

MODEL = "load-model"
REPLAY_BUFFER_BATCHES = 10_000  # vLLM's default buffer_steps
POLL_MS = 50  # longest a replay request waits on an idle worker
TRACE_BLOCKS = TRACE_BLOCK_SIZE // BLOCK_SIZE  # engine blocks per trace hash_id


@dataclass(frozen=True)
class StreamInfo:
    """Where one stream listens; the parent registers it with the conductor."""

    instance_id: str
    endpoint: str
    replay_endpoint: str

    def registration(self) -> dict[str, Any]:
        return vllm_registration(
            self.endpoint, self.instance_id, MODEL, replay_endpoint=self.replay_endpoint
        )


@dataclass
class WorkerStats:
    """What one worker sent; the parent checks the conductor's counters against the sum."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    replays_served: int = 0
    lag_max_s: float = 0.0  # how late the worker sent a batch, at worst
    sent_until_s: float = 0.0  # when the last batch left, relative to the start

    def add(self, batch: Encoded) -> None:
        self.batches += 1
        self.events += batch.events
        self.blocks_stored += batch.stored
        self.blocks_removed += batch.removed


@dataclass(frozen=True, slots=True)
class Encoded:
    """One batch's bytes and what it carries."""

    payload: bytes
    events: int
    stored: int
    removed: int


@dataclass(frozen=True, slots=True)
class Send:
    """A batch due ``due_s`` after the start on stream ``stream`` (a worker-local index)."""

    due_s: float
    stream: int
    batch: Encoded


def shake_tokens(label: str, count: int) -> list[int]:
    """``count`` byte-valued tokens, a pure function of ``label``: equal labels, equal tokens."""
    return list(hashlib.shake_128(label.encode()).digest(count))


def query_prompt() -> list[int]:
    """The 4,096-token prompt whose prefixes streams 0-7 hold (the parent queries it)."""
    return shake_tokens("query", QUERY_BLOCKS * BLOCK_SIZE)


def encoded(events: list[Event]) -> Encoded:
    """A vLLM batch of ``events`` with what it carries, to check the conductor's counters."""
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    return Encoded(encode_batch(events, time.time(), 0), len(events), stored, removed)


class PacedWorkload:
    """Every stream at ``rate_blocks_per_s / streams``, its cache capped at ``capacity``.

    Stream s's batch n stores the events of slot ``n mod 2C`` and, from n = C on, removes
    those of slot ``n - C`` (C = capacity in batches): a slot is stored again only after it
    was evicted, so the payloads repeat with period 2C and are encoded once.
    """

    def __init__(
        self,
        first_stream: int,
        streams: int,
        rate_blocks_per_s: float,
        capacity_blocks: int,
        duration_s: float,
    ) -> None:
        self.streams = streams
        self.duration_s = duration_s
        self.batch_blocks = BATCH_EVENTS * BLOCKS_PER_EVENT
        self.capacity = max(1, capacity_blocks // self.batch_blocks)
        self.interval_s = streams * self.batch_blocks / rate_blocks_per_s  # per stream
        self.payloads = [self._stream_payloads(first_stream + s) for s in range(streams)]

    def _stream_payloads(self, stream: int) -> list[Encoded]:
        """The prefix batch (if any), the C warm-up batches, then the 2C cyclic ones."""
        slots = [self._slot(stream, slot) for slot in range(2 * self.capacity)]
        payloads = self._prefix(stream)
        payloads += [encoded(events) for events in slots[: self.capacity]]
        for n in range(2 * self.capacity):
            evicted = slots[(n - self.capacity) % len(slots)]
            removed = BlockRemoved([h for event in evicted for h in event.block_hashes])
            payloads.append(encoded([removed, *slots[n]]))
        return payloads

    @staticmethod
    def _slot(stream: int, slot: int) -> list[Event]:
        events: list[Event] = []
        for event in range(BATCH_EVENTS):
            label = f"{stream}/{slot}/{event}"
            key = ((stream << 20 | slot * BATCH_EVENTS + event) << 5) + (1 << 62)
            hashes = [engine_hash(key + block) for block in range(BLOCKS_PER_EVENT)]
            events.append(BlockStored(hashes, None, shake_tokens(label, EVENT_TOKENS), BLOCK_SIZE))
        return events

    @staticmethod
    def _prefix(stream: int) -> list[Encoded]:
        """Stream s < 8 holds the query prompt's first blocks, chained, never evicted."""
        blocks = prefix_holdings(stream)
        tokens, events, parent = query_prompt(), list[Event](), None
        for start in range(0, blocks, BLOCKS_PER_EVENT):
            key = (stream << 20 | start) << 5
            hashes = [engine_hash(key + b) for b in range(BLOCKS_PER_EVENT)]
            chunk = tokens[start * BLOCK_SIZE : (start + BLOCKS_PER_EVENT) * BLOCK_SIZE]
            events.append(BlockStored(hashes, parent, chunk, BLOCK_SIZE))
            parent = hashes[-1]
        return [encoded(events)] if events else []

    def _batch(self, stream: int, number: int) -> Encoded:
        """Stream ``stream``'s batch ``number``: its first ones once, then the cycle."""
        payloads = self.payloads[stream]
        once = len(payloads) - 2 * self.capacity
        if number < once:
            return payloads[number]
        return payloads[once + (number - once + self.capacity) % (2 * self.capacity)]

    def sends(self) -> Iterator[Send]:
        """Round-robin over the streams, each one batch per ``interval_s``, staggered."""
        for number in itertools.count():
            for stream in range(self.streams):
                due = (number + stream / self.streams) * self.interval_s
                if due > self.duration_s:
                    return
                yield Send(due, stream, self._batch(stream, number))


def trace_instance(hash_ids: tuple[int, ...], instances: int) -> int:
    """The instance a prefix-affine router sends a request to: by its first block after the
    shared system prompt, which the conversation trace's follow-up turns keep."""
    key = hash_ids[1] if len(hash_ids) > 1 else hash_ids[0]
    return engine_hash(key + 1) % instances


class TraceWorkload:
    """The trace's requests of this worker's instances, as their engines would announce them.

    Engine hashes are a function of (hash_id, 16-token block within it): the trace's ids
    name prefixes, so equal ids are equal blocks with equal parents, as in a real engine.
    """

    def __init__(
        self,
        first_stream: int,
        streams: int,
        instances: int,
        trace: str,
        speedup: float,
        capacity_blocks: int,
        step_tokens: int,
        duration_s: float,
    ) -> None:
        self.requests = []
        for request in load_trace(trace_path(trace)):
            stream = trace_instance(request.hash_ids, instances) - first_stream
            due = request.arrival_s / speedup
            if 0 <= stream < streams and due <= duration_s:
                self.requests.append((due, stream, request))
        self.caches = [CacheModel(str(s), capacity_blocks) for s in range(streams)]
        self.step_blocks = max(1, step_tokens // BLOCK_SIZE)

    def sends(self) -> Iterator[Send]:
        """In arrival order; each request's batches are due at its arrival."""
        for due, stream, request in self.requests:
            tokens = prompt_tokens(request)
            hashes = [
                engine_hash(request.hash_ids[b // TRACE_BLOCKS] << 5 | b % TRACE_BLOCKS)
                for b in range(len(tokens) // BLOCK_SIZE)
            ]
            for events in self._steps(self.caches[stream].admit(hashes, tokens)):
                yield Send(due, stream, encoded(events))

    def _steps(self, events: list[BlockStored | BlockRemoved]) -> Iterator[list[Event]]:
        """The evictions with the first step, the stored blocks ``step_blocks`` a step."""
        pending: list[Event] = [e for e in events if isinstance(e, BlockRemoved)]
        for stored in (e for e in events if isinstance(e, BlockStored)):
            parent = stored.parent_hash
            for start in range(0, len(stored.block_hashes), self.step_blocks):
                hashes = stored.block_hashes[start : start + self.step_blocks]
                tokens = stored.token_ids[start * BLOCK_SIZE : (start + len(hashes)) * BLOCK_SIZE]
                pending.append(BlockStored(hashes, parent, tokens, BLOCK_SIZE))
                yield pending
                pending, parent = [], hashes[-1]
        if pending:
            yield pending


class ReplayStream:
    """One engine's PUB and replay ROUTER, both bound on loopback ports the kernel picks."""

    def __init__(self, context: zmq.Context, instance_id: str) -> None:
        self.instance_id = instance_id
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, PUB_SNDHWM)
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 2 * (REPLAY_BUFFER_BATCHES + 1))
        for socket in (self.pub, self.router):
            socket.setsockopt(zmq.LINGER, 0)
        self.endpoints = [
            f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}"
            for s in (self.pub, self.router)
        ]
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER_BATCHES)
        self.seq = 0

    def info(self) -> StreamInfo:
        return StreamInfo(self.instance_id, *self.endpoints)

    def send(self, payload: bytes) -> None:
        seq = self.seq.to_bytes(8, "big")
        self.pub.send_multipart([b"", seq, payload], copy=False)
        self.buffer.append((self.seq, payload))
        self.seq += 1

    def serve_replay(self) -> None:
        """``[identity, b"", start seq]`` -> every buffered batch from there, then the end
        marker, as vLLM's publisher answers; a malformed request gets no reply."""
        frames = self.router.recv_multipart()
        if len(frames) != 3:
            return
        for reply in replay_replies(frames, self.buffer, b""):
            self.router.send_multipart(reply)

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


@dataclass
class WorkerSpec:
    """What one worker runs: streams ``first_stream`` .. ``first_stream + streams - 1``."""

    first_stream: int
    streams: int
    workload: str  # "paced" or "trace"
    duration_s: float
    options: dict[str, Any] = field(default_factory=dict)  # the workload's own arguments

    def build(self) -> PacedWorkload | TraceWorkload:
        cls = PacedWorkload if self.workload == "paced" else TraceWorkload
        return cls(self.first_stream, self.streams, duration_s=self.duration_s, **self.options)


class Worker:
    """The streams of one process and the loop that feeds them."""

    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # ~6 descriptors a stream
        self.conn = conn
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, 2 * spec.streams + 64)
        self.streams = [
            ReplayStream(self.context, f"{spec.workload}-{spec.first_stream + s}")
            for s in range(spec.streams)
        ]
        self.by_router = {stream.router: stream for stream in self.streams}
        self.poller = zmq.Poller()
        for stream in self.streams:
            self.poller.register(stream.router, zmq.POLLIN)
        self.poller.register(conn.fileno(), zmq.POLLIN)
        # encoded before the start: the run's client CPU is sending, not encoding
        self.schedule = list(spec.build().sends())
        self.stats = WorkerStats()

    def serve(self, timeout_ms: float) -> Any:
        """Answer replay requests for up to ``timeout_ms``; the parent's message, if any."""
        for socket, _ in self.poller.poll(timeout_ms):
            if socket in self.by_router:
                self.by_router[socket].serve_replay()
                self.stats.replays_served += 1
        return self.conn.recv() if self.conn.poll() else None

    def wait_for_parent(self) -> Any:
        while (message := self.serve(POLL_MS)) is None:
            pass
        return message

    def run(self) -> None:
        """Report the streams, feed them from ``("go", start)`` on, answer ``"stop"`` with
        the stats and close at ``"exit"``: a closed stream's blocks leave the index."""
        try:
            self.conn.send([stream.info() for stream in self.streams])
            command = self.wait_for_parent()
            if command == "exit":
                return
            if (
                command == "stop"
                or self.feed(command[1]) == "stop"
                or (self.wait_for_parent() == "stop")
            ):
                self.conn.send(self.stats)
                self.wait_for_parent()
        finally:
            for stream in self.streams:
                stream.close()
            self.context.term()

    def feed(self, start: float) -> str | None:
        """Send every batch at its time (late ones at once), serving replays in between;
        ``"stop"`` if the parent said so meanwhile."""
        for send in self.schedule:
            wait = start + send.due_s - time.monotonic()
            while wait > 0:
                if wait < 0.001:  # zmq polls whole milliseconds: a shorter poll would spin
                    time.sleep(wait)
                elif self.serve(min(wait * 1000, POLL_MS)) == "stop":
                    return "stop"
                wait = start + send.due_s - time.monotonic()
            self.stats.lag_max_s = max(self.stats.lag_max_s, -wait)
            self.streams[send.stream].send(send.batch.payload)
            self.stats.add(send.batch)
        self.stats.sent_until_s = time.monotonic() - start
        return None


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """A worker process's entry point."""
    Worker(spec, conn).run()
