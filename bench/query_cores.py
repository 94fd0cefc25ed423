"""/query past one thread: the service's query throughput on one CPU and on two, with the
event loop alone and with the query thread (``--query-thread``).

``bench.service_compare`` times one query at a time; this asks what the service does when
several clients query at once. The service is pinned (``taskset -c 0``, or ``0,1``), holds
8 instances' prefixes of the 4,096-token prompt and 100,000 more blocks (built as
``bench.service_compare`` builds them, vLLM's real block hashes), then ``N`` client
processes each send the prompt's query back to back on a keep-alive connection of their
own for a few seconds (msgpack, token ids packed, as the router asks; or the 1-block
query). Reported per variant and client count: queries/s, p50/p99 of each query's round
trip, the service's CPU (cores), and the share the query thread answered (the kernel
spreads connections over the thread's socket and the loop's, ``SO_REUSEPORT``). Every
client checks every answer's status and its first answer's body.

Usage: ``python -m bench.query_cores [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.conductor_bench import MSGPACK_TYPE, msgpack_query_body, query_prompt
from bench.harness import BLOCK_SIZE, CpuSample, latency_summary, machine, write_json
from bench.indexer_services import IndexerService, Ours, answer
from bench.service_compare import (
    BATCH_BLOCKS,
    BatchPool,
    Index,
    expected_answer,
    running,
    wait_applied,
)

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "query-cores.json"
INSTANCES = 8
THREAD_QUERIES = "conductor_query_thread_queries_total"
PLACE_ATTEMPTS = 100  # connections made at most to place one on a side


@dataclass(frozen=True)
class Scale:
    """The sizes of one run."""

    counts: tuple[int, ...]  # clients querying at once, each measured
    seconds: float  # each measurement's
    blocks: int  # the index's, besides the query's prefixes
    ingest_rate: int  # blocks/s while ``loaded_clients`` query
    loaded_clients: int


FULL = Scale((1, 2, 4, 8), 4.0, 100_000, 200_000, 4)
QUICK = Scale((1, 4), 1.0, 100_000, 200_000, 4)


@dataclass(frozen=True)
class Variant:
    name: str
    cpus: str | None  # taskset -c (None: not pinned)
    args: tuple[str, ...]

    @property
    def threaded(self) -> bool:
        return "--query-thread" in self.args


VARIANTS = (
    Variant("loop, 1 CPU", "0", ()),
    Variant("loop, 2 CPUs", "0,1", ()),
    Variant("thread, 1 CPU", "0", ("--query-thread",)),
    Variant("thread, 2 CPUs", "0,1", ("--query-thread",)),
)


def request_bytes(body: bytes) -> bytes:
    head = (
        f"POST /query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {MSGPACK_TYPE}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_answer(sock: socket.socket, buffer: bytearray) -> bytes:
    """One whole answer off ``sock`` (what follows it stays in ``buffer``); its body."""
    while True:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buffer[:end])
            length = int(head.lower().partition(b"content-length:")[2].split(b"\r\n")[0])
            if len(buffer) >= end + 4 + length:
                if not head.startswith(b"HTTP/1.1 200 "):
                    raise RuntimeError(f"not answered 200: {head[:60]!r}")
                body = bytes(buffer[end + 4 : end + 4 + length])
                del buffer[: end + 4 + length]
                return body
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise RuntimeError("the service closed the connection")
        buffer += chunk


def client_main(port: int, request: bytes, seconds: float, pipe: Connection) -> None:
    """Connects (again, as long as the parent asks: it places each connection on the query
    thread or the loop), answers the first answer's body; then from the start the parent
    gives, back to back for ``seconds``: each round trip (ns)."""
    while True:
        pipe.recv()  # connect
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = bytearray()
        sock.sendall(request)
        pipe.send(read_answer(sock, buffer))
        start = pipe.recv()  # None: placed on the wrong side, connect again
        if start is not None:
            break
        sock.close()
    while time.monotonic() < start:
        time.sleep(0.0005)
    samples: list[int] = []
    clock = time.perf_counter_ns
    end = start + seconds
    while time.monotonic() < end:
        t0 = clock()
        sock.sendall(request)
        read_answer(sock, buffer)
        samples.append(clock() - t0)
    sock.close()
    pipe.send(samples)


def place(
    service: IndexerService, pipe: Connection, expected: bytes, on_thread: bool | None
) -> None:
    """The client connected where it should be: the thread's side (``on_thread``), the
    loop's, or wherever (None)."""
    for _ in range(PLACE_ATTEMPTS):
        before = service_metric(service, THREAD_QUERIES) if on_thread is not None else 0.0
        pipe.send("connect")
        if pipe.recv() != expected:
            raise RuntimeError("a client's first answer differs")
        if on_thread is None or (service_metric(service, THREAD_QUERIES) > before) == on_thread:
            return
        pipe.send(None)
    raise RuntimeError(f"no connection landed on the {'thread' if on_thread else 'loop'}")


def measure(
    service: IndexerService,
    request: bytes,
    expected: bytes,
    clients: int,
    seconds: float,
    threaded: bool,
    at_start: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """``clients`` processes querying at once; with the query thread, half of their
    connections (the first one's when alone) on its side and the rest on the loop's."""
    context = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for number in range(clients):
        ours, theirs = context.Pipe()
        process = context.Process(
            target=client_main, args=(service.client.port, request, seconds, theirs)
        )
        process.start()
        place(service, ours, expected, number % 2 == 0 if threaded else None)
        pipes.append(ours)
        processes.append(process)
    thread_before = service_metric(service, THREAD_QUERIES)
    start = time.monotonic() + 0.2
    for pipe in pipes:
        pipe.send(start)
    while time.monotonic() < start:
        time.sleep(0.0005)
    at_start()
    before = CpuSample.take([service.pid])
    samples: list[int] = []
    for pipe in pipes:
        samples += pipe.recv()
    load = CpuSample.take([service.pid]).load_since(before)
    for process in processes:
        process.join(10)
    answered = service_metric(service, THREAD_QUERIES) - thread_before
    return {
        "clients": clients,
        **latency_summary(samples, seconds),
        "service_cores": load["own_cores"],
        "other_cores": load["other_cores"],
        "thread_share": answered / len(samples) if samples else 0.0,
    }


def service_metric(service: IndexerService, name: str) -> float:
    status, body = service.client.raw("GET", "/metrics", b"", "text/plain")
    if status != 200:
        raise RuntimeError(f"/metrics -> {status}")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run_variant(variant: Variant, pool: BatchPool, scale: Scale) -> dict[str, Any]:
    service = Ours(variant.cpus, variant.args, name=variant.name)
    tokens = query_prompt()
    result: dict[str, Any] = {
        "variant": variant.name,
        "cpus": variant.cpus,
        "args": list(variant.args),
    }
    with running(service, INSTANCES, pool) as host:
        index = Index(service, host, pool, INSTANCES, tokens)
        index.blocks = index.events = service.register(host.streams(), host.send_probes)
        index.load_prefixes()
        index.grow_to(scale.blocks)
        for name, prompt in (("4,096 tokens", tokens), ("1 block", tokens[:BLOCK_SIZE])):
            body = msgpack_query_body(prompt)
            expected = service.client.raw("POST", "/query", body, MSGPACK_TYPE)[1]
            blocks = len(prompt) // BLOCK_SIZE
            if answer(service, prompt) != expected_answer(INSTANCES, blocks):
                raise RuntimeError(f"{variant.name}: wrong answer to the {name} query")
            request = request_bytes(body)
            rows = [
                measure(service, request, expected, n, scale.seconds, variant.threaded)
                for n in scale.counts
            ]
            if name == "4,096 tokens":
                rows.append(while_ingesting(index, request, expected, scale, variant.threaded))
            result[name] = rows
            for row in rows:
                print(
                    f"  {variant.name:<15} {name:<13} {row['clients']:>3} clients"
                    f"{', ingesting' if 'ingesting' in row else '            '} "
                    f"{row['requests_per_s']:>8,.0f} q/s  p50 {row['p50_ms']:.3f}  "
                    f"p99 {row['p99_ms']:.3f} ms"
                    f"  service {row['service_cores']:.2f} cores  thread {row['thread_share']:.0%}",
                    flush=True,
                )
    return result


def while_ingesting(
    index: Index, request: bytes, expected: bytes, scale: Scale, threaded: bool
) -> dict[str, Any]:
    """``loaded_clients`` clients while the publisher process sends ``ingest_rate``
    blocks/s; then until the service caught up (every batch applied)."""
    count = max(1, round(scale.ingest_rate * scale.seconds / BATCH_BLOCKS))
    items = index.take(count)

    def pace() -> None:
        index.host.conn.send(("pace", (items, BATCH_BLOCKS / scale.ingest_rate)))

    clients, seconds = scale.loaded_clients, scale.seconds
    row = measure(index.service, request, expected, clients, seconds, threaded, pace)
    paced = index.host.conn.recv()
    wait_applied(index.service, index.pool, items)
    row["ingesting"] = {
        "rate_blocks_per_s": scale.ingest_rate,
        "sent_blocks_per_s": count * BATCH_BLOCKS / (paced["end"] - paced["start"]),
    }
    return row


def run(scale: Scale, variants: Sequence[Variant] = VARIANTS) -> dict[str, Any]:
    pool = BatchPool()
    pool.ensure(int(scale.blocks + scale.ingest_rate * scale.seconds) // BATCH_BLOCKS + 10)
    measured = [run_variant(variant, pool, scale) for variant in variants]
    return {
        "machine": machine(),
        "scale": asdict(scale),
        "instances": INSTANCES,
        "variants": measured,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.query_cores")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if (os.cpu_count() or 1) < 2:
        print("needs 2 CPUs", file=sys.stderr)
        return 1
    print(f"/query on 1 CPU and 2, loop alone and with the query thread: {machine()}")
    write_json(args.json, run(QUICK if args.quick else FULL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
