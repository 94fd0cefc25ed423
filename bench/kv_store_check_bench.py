"""What one kv_store check costs the conductor: fetch a store's whole key list, parse it,
drop the evicted blocks from the index.

For 10k, 100k and 1M keys a key server in its own process (aiohttp on 127.0.0.1) answers
``GET /get_all_keys`` as a Mooncake master's admin server does: one vLLM
MooncakeStoreConnector key per line (``model@tp_rank:0@...@<sha256 hex>``, ~110 bytes). The
conductor's index holds those blocks in a kv_store pool plus 5 % more that the store no
longer lists (evicted). A check runs exactly the conductor's code (``check_store``: the key
list over a real aiohttp client, then the evicted blocks dropped), and is verified (keys
seen, blocks dropped) before any number counts. Reported per size: the check's time in
wall and CPU time (median and max of ``--runs``), the fetch and parse alone, the longest
the event loop was held (what a concurrent ``/query`` could wait: wall, which on a busy
machine includes time other processes took the core, and CPU), the peak memory the check
allocates (tracemalloc, separate run) and the staleness bound at the default interval
(interval + the slowest check).

With ``--real-master N`` it also times the real ``mooncake_master`` answering ``/get_all_keys``
for N keys it holds (needs the store wheel; run it in a namespace of its own:
``scripts/isolated-net.sh python -m bench.kv_store_check_bench --real-master 100000``).

    python -m bench.kv_store_check_bench [--quick] [--runs 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from conductor.config import DEFAULT_STORE_CHECK_INTERVAL_S, DEFAULT_STORE_CHECK_SILENCE_S
from conductor.index import PrefixCacheTable, StreamSource
from conductor.kv_store_watch import check_store, check_timeout, fetch_keys
from conductor.wire.events import BlockStored, EventBatch, Tier
from publishers.local import HOST, LocalService

REPO = Path(__file__).resolve().parents[1]
STORE = "127.0.0.1:50051"
BLOCK_SIZE = 16
CHAIN_BLOCKS = 1000  # blocks per announced chain (one BlockStored event)
EVICTED_SHARE = 20  # the pool holds 1/20 more blocks than the store lists: evicted ones
SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (1_000, 10_000, 100_000)
CHECK_TIMEOUT = check_timeout(DEFAULT_STORE_CHECK_SILENCE_S)  # the conductor's, by default


def digest(block: int) -> bytes:
    return hashlib.sha256(block.to_bytes(8, "big")).digest()


def key(block: int) -> str:
    return f"bench-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{digest(block).hex()}"


# -- the key server (a process of its own) -----------------------------------------------------
def serve(keys: int, host: str, port: int) -> None:
    """Blocks ``0 .. keys - 1`` are in the store."""
    body = "".join(f"{key(b)}\n" for b in range(keys)).encode()

    async def all_keys(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/get_all_keys", all_keys)
    web.run_app(app, host=host, port=port, print=None, access_log=None)


def start_server(keys: int, log_dir: Path) -> LocalService:
    """The key server as a process of its own; it listens once its answer is built."""
    server = LocalService(log_dir, "key-server", "bench.kv_store_check_bench", "--serve", str(keys))
    server.wait_ready(timeout=120)
    return server


# -- the conductor side -------------------------------------------------------------------------
def pool_table(blocks: int) -> PrefixCacheTable:
    """An index whose kv_store pool holds ``blocks`` blocks, announced in chains."""
    table = PrefixCacheTable()
    source = StreamSource("e|default|0", "e", "default", "m", "", BLOCK_SIZE, kv_store=STORE)
    table.add_stream(source)
    for first in range(0, blocks, CHAIN_BLOCKS):
        chain = range(first, min(first + CHAIN_BLOCKS, blocks))
        event = BlockStored(
            block_hashes=[int.from_bytes(digest(b)[-8:], "big") for b in chain],
            parent_hash=None,
            token_ids=list(range(first * BLOCK_SIZE, (chain.stop) * BLOCK_SIZE)),
            tier=Tier.CPU,
        )
        table.apply(source.key, EventBatch(timestamp=0.0, events=[event], dp_rank=None))
    assert table.store_blocks() == {STORE: blocks}, table.store_blocks()
    return table


async def one_check(url: str, table: PrefixCacheTable) -> dict[str, float]:
    """The conductor's check, timed, with the longest hold of the event loop beside it:
    in wall time, and in CPU time (what the check itself held, without the time other
    processes on this machine took the core away)."""
    stalls: list[float] = []
    holds: list[float] = []

    async def ticker() -> None:
        while True:
            before, cpu_before = time.perf_counter(), time.process_time()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - before - 0.001)
            holds.append(time.process_time() - cpu_before)

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    async with aiohttp.ClientSession(timeout=CHECK_TIMEOUT) as session:
        started, cpu_started = time.perf_counter(), time.process_time()
        keys, dropped = await check_store(table, session, STORE, url)
        done, cpu_done = time.perf_counter(), time.process_time()
        fetch_s = await fetch_only(session, url)
    ticking.cancel()
    await asyncio.gather(ticking, return_exceptions=True)
    return {
        "keys": keys.keys,
        "unparsable": keys.unparsable,
        "dropped": dropped,
        "check_s": done - started,
        "check_cpu_s": cpu_done - cpu_started,
        "fetch_parse_s": fetch_s,
        "loop_stall_ms": 1000 * max(stalls, default=0.0),
        "loop_hold_cpu_ms": 1000 * max(holds, default=0.0),
    }


async def fetch_only(session: aiohttp.ClientSession, url: str) -> float:
    """The fetch and parse alone (the rest of a check is dropping evicted blocks)."""
    started = time.perf_counter()
    await fetch_keys(session, url)
    return time.perf_counter() - started


async def measure(url: str, keys: int, runs: int) -> dict[str, Any]:
    evicted = keys // EVICTED_SHARE
    blocks = keys + evicted
    timings = []
    for _ in range(runs):
        table = pool_table(blocks)
        gc.collect()
        result = await one_check(url, table)
        assert (result["keys"], result["unparsable"], result["dropped"]) == (keys, 0, evicted)
        assert table.store_blocks() == {STORE: keys}
        timings.append(result)
        del table
    table = pool_table(blocks)
    gc.collect()
    tracemalloc.start()
    await one_check(url, table)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    checks = [t["check_s"] for t in timings]
    body_mb = sum(len(key(b)) + 1 for b in range(keys)) / 1e6
    return {
        "keys": keys,
        "pool_blocks": blocks,
        "evicted": evicted,
        "body_mb": round(body_mb, 1),
        "check_s_median": round(statistics.median(checks), 3),
        "check_s_max": round(max(checks), 3),
        "check_cpu_s_median": round(statistics.median(t["check_cpu_s"] for t in timings), 3),
        "fetch_parse_s_median": round(statistics.median(t["fetch_parse_s"] for t in timings), 3),
        "loop_stall_ms_max": round(max(t["loop_stall_ms"] for t in timings), 1),
        "loop_hold_cpu_ms_max": round(max(t["loop_hold_cpu_ms"] for t in timings), 1),
        "check_peak_mib": round(peak / 2**20, 1),
        "staleness_bound_s": round(DEFAULT_STORE_CHECK_INTERVAL_S + max(checks), 3),
    }


# -- the real master ------------------------------------------------------------------------------
async def real_master(keys: int) -> dict[str, Any]:
    """Put ``keys`` small objects into a real store, then time its /get_all_keys."""
    from mooncake.store import MooncakeDistributedStore

    from publishers.mooncake_store import MIB, LocalStore

    with tempfile.TemporaryDirectory(prefix="kv-store-check-") as tmp:
        local = LocalStore(Path(tmp), max(64, keys // 512) * MIB)
        local.start()
        try:
            client = MooncakeDistributedStore()
            code = client.setup(
                "127.0.0.1", local.address.metadata_url, 0, 64 * MIB, "tcp", "",
                local.address.master,
            )  # fmt: skip
            assert code == 0, f"store setup failed with {code}"
            value = b"\0" * 1024
            for first in range(0, keys, 1000):
                chunk = [key(b) for b in range(first, min(first + 1000, keys))]
                codes = client.put_batch(chunk, [value] * len(chunk))
                assert codes == 0 or not any(codes), f"puts failed: {codes}"
            url = f"http://127.0.0.1:{local.metrics_port}"
            seconds = []
            async with aiohttp.ClientSession(timeout=CHECK_TIMEOUT) as session:
                for _ in range(3):
                    started = time.perf_counter()
                    answer = await fetch_keys(session, url)
                    seconds.append(time.perf_counter() - started)
                    assert answer.keys == keys, (answer.keys, keys)
            client.close()
        finally:
            local.stop()
    return {"keys": keys, "get_all_keys_s_median": round(statistics.median(seconds), 3)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"interval_s": DEFAULT_STORE_CHECK_INTERVAL_S, "sizes": []}
    for keys in QUICK_SIZES if args.quick else SIZES:
        with tempfile.TemporaryDirectory(prefix="kv-store-check-") as log_dir:
            server = start_server(keys, Path(log_dir))
            try:
                row = await measure(server.url, keys, args.runs)
            finally:
                server.stop(10)
        print(json.dumps(row), flush=True)
        results["sizes"].append(row)
    if args.real_master:
        results["real_master"] = await real_master(args.real_master)
        print(json.dumps(results["real_master"]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x smaller sizes")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--real-master", type=int, default=0, metavar="KEYS")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/kv_store_check.json")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the key server's flags
    parser.add_argument("--host", default=HOST, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.host, args.port)
        return
    results = asyncio.run(main_async(args))
    args.json.parent.mkdir(exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
