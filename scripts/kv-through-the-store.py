#!/usr/bin/env python3
"""KV moves through the store: run against ``mooncake-fleet up config/fleet-store.json``.

Engine 0 computes a prompt and saves its blocks to the Mooncake store; the conductor then
shows them on engine 1's CPU tier before engine 1 has seen the prompt; engine 1 loads them
instead of computing them (its cached tokens and ``vllm:external_prefix_cache_hits_total``
grow) and answers what engine 0 answered. Then it times, on engine 1, prompts loaded from
the store against prompts of the same length it computes itself. Standard library only.

    usage: scripts/kv-through-the-store.py [--fleet-json RUN_DIR/fleet.json] [--prompts N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

WORDS = "cache prefix token block engine router latency memory tensor store fleet".split()
DEFAULTS = {  # config/fleet-store.json's ports
    "conductor": "http://127.0.0.1:13333",
    "router": "http://127.0.0.1:8000",
    "vllm-0": "http://127.0.0.1:8100",
    "vllm-1": "http://127.0.0.1:8101",
    "mooncake-master": "http://127.0.0.1:9003",
}
MODEL, BLOCK = "tiny-llama", 32


def call(url: str, body: dict[str, Any] | None = None) -> tuple[Any, float]:
    """(answer, seconds): JSON when it is JSON, else text."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    elapsed = time.perf_counter() - started
    try:
        return json.loads(text), elapsed
    except ValueError:
        return text, elapsed


def metric(base: str, name: str) -> float:
    text, _ = call(f"{base}/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"Document {seed}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def complete(base: str, text: str) -> tuple[dict[str, Any], float]:
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0}
    return call(f"{base}/v1/completions", body)


def in_store(conductor: str, engine: str, text: str, timeout: float = 10.0) -> dict[str, Any]:
    """What the conductor shows vllm-1 of a prompt once every full block of it is in the
    store (vLLM saves after the forward pass and announces each block once it is saved)."""
    tokens = call(f"{engine}/tokenize", {"model": MODEL, "prompt": text})[0]["tokens"]
    query = {"model": MODEL, "block_size": BLOCK, "token_ids": tokens, "instance_id": "vllm-1"}
    deadline = time.monotonic() + timeout
    while True:
        hit = call(f"{conductor}/query", query)[0].get("default", {}).get("vllm-1", {})
        if hit.get("CPU") == len(tokens) // BLOCK * BLOCK or time.monotonic() > deadline:
            return {"tokens": len(tokens), **hit}
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet-json", type=Path, help="the fleet's fleet.json (its URLs)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--words", type=int, default=450, help="about 500 tokens")
    args = parser.parse_args()
    urls = dict(DEFAULTS)
    if args.fleet_json:
        services = json.loads(args.fleet_json.read_text())
        urls |= {name: service["url"] for name, service in services.items()}
    a, b, conductor = urls["vllm-0"], urls["vllm-1"], urls["conductor"]
    run = random.randrange(1 << 40) * 100_000  # prompts no earlier run has sent

    text = prompt(run, args.words)
    first, _ = complete(a, text)
    seen = in_store(conductor, a, text)
    keys, _ = call(f"{urls['mooncake-master']}/get_all_keys")
    hits = metric(b, "vllm:external_prefix_cache_hits_total")
    second, _ = complete(b, text)
    print(f"prompt: {seen.pop('tokens')} tokens; vllm-0 computed it and saved it to the store")
    print(f"store keys (GET /get_all_keys): {len(keys.split())}")
    print(f"conductor /query for vllm-1 before it saw the prompt: {seen}")
    print(
        f"vllm-1: cached_tokens {second['usage']['prompt_tokens_details']['cached_tokens']}, "
        f"external hits +{metric(b, 'vllm:external_prefix_cache_hits_total') - hits:.0f}, "
        f"same answer as vllm-0: {second['choices'][0]['text'] == first['choices'][0]['text']}"
    )

    loads, computes, sizes = [], [], []
    for i in range(1, args.prompts + 1):
        saved = prompt(run + i, args.words)
        complete(a, saved)  # into the store, through vllm-0
        in_store(conductor, a, saved)
        answer, seconds = complete(b, saved)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, answer["usage"]
        loads.append(seconds)
        sizes.append(answer["usage"]["prompt_tokens"])
        answer, seconds = complete(b, prompt(run + 50_000 + i, args.words))  # never seen
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, answer["usage"]
        computes.append(seconds)
    print(f"vllm-1, {args.prompts} prompts of ~{statistics.median(sizes):.0f} tokens, 1 output")
    for what, times in (("loaded from the store", loads), ("computed", computes)):
        low, median, high = min(times), statistics.median(times), max(times)
        print(f"  {what}: median {median * 1e3:.0f} ms ({low * 1e3:.0f}-{high * 1e3:.0f})")


if __name__ == "__main__":
    main()
