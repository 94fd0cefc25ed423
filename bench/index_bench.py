"""The in-process index against NVIDIA Dynamo's Rust ``RadixTree``, side by side, no sockets.

``python -m bench.index_bench [--quick] [--json PATH] [--no-dynamo]``

Ours is driven through its real entry points: ``PrefixCacheTable.apply`` with decoded
batches of ``BlockStored`` events that carry token ids (so every ingested block is hashed,
as the service does), ``match_tokens`` for a prompt (hashing included) and
``PrefixContext.match`` for the walk alone; ``ours-wire`` is the same index fed the
batches as a vLLM engine's msgpack bytes, through the service's C lane (``pack_batch``,
``apply_packed``), decoding included. Dynamo (``pip install -e '.[index-bench]'``)
is driven through its Python bindings: ``apply_event`` with the JSON ``KvCacheEvent`` they
parse, whose blocks already carry their ``tokens_hash`` (the publisher hashes, so its ingest
figure leaves hashing out; its hashing is timed alone and folded in as a second figure),
``find_matches`` for the walk and ``compute_block_hash_for_seq`` for the prompt's hashes.
Memory is each index built to the same size in a fresh subprocess.
What the figures mean: bench/README.md; what was measured and found:
bench/results/index-vs-dynamo.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bench.harness import CpuSample, percentile, rss_bytes
from conductor.hashing import prefix_hashes
from conductor.index import ApplyStats, ContextKey, PrefixCacheTable, StreamSource
from conductor.wire import pack_batch
from conductor.wire.events import BlockRemoved, BlockStored, Event, EventBatch
from publishers.encoding import encode_batch

BLOCK_SIZE = 16
BLOCKS_PER_EVENT = 16  # one prompt of 256 tokens per event, as the service benchmark sends
EVENTS_PER_BATCH = 20
PROMPT_BLOCKS = 256  # the query: 4,096 tokens
DEEPEST = 128  # instance 0 holds the prompt's first 128 blocks, the others shorter prefixes
VOCAB = list(range(32_000))  # shared int objects: the workload's own memory stays small
CONTEXT = ContextKey("default", "bench-model", "", BLOCK_SIZE)
REPO = Path(__file__).resolve().parent.parent
DEFAULT_JSON = REPO / "bench" / "results" / "index.json"


@dataclass(frozen=True)
class Sizes:
    ingest_blocks: int
    runs: int
    query_blocks: int  # unrelated blocks indexed around the query prompt's prefixes
    queries: int
    memory_blocks: int


FULL = Sizes(ingest_blocks=320_000, runs=3, query_blocks=100_000, queries=3_000,
             memory_blocks=1_000_000)  # fmt: skip
QUICK = Sizes(ingest_blocks=16_000, runs=2, query_blocks=5_000, queries=200, memory_blocks=20_000)


@dataclass(frozen=True)
class Prompt:
    """One stored event's content: its tokens and the engine's hash of each block."""

    tokens: list[int]
    engine_hashes: list[int]


def prompts(rng: random.Random, count: int, blocks: int = BLOCKS_PER_EVENT) -> Iterator[Prompt]:
    """Distinct prompts (random tokens) with unique unsigned 64-bit engine hashes."""
    for _ in range(count):
        tokens = rng.choices(VOCAB, k=blocks * BLOCK_SIZE)
        yield Prompt(tokens, [rng.getrandbits(64) for _ in range(blocks)])


class Index(Protocol):
    """What the benchmark needs of an index: one adapter per implementation."""

    name: str
    includes_hashing: bool

    def stored(self, instance: int, batch: Sequence[Prompt]) -> Any: ...
    def removed(self, instance: int, batch: Sequence[Prompt]) -> Any: ...
    def apply(self, instance: int, payload: Any) -> None: ...
    def settle(self) -> None: ...
    def hash(self, tokens: list[int]) -> list[int]: ...
    def walk(self, hashes: list[int]) -> dict[int, int]: ...
    def query(self, tokens: list[int]) -> dict[int, int]: ...


class Ours:
    """``PrefixCacheTable`` fed decoded batches, as the subscriber hands them over."""

    name = "ours"
    includes_hashing = True

    def __init__(self, instances: int) -> None:
        self.table = PrefixCacheTable()
        tenant, model = CONTEXT.tenant_id, CONTEXT.model_name
        for i in range(instances):
            self.table.add_stream(StreamSource(f"s{i}", f"i{i}", tenant, model, "", BLOCK_SIZE))

    def stored(self, instance: int, batch: Sequence[Prompt]) -> Any:
        events: list[Event] = [BlockStored(p.engine_hashes, None, p.tokens) for p in batch]
        return f"s{instance}", EventBatch(0.0, events)

    def removed(self, instance: int, batch: Sequence[Prompt]) -> Any:
        return f"s{instance}", EventBatch(0.0, [BlockRemoved(p.engine_hashes) for p in batch])

    def apply(self, instance: int, payload: Any) -> None:
        stats = self.table.apply(*payload)
        if stats.dropped or stats.orphaned:
            raise RuntimeError(f"ours dropped events: {stats}")

    def settle(self) -> None:
        """Nothing runs behind the caller's back."""

    def hash(self, tokens: list[int]) -> list[int]:
        return prefix_hashes(tokens, BLOCK_SIZE)

    def walk(self, hashes: list[int]) -> dict[int, int]:
        return _blocks(self.table.contexts[CONTEXT].match(hashes))  # type: ignore[arg-type]

    def query(self, tokens: list[int]) -> dict[int, int]:
        return _blocks(self.table.match_tokens(CONTEXT, tokens) or {})


class OursWire(Ours):
    """``Ours`` fed each batch as a vLLM engine sends it (msgpack bytes), the service's way:
    through the C lane, or decoded when the lane declines it. The figure to set against
    Dynamo's, whose events are parsed from JSON bytes too."""

    name = "ours-wire"

    def __init__(self, instances: int) -> None:
        super().__init__(instances)
        primer = [0] * BLOCK_SIZE  # the lane takes a stream once its engine slot exists
        for i in range(instances):
            self.table.apply(f"s{i}", EventBatch(0.0, [BlockStored([2**63 + i], None, primer)]))

    def stored(self, instance: int, batch: Sequence[Prompt]) -> Any:
        key, events = super().stored(instance, batch)
        return key, encode_batch(events.events, 0.0, None)

    def removed(self, instance: int, batch: Sequence[Prompt]) -> Any:
        key, events = super().removed(instance, batch)
        return key, encode_batch(events.events, 0.0, None)

    def apply(self, instance: int, payload: Any) -> None:
        key, wire = payload
        stats = ApplyStats()
        packed = pack_batch(wire, b"", BLOCK_SIZE)
        if packed is None or self.table.apply_packed(key, packed, 0, stats) != len(packed):
            raise RuntimeError("the C lane declined a plain vLLM batch")
        if stats.dropped or stats.orphaned:
            raise RuntimeError(f"ours dropped events: {stats}")


def _blocks(matches: dict[str, Any]) -> dict[int, int]:
    return {int(name[1:]): match.gpu // BLOCK_SIZE for name, match in matches.items()}


class Dynamo:
    """Dynamo's ``RadixTree`` through its Python bindings (``dynamo._core``)."""

    name = "dynamo"
    includes_hashing = False

    def __init__(self, instances: int) -> None:
        from dynamo._core import RadixTree, compute_block_hash_for_seq

        self.tree = RadixTree()
        self._hash = compute_block_hash_for_seq
        self._event_id = 0

    def _event(self, data: Any) -> bytes:
        self._event_id += 1
        return json.dumps({"event_id": self._event_id, "data": data}).encode()

    def stored(self, instance: int, batch: Sequence[Prompt]) -> Any:
        events = []
        for p in batch:
            local = self._hash(p.tokens, BLOCK_SIZE)
            pairs = zip(p.engine_hashes, local, strict=True)
            blocks = [{"block_hash": e, "tokens_hash": t} for e, t in pairs]
            events.append(self._event({"stored": {"parent_hash": None, "blocks": blocks}}))
        return events

    def removed(self, instance: int, batch: Sequence[Prompt]) -> Any:
        return [self._event({"removed": {"block_hashes": p.engine_hashes}}) for p in batch]

    def apply(self, instance: int, payload: Any) -> None:
        apply_event = self.tree.apply_event
        for event in payload:
            apply_event(instance, event)

    def settle(self) -> None:
        """Its tree lives behind a thread: a lookup returns after every queued event."""
        self.tree.find_matches([0])

    def hash(self, tokens: list[int]) -> list[int]:
        return list(self._hash(tokens, BLOCK_SIZE))

    def walk(self, hashes: list[int]) -> dict[int, int]:
        return {worker: n for (worker, _rank), n in self.tree.find_matches(hashes).scores.items()}

    def query(self, tokens: list[int]) -> dict[int, int]:
        return self.walk(self.hash(tokens))


def dynamo_version() -> str | None:
    """The installed bindings' version, None when Dynamo is not importable."""
    try:
        from importlib.metadata import version

        import dynamo._core  # noqa: F401
    except ImportError:
        return None
    return version("ai-dynamo-runtime")


INDEXES: dict[str, Callable[[int], Index]] = {"ours": Ours, "ours-wire": OursWire, "dynamo": Dynamo}


def make_index(name: str, instances: int) -> Index:
    return INDEXES[name](instances)


def payloads(
    index: Index, workload: list[Prompt], instances: int, build: Callable[..., Any]
) -> list[tuple[int, Any]]:
    """The workload in batches, dealt round-robin to the instances, ready to apply."""
    step = EVENTS_PER_BATCH
    return [
        (n % instances, build(n % instances, workload[start : start + step]))
        for n, start in enumerate(range(0, len(workload), step))
    ]


def timed_apply(index: Index, batches: list[tuple[int, Any]]) -> float:
    start = time.perf_counter()
    for instance, payload in batches:
        index.apply(instance, payload)
    index.settle()
    return time.perf_counter() - start


def throughput(name: str, instances: int, sizes: Sizes) -> dict[str, Any]:
    """Ingest then remove ``ingest_blocks`` on a fresh index per run: blocks/s, each run."""
    workload = list(prompts(random.Random(1), sizes.ingest_blocks // BLOCKS_PER_EVENT))
    ingest, removal = [], []
    for _ in range(sizes.runs):
        index = make_index(name, instances)
        stored = payloads(index, workload, instances, index.stored)
        removed = payloads(index, workload, instances, index.removed)
        gc.collect()
        ingest.append(sizes.ingest_blocks / timed_apply(index, stored))
        removal.append(sizes.ingest_blocks / timed_apply(index, removed))
        if any(index.walk(index.hash(workload[-1].tokens)).values()):
            raise RuntimeError(f"{name}: blocks left after removing every one")
        del index, stored, removed
    return {"ingest": _rates(ingest), "removal": _rates(removal)}


def _rates(runs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(runs), "best": max(runs), "runs": runs}


def query_index(name: str, instances: int, sizes: Sizes) -> tuple[Index, list[int]]:
    """``query_blocks`` unrelated blocks plus a 4,096-token prompt whose first 128, 112, …
    blocks the instances hold (a shared system prompt): the walk is 129 blocks deep."""
    rng = random.Random(2)
    index = make_index(name, instances)
    prompt = next(prompts(rng, 1, PROMPT_BLOCKS))
    for instance in range(instances):
        depth = DEEPEST - instance * (DEEPEST // max(instances, 1))
        held = Prompt(prompt.tokens[: depth * BLOCK_SIZE], prompt.engine_hashes[:depth])
        index.apply(instance, index.stored(instance, [held]))
    rest = list(prompts(rng, sizes.query_blocks // BLOCKS_PER_EVENT))
    for instance, payload in payloads(index, rest, instances, index.stored):
        index.apply(instance, payload)
    index.settle()
    expected = {i: DEEPEST - i * (DEEPEST // max(instances, 1)) for i in range(instances)}
    if index.query(prompt.tokens) != expected:
        raise RuntimeError(f"{name}: wrong answer {index.query(prompt.tokens)} != {expected}")
    return index, prompt.tokens


def latency(call: Callable[[], object], count: int) -> dict[str, float]:
    """p50/p99/mean in microseconds of ``count`` calls after a tenth as many warm-ups."""
    for _ in range(max(count // 10, 1)):
        call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(count):
        start = clock()
        call()
        samples.append((clock() - start) / 1000)
    samples.sort()
    return {
        "p50_us": percentile(samples, 50),
        "p99_us": percentile(samples, 99),
        "mean_us": statistics.fmean(samples),
    }


def queries(name: str, instances: int, sizes: Sizes) -> dict[str, Any]:
    index, tokens = query_index(name, instances, sizes)
    hashes = index.hash(tokens)
    return {
        "hash_4096": latency(lambda: index.hash(tokens), sizes.queries),
        "walk": latency(lambda: index.walk(hashes), sizes.queries),
        "query_4096": latency(lambda: index.query(tokens), sizes.queries),
    }


# -- memory: each index built in a fresh process ---------------------------------------
def memory_worker(name: str, instances: int, blocks: int, traced: bool) -> dict[str, Any]:
    """Build ``blocks`` blocks in chunks generated on the fly; bytes per block held."""
    rng = random.Random(3)
    index = make_index(name, instances)
    chunk = 1_000  # events generated, applied and dropped at a time
    gc.collect()
    if traced:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if traced else rss_bytes(os.getpid())
    events = blocks // BLOCKS_PER_EVENT
    for start in range(0, events, chunk):
        workload = list(prompts(rng, min(chunk, events - start)))
        for instance, payload in payloads(index, workload, instances, index.stored):
            index.apply(instance, payload)
        del workload
    index.settle()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if traced else rss_bytes(os.getpid())
    return {"bytes": after - before, "bytes_per_block": (after - before) / blocks}


def memory(name: str, instances: int, blocks: int, traced: bool) -> dict[str, Any]:
    """Run ``memory_worker`` in a fresh interpreter, so nothing earlier skews the RSS."""
    command = [sys.executable, "-m", "bench.index_bench", "--memory-worker", name,
               str(instances), str(blocks)] + (["--traced"] if traced else [])  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=900, check=False, cwd=REPO
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory worker {name} failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# -- the run -----------------------------------------------------------------------------
def run(sizes: Sizes, names: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for instances in (1, 8):
        row: dict[str, Any] = {}
        for name in names:
            before = CpuSample.take([os.getpid()])
            cell = {**throughput(name, instances, sizes), **queries(name, instances, sizes)}
            cell["load"] = CpuSample.take([os.getpid()]).load_since(before)
            cell["memory_rss"] = memory(name, instances, sizes.memory_blocks, traced=False)
            if name == "ours":
                cell["memory_traced"] = memory(name, instances, sizes.memory_blocks, traced=True)
            row[name] = cell
        if "dynamo" in row:
            row["dynamo"]["ingest_with_hashing"] = _with_hashing(row["dynamo"])
        results[str(instances)] = row
    return results


def _with_hashing(cell: dict[str, Any]) -> float:
    """Dynamo's median ingest with its publisher's hashing added: 1/(1/rate + hash/block)."""
    per_block = cell["hash_4096"]["p50_us"] / 1e6 / PROMPT_BLOCKS
    return 1 / (1 / cell["ingest"]["median"] + per_block)


def report(results: dict[str, Any], sizes: Sizes) -> None:
    print(f"ingest/removal: {sizes.ingest_blocks:,} blocks, median of {sizes.runs}; "
          f"query: 4,096 tokens over {sizes.query_blocks:,} blocks; memory at "
          f"{sizes.memory_blocks:,} blocks")  # fmt: skip
    head = (f"{'inst':>4} {'index':<7} {'ingest/s':>10} {'+hash/s':>10} {'remove/s':>10} "
            f"{'hash p50':>9} {'walk p50':>9} {'p99':>7} {'query p50':>9} {'p99':>7} "
            f"{'B/blk rss':>9} {'traced':>7} {'bg cpu':>6}")  # fmt: skip
    print(head)
    for instances, row in results.items():
        for name, c in row.items():
            traced = c.get("memory_traced", {}).get("bytes_per_block")
            print(
                f"{instances:>4} {name:<7} {c['ingest']['median']:>10,.0f} "
                f"{c.get('ingest_with_hashing', c['ingest']['median']):>10,.0f} "
                f"{c['removal']['median']:>10,.0f} {c['hash_4096']['p50_us']:>9.1f} "
                f"{c['walk']['p50_us']:>9.1f} {c['walk']['p99_us']:>7.1f} "
                f"{c['query_4096']['p50_us']:>9.1f} {c['query_4096']['p99_us']:>7.1f} "
                f"{c['memory_rss']['bytes_per_block']:>9.0f} "
                f"{'' if traced is None else f'{traced:.0f}':>7} "
                f"{c['load']['other_cores'] + c['load']['steal_cores']:>6.2f}"
            )
    print("  (ours' ingest includes hashing the tokens; Dynamo's does not, '+hash/s' adds its")
    print("   hashing of the same blocks; ours-wire starts from vLLM's msgpack bytes, Dynamo")
    print("   from JSON bytes; times in µs; bg cpu = cores used by others: noise)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every size ~20x smaller")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write")
    parser.add_argument("--no-dynamo", action="store_true", help="ours only")
    parser.add_argument("--memory-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker:
        name, instances, blocks = args.memory_worker
        print(json.dumps(memory_worker(name, int(instances), int(blocks), args.traced)))
        return 0
    sizes = QUICK if args.quick else FULL
    version = None if args.no_dynamo else dynamo_version()
    if version is None and not args.no_dynamo:
        print("Dynamo's bindings are not installed (pip install ai-dynamo-runtime): ours only")
    results = run(sizes, ["ours", "ours-wire"] + (["dynamo"] if version else []))
    report(results, sizes)
    document = {
        "sizes": sizes.__dict__,
        "python": platform.python_version(),
        "dynamo": version,
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
