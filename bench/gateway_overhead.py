"""The router's own time as a fleet's gateway (issue #27): the same prompts through today's
one-model router and through one serving several models with a keys file of many keys.

Both routers sit in front of the same number of engines per model (``--engines-per-model``,
4 by default): the one-model router's model ``tiny-llama`` on engines of its own, the
gateway's ``--models`` models (4) on ``--models`` × that many more (16), all simulators that
tokenize with the tiny model's HF tokenizer and publish their KV events to one conductor.
So each request of either router weighs the same number of candidates against an index
walked as deep; what differs is the gateway's work: the model the request names, its key
(``Authorization: Bearer``, one of ``--keys`` keys, 1,000), the key's limits (set, and far
from binding: concurrency, request and token rates, a waiting room) and the model's
concurrency gate, and the larger fleet it registers, probes and scrapes.

The prompts are ``bench.router_overhead``'s (random words sharing their first half in
groups of four, about ``--prompt-tokens`` each), sent the same way (its ``idle`` then
``burst`` phases) for each way of getting a prompt's ids in ``--modes`` (its modes). The
gateway gets each group of four prompts for one model, the groups dealt round-robin over
the models, so the prompts sharing a prefix share it in the gateway too; request ``n``
carries key ``n mod --keys``, so every measured request is a key's first (with up to
``--keys`` requests). Each request goes to the one-model router, then the same to the
gateway, one after the other (bursts: a burst to each in turn), so both meet the machine's
same moments. Reported: ``x-conductor-overhead-ms`` and the client's time to the answer's
end, p50/p99 for both routers and their ratio (gateway / one model; the issue's goal:
within 10 %). Run under the shared lock:

    flock /tmp/bench.lock python -m bench.gateway_overhead [--requests 400] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import machine
from bench.router_overhead import (
    BLOCK,
    MODEL,
    WARM_UP,
    Request,
    Sample,
    bodies,
    bursts,
    histogram,
    one_model_layout,
    prompts,
    quantiles,
    router,
    send,
    start_conductor,
    start_engines,
    wait_local,
)
from fleet.tiny_model import write_tiny_model
from publishers.local import LocalService
from tokenization.tokenizer import LocalTokenizer

VARIANTS = ("one", "gateway")
GOAL_RATIO = 1.10  # the gateway's p50/p99 within 10 % of the one-model router's
# every key's limits: set, so that each request passes them, and far from binding
NOT_BINDING = {
    "max_concurrent": 64,
    "requests_per_second": 10_000,
    "request_burst": 10_000,
    "tokens_per_second": 100_000_000,
    "token_burst": 100_000_000,
    "max_queued": 16,
}
MODEL_LIMITS = {"max_concurrent_requests": 256, "max_queued_requests": 256}


def write_keys(path: Path, count: int) -> list[str]:
    """A keys file of ``count`` keys, each with limits that do not bind; their secrets."""
    secrets = [f"sk-bench-{n:04d}" for n in range(count)]
    keys = [{"id": f"key-{n:04d}", "key": s, **NOT_BINDING} for n, s in enumerate(secrets)]
    path.write_text(json.dumps({"keys": keys}))
    return secrets


def gateway_layout(
    conductor: dict[str, Any], models: dict[str, list[dict[str, Any]]], keys_file: Path
) -> dict[str, Any]:
    """Several models, each on its engines, with a keys file."""
    return {
        "conductor": conductor,
        "models": [
            {"modelname": name, "block_size": BLOCK, "instances": instances, **MODEL_LIMITS}
            for name, instances in models.items()
        ],
        "routing": {"policy": "ttft"},
        "keys": {"file": str(keys_file)},
    }


def as_gateway(requests: list[Request], models: list[str], secrets: list[str]) -> list[Request]:
    """The same requests to the gateway: each group of four prompts (sharing a prefix) for
    one model in turn, request ``n`` with key ``n mod len(secrets)``."""
    return [
        replace(
            request,
            body=request.body | {"model": models[n // 4 % len(models)]},
            headers={"Authorization": f"Bearer {secrets[n % len(secrets)]}"},
        )
        for n, request in enumerate(requests)
    ]


async def alternate(
    http: aiohttp.ClientSession, urls: dict[str, str], requests: dict[str, list[Request]]
) -> dict[str, list[Sample]]:
    """Each request to every router in turn, one at a time."""
    samples: dict[str, list[Sample]] = {variant: [] for variant in urls}
    for n in range(len(requests[VARIANTS[0]])):
        for variant, url in urls.items():
            samples[variant].append(await send(http, url, requests[variant][n]))
    return samples


async def alternate_bursts(
    http: aiohttp.ClientSession,
    urls: dict[str, str],
    requests: dict[str, list[Request]],
    size: int,
    pause_s: float,
) -> dict[str, list[Sample]]:
    """A burst of ``size`` to every router in turn, a pause after each."""
    samples: dict[str, list[Sample]] = {variant: [] for variant in urls}
    for start in range(0, len(requests[VARIANTS[0]]), size):
        for variant, url in urls.items():
            group = requests[variant][start : start + size]
            samples[variant] += await bursts(http, url, group, size, pause_s)
    return samples


def ratios(one: dict[str, float], gateway: dict[str, float]) -> dict[str, float]:
    """Each figure of the gateway over the one-model router's."""
    return {name: gateway[name] / one[name] for name in one}


async def compare(
    http: aiohttp.ClientSession,
    urls: dict[str, str],
    requests: dict[str, list[Request]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Warm-up, then the idle and burst phases through both routers; figures and ratios."""
    warm = warm_up(args.models)
    half = warm + args.requests // 2
    await alternate(http, urls, {v: r[:warm] for v, r in requests.items()})
    idle = await alternate(http, urls, {v: r[warm:half] for v, r in requests.items()})
    burst = await alternate_bursts(
        http, urls, {v: r[half:] for v, r in requests.items()}, args.burst, args.pause_s
    )
    result: dict[str, Any] = {}
    for variant, url in urls.items():
        result[variant] = {
            "idle": quantiles(idle[variant]),
            "burst": quantiles(burst[variant]),
            "conductor_query": await histogram(http, url, "router_conductor_query_seconds"),
            "loop_lag": await histogram(http, url, "router_event_loop_lag_seconds"),
        }
    one, gateway = result["one"], result["gateway"]
    result["ratio"] = {phase: ratios(one[phase], gateway[phase]) for phase in ("idle", "burst")}
    return result


def warm_up(models: int) -> int:
    """Prompts before measuring: at least one group of four for every model."""
    return max(WARM_UP, 4 * models)


@dataclass(frozen=True)
class Fleet:
    """The conductor and every engine; what both routers of a mode are started from."""

    run_dir: Path
    model_dir: Path
    services: list[LocalService]
    layouts: dict[str, dict[str, Any]]  # variant → its router's layout
    models: list[str]  # the gateway's
    secrets: list[str]  # its keys

    @classmethod
    def start(cls, run_dir: Path, model_dir: Path, args: argparse.Namespace) -> Fleet:
        conductor = start_conductor(run_dir)
        flags = ("--tokenizer", str(model_dir), "--sim-time-scale", "0.01")
        per_model = [f"{n}" for n in range(args.engines_per_model)]
        services, solo = start_engines(run_dir, [f"one-{n}" for n in per_model], MODEL, *flags)
        models: dict[str, list[dict[str, Any]]] = {}
        for m in range(args.models):
            ids = [f"m{m}-{n}" for n in per_model]
            engines, models[f"{MODEL}-{m}"] = start_engines(run_dir, ids, f"{MODEL}-{m}", *flags)
            services += engines
        secrets = write_keys(run_dir / "keys.json", args.keys)
        section = {"address": conductor.url}
        layouts = {
            "one": one_model_layout(section, solo),
            "gateway": gateway_layout(section, models, run_dir / "keys.json"),
        }
        return cls(run_dir, model_dir, [conductor, *services], layouts, list(models), secrets)

    def routers(self, mode: str) -> dict[str, LocalService]:
        """Both routers, getting prompt ids the mode's way."""
        return {
            variant: router(self.run_dir, layout, mode, self.model_dir, f"{variant}-{mode}")
            for variant, layout in self.layouts.items()
        }

    def stop(self) -> None:
        for service in self.services:
            service.stop()


async def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    model_dir = write_tiny_model(run_dir / "model")
    tokenizer = LocalTokenizer.load(model_dir)
    texts = prompts(tokenizer, warm_up(args.models) + args.requests, args.prompt_tokens, seed=1)
    fleet = Fleet.start(run_dir, model_dir, args)
    results: dict[str, Any] = {}
    try:
        for service in fleet.services:  # the engines answer before a router asks them
            service.wait_ready()
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for mode in args.modes:
                requests = {"one": bodies(texts, mode, tokenizer)}
                requests["gateway"] = as_gateway(requests["one"], fleet.models, fleet.secrets)
                results[mode] = await measure_mode(http, fleet, mode, requests, args)
    finally:
        fleet.stop()
    return results


async def measure_mode(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    mode: str,
    requests: dict[str, list[Request]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Both routers for one mode, started fresh and stopped after."""
    routers = fleet.routers(mode)
    try:
        for service in routers.values():
            service.wait_ready()
        if mode.startswith("local"):
            await wait_local(http, routers["one"])
            await wait_local(http, routers["gateway"], models=len(fleet.models))
        urls = {variant: service.url for variant, service in routers.items()}
        result = await compare(http, urls, requests, args)
    finally:
        for service in routers.values():
            service.stop()
    rounded = {
        phase: {k: round(v, 3) for k, v in r.items()} for phase, r in result["ratio"].items()
    }
    print(f"{mode:>12}: gateway / one model {json.dumps(rounded)}", flush=True)
    return result


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"router overhead and client latency (ms), {args.requests} ~{args.prompt_tokens}-token "
        f"prompts, bursts of {args.burst}: one model on {args.engines_per_model} engines vs "
        f"{args.models} models × {args.engines_per_model} engines and {args.keys} keys",
        "| prompt ids | phase | overhead one p50 / p99 | gateway p50 / p99 | ratio p50 / p99 "
        "| client one p50 / p99 | gateway p50 / p99 | ratio p50 / p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, result in results.items():
        for phase in ("idle", "burst"):
            one, gateway = result["one"][phase], result["gateway"][phase]
            ratio = result["ratio"][phase]
            cells = [
                f"{figures[p50]:.2f} / {figures[p99]:.2f}"
                for p50, p99 in (("p50_ms", "p99_ms"), ("client_p50_ms", "client_p99_ms"))
                for figures in (one, gateway, ratio)
            ]
            lines.append(f"| {mode} | {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal(results: dict[str, Any]) -> dict[str, bool]:
    """Per mode: are the gateway's overhead p50 and p99 within 10 % of the one model's?"""
    return {
        mode: all(
            result["ratio"][phase][figure] <= GOAL_RATIO
            for phase in ("idle", "burst")
            for figure in ("p50_ms", "p99_ms")
        )
        for mode, result in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--engines-per-model", type=int, default=4)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["ids", "local"])
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--pause-s", type=float, default=0.2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gateway-overhead-") as run_dir:
        results = asyncio.run(measure(args, Path(run_dir)))
    setup = machine()  # its load average: the run's
    print(table(results, args))
    met = goal(results)
    print("goal (overhead p50 and p99 within 10 %): " + json.dumps(met))
    print("machine: " + json.dumps(setup))
    if args.json:
        report = {"setup": vars(args) | {"json": str(args.json)}, "machine": setup}
        args.json.write_text(json.dumps(report | {"results": results, "goal": met}, indent=2))


if __name__ == "__main__":
    main()
