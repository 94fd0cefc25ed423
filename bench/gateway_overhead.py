"""The router's own time as a fleet's gateway (issue #27): the same prompts through today's
one-model router and through one serving several models with a keys file of many keys.

Each router (a *variant*) has engines of its own, the same number per model
(``--engines-per-model``, 4 by default), all simulators that tokenize with the tiny model's
HF tokenizer and publish their KV events to one conductor; every variant's models have
names of their own, so no router's queries meet another's cached prompts. ``--variants``
(``one,gateway`` by default; ``one`` is the reference and comes first):

- ``one``: today's router, the upstream layout's one model on 4 engines, no keys;
- ``keys``: the same with a keys file of ``--keys`` keys (1,000);
- ``models``: ``--models`` models (4) on 4 engines each (16), no keys;
- ``gateway``: the 4 models and the 1,000 keys.

So each request weighs the same number of candidates in every variant, against an index
walked as deep; what the gateway adds is its work: the model the request names, its key
(``Authorization: Bearer``), the key's limits (set on every key and far from binding:
concurrency, request and token rates, a waiting room), the model's concurrency gate (set,
not binding), and the larger fleet it registers, probes and scrapes. ``keys`` and
``models`` tell the two parts apart.

The prompts are ``bench.router_overhead``'s (random words sharing their first half in
groups of four, about ``--prompt-tokens`` each), sent the same way (its ``idle`` then
``burst`` phases) for each way of getting a prompt's ids in ``--modes`` (its modes). A
router of several models gets each group of four prompts for one model, the groups dealt
round-robin over the models, so prompts sharing a prefix share it there too; with keys,
request ``n`` carries key ``n mod --keys``. Before measuring, every key sends one request
(the first prompt again, to every router alike: a router creates a key's limit state and
metric series at its first request, which costs about 0.1 ms once); with ``--cold-keys``
every measured request is its key's first instead (up to ``--keys`` requests). Each
request goes to every variant's router in turn, one at a time (bursts: a burst to each in
turn), so all meet the machine's same moments. Reported:
``x-conductor-overhead-ms`` and the client's time to the answer's end, p50/p99 per variant
and their ratio to ``one`` (the issue's goal: the gateway's within 10 %). Run under the
shared lock:

    flock /tmp/bench.lock python -m bench.gateway_overhead [--requests 400] [--json FILE]
    flock /tmp/bench.lock python -m bench.gateway_overhead --variants one,keys,models,gateway
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


@dataclass(frozen=True)
class Variant:
    """A router to compare: several models or one, a keys file or none."""

    several_models: bool
    keys: bool


VARIANTS = {
    "one": Variant(several_models=False, keys=False),
    "keys": Variant(several_models=False, keys=True),
    "models": Variant(several_models=True, keys=False),
    "gateway": Variant(several_models=True, keys=True),
}
REFERENCE = "one"
PHASES = ("idle", "burst")
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


def models_layout(conductor: dict[str, Any], models: dict[str, list[dict[str, Any]]]) -> dict:
    """Several models, each on its engines, each with a concurrency gate."""
    return {
        "conductor": conductor,
        "models": [
            {"modelname": name, "block_size": BLOCK, "instances": instances, **MODEL_LIMITS}
            for name, instances in models.items()
        ],
        "routing": {"policy": "ttft"},
    }


def for_variant(
    requests: list[Request], models: list[str], secrets: list[str] | None
) -> list[Request]:
    """The same requests to a variant's router: each group of four prompts (sharing a
    prefix) for one of its models in turn; with keys, request ``n`` with key ``n mod
    len(secrets)``."""
    return [
        replace(
            request,
            body=request.body | {"model": models[n // 4 % len(models)]},
            headers={"Authorization": f"Bearer {secrets[n % len(secrets)]}"} if secrets else {},
        )
        for n, request in enumerate(requests)
    ]


async def alternate(
    http: aiohttp.ClientSession, urls: dict[str, str], requests: dict[str, list[Request]]
) -> dict[str, list[Sample]]:
    """Each request to every router in turn, one at a time."""
    samples: dict[str, list[Sample]] = {variant: [] for variant in urls}
    for n in range(len(requests[REFERENCE])):
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
    for start in range(0, len(requests[REFERENCE]), size):
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
    """Warm-up (every request before the last ``--requests``), then the idle and burst
    phases through every router; figures, ratios to one."""
    warm = len(requests[REFERENCE]) - args.requests
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
    result["ratio"] = {
        variant: {
            phase: ratios(result[REFERENCE][phase], result[variant][phase]) for phase in PHASES
        }
        for variant in urls
        if variant != REFERENCE
    }
    return result


def warm_up(models: int) -> int:
    """Prompts before measuring: at least one group of four for every model."""
    return max(WARM_UP, 4 * models)


@dataclass(frozen=True)
class Served:
    """A variant's router: its layout, models and keys."""

    layout: dict[str, Any]
    models: list[str]
    secrets: list[str] | None


class Fleet:
    """The conductor and every variant's engines; what a mode's routers start from."""

    def __init__(self, run_dir: Path, model_dir: Path, keys: int) -> None:
        self.run_dir, self.model_dir = run_dir, model_dir
        self.conductor = start_conductor(run_dir)
        self.services = [self.conductor]
        self.keys_file = run_dir / "keys.json"
        self.secrets = write_keys(self.keys_file, keys)
        self.variants: dict[str, Served] = {}

    def add(self, name: str, models: int, engines_per_model: int) -> None:
        """Variant ``name``'s engines (``models`` when it serves several) and its layout."""
        variant = VARIANTS[name]
        served: dict[str, list[dict[str, Any]]] = {}
        for m in range(models if variant.several_models else 1):
            engines, served[f"{name}-{m}"] = start_engines(
                self.run_dir, [f"{name}-{m}-{n}" for n in range(engines_per_model)],
                f"{name}-{m}", "--tokenizer", str(self.model_dir), "--sim-time-scale", "0.01",
            )  # fmt: skip
            self.services += engines
        conductor = {"address": self.conductor.url}
        if variant.several_models:
            layout = models_layout(conductor, served)
        else:
            (model, instances), *_ = served.items()
            layout = one_model_layout(conductor, instances, model)
        if variant.keys:
            layout["keys"] = {"file": str(self.keys_file)}
        self.variants[name] = Served(layout, list(served), self.secrets if variant.keys else None)

    def routers(self, mode: str) -> dict[str, LocalService]:
        """Every variant's router, getting prompt ids the mode's way."""
        return {
            name: router(self.run_dir, served.layout, mode, self.model_dir, f"{name}-{mode}")
            for name, served in self.variants.items()
        }

    def stop(self) -> None:
        for service in self.services:
            service.stop()


async def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    model_dir = write_tiny_model(run_dir / "model")
    tokenizer = LocalTokenizer.load(model_dir)
    texts = prompts(tokenizer, warm_up(args.models) + args.requests, args.prompt_tokens, seed=1)
    fleet = Fleet(run_dir, model_dir, args.keys)
    results: dict[str, Any] = {}
    try:
        for name in args.variants:
            fleet.add(name, args.models, args.engines_per_model)
        for service in fleet.services:  # the engines answer before a router asks them
            service.wait_ready()
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for mode in args.modes:
                sent = bodies(texts, mode, tokenizer)
                # unless --cold-keys: each key's first request, the first prompt again
                first = [] if args.cold_keys else [sent[0]] * args.keys
                requests = {
                    name: for_variant(first, served.models, served.secrets)
                    + for_variant(sent, served.models, served.secrets)
                    for name, served in fleet.variants.items()
                }
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
    """Every variant's router for one mode, started fresh and stopped after."""
    routers = fleet.routers(mode)
    try:
        for service in routers.values():
            service.wait_ready()
        if mode.startswith("local"):
            for name, service in routers.items():
                await wait_local(http, service, models=len(fleet.variants[name].models))
        urls = {variant: service.url for variant, service in routers.items()}
        result = await compare(http, urls, requests, args)
    finally:
        for service in routers.values():
            service.stop()
    for variant, ratio in result["ratio"].items():
        rounded = {phase: {k: round(v, 3) for k, v in r.items()} for phase, r in ratio.items()}
        print(f"{mode:>12}: {variant} / {REFERENCE} {json.dumps(rounded)}", flush=True)
    return result


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"router overhead and client latency (ms), {args.requests} ~{args.prompt_tokens}-token "
        f"prompts, bursts of {args.burst}; {args.engines_per_model} engines a model, "
        f"{args.models} models where several, {args.keys} keys where keys",
        "| prompt ids | phase | router | overhead p50 / p99 | ÷ one | client p50 / p99 | ÷ one |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, result in results.items():
        for phase in PHASES:
            for variant in args.variants:
                figures = result[variant][phase]
                ratio = result["ratio"].get(variant, {}).get(phase)
                cells = [
                    f"{values[p50]:.2f} / {values[p99]:.2f}" if values else "–"
                    for p50, p99 in (("p50_ms", "p99_ms"), ("client_p50_ms", "client_p99_ms"))
                    for values in (figures, ratio)
                ]
                lines.append(f"| {mode} | {phase} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal(results: dict[str, Any]) -> dict[str, bool]:
    """Per mode: are the gateway's overhead p50 and p99 within 10 % of the one model's?"""
    return {
        mode: all(
            result["ratio"]["gateway"][phase][figure] <= GOAL_RATIO
            for phase in PHASES
            for figure in ("p50_ms", "p99_ms")
        )
        for mode, result in results.items()
        if "gateway" in result["ratio"]
    }


def variant_names(value: str) -> list[str]:
    names = value.split(",")
    if names[0] != REFERENCE or not set(names) <= set(VARIANTS):
        raise argparse.ArgumentTypeError(f"{REFERENCE} first, then any of {', '.join(VARIANTS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--engines-per-model", type=int, default=4)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument(
        "--cold-keys",
        action="store_true",
        help="measure each key's first request (default: every key has sent one before)",
    )
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["ids", "local"])
    parser.add_argument("--variants", type=variant_names, default=[REFERENCE, "gateway"])
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
