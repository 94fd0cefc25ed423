"""What the fleet costs: start time, memory per engine, request latency through the router
against the same requests sent straight to an engine.

Starts ``mooncake-fleet up FLEET`` (real vLLM with ``config/fleet-vllm.json``, simulated
engines with ``config/fleet-sim.json``, ports chosen free), then sends chat requests that
share a long document prefix, one at a time: a series straight to the first engine and an
equal series (other documents, same shapes) through the router. Prints a table and writes
``bench/results/fleet_latency.json``.

    python -m bench.fleet_latency [--fleet config/fleet-vllm.json] [--requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from bench.harness import percentile

REPO = Path(__file__).resolve().parents[1]
WORDS = "cache prefix token block engine router latency memory batch request model".split()


def start_fleet(fleet_file: Path, run_dir: Path) -> tuple[subprocess.Popen, dict, float]:
    """Launches the fleet on free ports; returns it, its services and its start time."""
    spec = json.loads(fleet_file.read_text())
    for section in ("conductor", "router"):
        spec.setdefault(section, {}).pop("port", None)
    for engine in spec["engines"]:
        engine.pop("port", None)
        engine.pop("replay_port", None)
    free_file = run_dir / "fleet-file.json"
    free_file.write_text(json.dumps(spec))
    output = (run_dir / "output.log").open("wb")
    started = time.monotonic()
    fleet = subprocess.Popen(
        [sys.executable, "-m", "fleet", "up", str(free_file), "--run-dir", str(run_dir)],
        stdout=output,
        stderr=subprocess.STDOUT,
    )
    while not (run_dir / "fleet.json").exists():
        if fleet.poll() is not None or time.monotonic() - started > 600:
            sys.exit((run_dir / "output.log").read_text())
        time.sleep(0.2)
    return fleet, json.loads((run_dir / "fleet.json").read_text()), time.monotonic() - started


def tree_rss_mib(pid: int) -> float:
    root = psutil.Process(pid)
    processes = [root, *root.children(recursive=True)]
    return sum(p.memory_info().rss for p in processes) / 2**20


def prompts(count: int, seed: int, model: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    documents = [" ".join(rng.choice(WORDS) for _ in range(400)) for _ in range(4)]
    return [
        {
            "model": model,
            "messages": [{"role": "user", "content": f"{documents[i % 4]}\nQuestion {i}: why?"}],
            "max_tokens": 8,
        }
        for i in range(count)
    ]


async def series(http: aiohttp.ClientSession, url: str, bodies: list[dict]) -> dict[str, Any]:
    latencies, overheads = [], []
    for body in bodies:
        started = time.perf_counter()
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
            if "x-conductor-overhead-ms" in response.headers:
                overheads.append(float(response.headers["x-conductor-overhead-ms"]))
        latencies.append(1000 * (time.perf_counter() - started))
    return {"latency_ms": summary(latencies), "router_overhead_ms": summary(overheads)}


def summary(values: list[float]) -> dict[str, float] | None:
    if len(values) < 2:
        return None
    ordered = sorted(values)
    figures = {f"p{q}": percentile(ordered, q) for q in (50, 90, 99)}
    figures["mean"] = statistics.fmean(values)
    return {name: round(value, 1) for name, value in figures.items()}


async def measure(services: dict, model: str, requests: int) -> dict[str, Any]:
    engine = next(name for name, s in services.items() if s["kind"] in ("vllm", "sim"))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await series(http, services[engine]["url"], prompts(4, 0, model))  # warm-up
        direct = await series(http, services[engine]["url"], prompts(requests, 1, model))
        routed = await series(http, services["router"]["url"], prompts(requests, 2, model))
    return {"direct_to_" + engine: direct, "through_router": routed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=Path, default=REPO / "config" / "fleet-vllm.json")
    parser.add_argument("--requests", type=int, default=40)
    args = parser.parse_args()
    model = json.loads(args.fleet.read_text()).get("model", {}).get("name", "tiny-llama")
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        fleet, services, start_s = start_fleet(args.fleet, Path(tmp))
        try:
            memory = {
                name: round(tree_rss_mib(s["pid"]))
                for name, s in services.items()
                if s["kind"] in ("vllm", "sim")
            }
            latency = asyncio.run(measure(services, model, args.requests))
        finally:
            stopping = time.monotonic()
            fleet.send_signal(signal.SIGTERM)
            fleet.wait(120)
            stop_s = time.monotonic() - stopping
    result = {
        "fleet": str(args.fleet),
        "start_s": round(start_s, 1),
        "stop_s": round(stop_s, 1),
        "engine_rss_mib": memory,
        **latency,
    }
    print(json.dumps(result, indent=2))
    out = REPO / "bench" / "results" / "fleet_latency.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
