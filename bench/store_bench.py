"""Mooncake store throughput: KV blocks put and got through a real store on this machine.

Starts ``mooncake_master`` and a store process (``publishers.store.LocalStore``), then puts
and gets the blocks of 4,096-token prompts one block at a time, as an engine saving and
loading a prefix would, for two block layouts: the tiny model's (32 KiB) and a Llama-3-8B-
like one (2 MiB in bf16). Every loaded block is checked byte for byte. The store's binaries
listen on every interface, so run it in a namespace of its own:

    scripts/isolated-net.sh python bench/store_bench.py [--prompts 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from publishers.store import MIB, KVBlockShape, KVBlockStore, LocalStore, kv_block

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 4096
LAYOUTS = {
    "tiny (2 layers, 2 KV heads x 32, block 32, fp32)": KVBlockShape(2, 2, 32, 32),
    "8B-like (32 layers, 8 KV heads x 128, block 16, bf16)": KVBlockShape(
        32, 8, 16, 128, torch.bfloat16
    ),
}


def measure(store: KVBlockStore, shape: KVBlockShape, prompts: int, seed: int) -> dict:
    blocks_per_prompt = PROMPT_TOKENS // shape.block_size
    put_s, get_s = [], []
    for prompt in range(prompts):
        hashes = [(seed << 40) + (prompt << 20) + i for i in range(blocks_per_prompt)]
        blocks = [kv_block(shape, h) for h in hashes]
        started = time.perf_counter()
        for block_hash, block in zip(hashes, blocks, strict=True):
            store.put(block_hash, block)
        put_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        loaded = [store.get(h) for h in hashes]
        get_s.append(time.perf_counter() - started)
        assert all(torch.equal(a, b) for a, b in zip(loaded, blocks, strict=True))
    megabytes = blocks_per_prompt * shape.nbytes / MIB
    return {
        "block_kib": shape.nbytes // 1024,
        "prompt_mib": round(megabytes, 1),
        "put_ms_per_prompt": round(1000 * statistics.median(put_s), 1),
        "get_ms_per_prompt": round(1000 * statistics.median(get_s), 1),
        "put_mib_s": round(megabytes / statistics.median(put_s)),
        "get_mib_s": round(megabytes / statistics.median(get_s)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--segment-mib", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        local = LocalStore(Path(tmp), args.segment_mib * MIB)
        local.start()
        try:
            client = KVBlockStore(local.address, "bench", buffer_bytes=512 * MIB)
            results = {
                name: measure(client, shape, args.prompts, seed)
                for seed, (name, shape) in enumerate(LAYOUTS.items())
            }
            client.close()
        finally:
            local.stop()
    print(json.dumps(results, indent=2))
    out = REPO / "bench" / "results" / "store.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
