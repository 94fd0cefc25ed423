"""Do a key's limits protect the other keys? (issue #27): one key bursts at 10× another's
steady rate, and the steady key's TTFT is compared with its TTFT alone.

Starts ``--engines`` engine simulators (their timing model slowed to ``--time-scale`` so that
a ``--prompt-tokens`` prompt takes tens of milliseconds to its first token) and one router in
front of them with a keys file of three keys, the index inside the router
(``conductor.embedded``: no conductor process sharing the cores):

- ``steady``: no limits; sends ``--rate`` streamed requests a second in every phase;
- ``burst``: limited (``--limits``: concurrency, request rate, a small waiting room);
- ``burst-open``: no limits, the control: the same burst, nothing holding it back.

Every request is a streamed completion of a prompt of distinct random token ids (no cache
hits: the TTFT is the prefill and whatever it waited for), ``--max-tokens`` long, sent open
loop (each on its schedule whatever the others do; each key has its own connection pool,
so no request waits for a client connection). Four phases of ``--seconds`` each:
``unloaded`` (steady alone), ``limited`` (steady and ``burst`` at ``--factor`` × ``--rate``),
``unlimited`` (steady and ``burst-open`` at the same rate), ``unloaded-again`` (steady alone:
how much the unloaded figure moves by itself). Reported per phase: the steady key's TTFT
(client: from sending to the first streamed chunk; engine: ``x-engine-ttft-ms`` × the time
scale, its wall time) p50/p99 and its ratio to the unloaded value, both unloaded phases'
requests together (``unloaded-both``; the issue's goal: p99 within 10 % while ``burst``
bursts), and the bursting key's outcomes (admitted, 429s and their ``Retry-After``, other
errors, one message of each) with the router's rejection counters. Run under the
shared lock:

    flock /tmp/bench.lock python -m bench.limits_burst [--seconds 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import machine, percentile
from bench.router_overhead import MODEL, one_model_layout, start_engines
from publishers.local import LocalService

GOAL_RATIO = 1.10  # steady's p99 TTFT during the burst within 10 % of its unloaded value
LIMITS = {
    "max_concurrent": 1,
    "requests_per_second": 5,
    "request_burst": 2,
    "max_queued": 2,
    "max_queue_seconds": 1.0,
}
KEY_OF = {"steady": "sk-steady", "burst": "sk-burst", "burst-open": "sk-burst-open"}
PHASES = {"unloaded": None, "limited": "burst", "unlimited": "burst-open", "unloaded-again": None}
UNLOADED = "unloaded-both"  # the steady key alone: both unloaded phases' requests together
SETTLE_S = 1.0  # between phases: the engines' queues empty, the router's load estimates too
VOCAB = range(1000, 100_000)


@dataclass(frozen=True)
class Outcome:
    """One request's answer: its status, an error's message and a 429's Retry-After, and
    for a 200 its TTFTs."""

    status: int
    message: str = ""
    retry_after: str | None = None
    ttft_ms: float = math.nan  # client: sending to the first streamed chunk
    engine_ttft_ms: float = math.nan  # the engine's own, in wall ms


def write_keys(path: Path, limits: dict[str, Any]) -> Path:
    keys = [{"id": key_id, "key": secret} for key_id, secret in KEY_OF.items()]
    keys[1] |= limits  # burst
    path.write_text(json.dumps({"keys": keys}))
    return path


class Prompts:
    """Distinct random token-id prompts, so that none hits another's cached blocks."""

    def __init__(self, tokens: int, seed: int = 1) -> None:
        self.tokens = tokens
        self._rng = random.Random(seed)

    def next(self) -> list[int]:
        return self._rng.choices(VOCAB, k=self.tokens)


async def stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], time_scale: float
) -> Outcome:
    """One streamed completion, read to its end."""
    started = time.perf_counter()
    async with http.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            message = (await response.text())[:200]
            return Outcome(response.status, message, response.headers.get("Retry-After"))
        await response.content.readany()
        ttft_ms = (time.perf_counter() - started) * 1000
        engine_ms = float(response.headers.get("x-engine-ttft-ms", "nan")) * time_scale
        await response.read()
        return Outcome(200, ttft_ms=ttft_ms, engine_ttft_ms=engine_ms)


async def paced(
    http: aiohttp.ClientSession,
    url: str,
    prompts: Prompts,
    rate: float,
    seconds: float,
    args: argparse.Namespace,
) -> list[Outcome]:
    """``rate`` requests a second for ``seconds``, open loop."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for n in range(round(rate * seconds)):
        await asyncio.sleep(max(0.0, start + n / rate - loop.time()))
        body = {"model": MODEL, "prompt": prompts.next(), "max_tokens": args.max_tokens}
        body |= {"stream": True, "ignore_eos": True}
        tasks.append(asyncio.create_task(stream(http, url, body, args.time_scale)))
    return list(await asyncio.gather(*tasks))


def ttft(outcomes: list[Outcome]) -> dict[str, float]:
    """p50/p99 of the served requests' TTFTs, client's and engine's."""
    client = sorted(o.ttft_ms for o in outcomes if o.status == 200)
    engine = sorted(o.engine_ttft_ms for o in outcomes if o.status == 200)
    return {
        "p50_ms": percentile(client, 50),
        "p99_ms": percentile(client, 99),
        "engine_p50_ms": percentile(engine, 50),
        "engine_p99_ms": percentile(engine, 99),
    }


def failures(outcomes: list[Outcome], expected: tuple[int, ...] = (200,)) -> dict[str, Any]:
    """Answers of other statuses: how many of each, and one message of each."""
    other = [o for o in outcomes if o.status not in expected]
    return {
        "other": dict(Counter(o.status for o in other)),
        "other_messages": {o.status: o.message for o in other},
    }


def steady_outcomes(outcomes: list[Outcome]) -> dict[str, Any]:
    """What the steady key got: every request served, and how fast."""
    errors = sum(o.status != 200 for o in outcomes)
    return {"sent": len(outcomes), "errors": errors} | ttft(outcomes) | failures(outcomes)


def burst_outcomes(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    """What the bursting key got: admitted, 429s (and their Retry-After), anything else."""
    refused = [o for o in outcomes if o.status == 429]
    retry_after = sorted(int(o.retry_after) for o in refused if o.retry_after is not None)
    admitted = sum(o.status == 200 for o in outcomes)
    return {
        "sent": len(outcomes),
        "admitted": admitted,
        "admitted_per_s": admitted / seconds,
        "rejected_429": len(refused),
        "retry_after_missing": len(refused) - len(retry_after),
        "retry_after_s": [retry_after[0], retry_after[-1]] if retry_after else [],
        "ttft": ttft(outcomes),
    } | failures(outcomes, (200, 429))


async def rejections(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's ``router_admission_rejections_total`` by reason and scope."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    pattern = r'^router_admission_rejections_total\{reason="(\w+)",scope="(\w+)"\} (\S+)$'
    return {f"{r}/{s}": float(n) for r, s, n in re.findall(pattern, text, re.M)}


async def phase(
    sessions: dict[str, aiohttp.ClientSession],
    url: str,
    prompts: Prompts,
    burster: str | None,
    args: argparse.Namespace,
) -> tuple[list[Outcome], list[Outcome]]:
    """The steady key at its rate and, if any, ``burster`` at ``--factor`` times it: what
    each got."""
    senders = [paced(sessions["steady"], url, prompts, args.rate, args.seconds, args)]
    if burster is not None:
        rate = args.rate * args.factor
        senders.append(paced(sessions[burster], url, prompts, rate, args.seconds, args))
    steady, *burst = await asyncio.gather(*senders)
    await asyncio.sleep(SETTLE_S)
    return steady, burst[0] if burst else []


def summary(
    steady: list[Outcome], burst: list[Outcome], burster: str | None, seconds: float
) -> dict[str, Any]:
    """A phase's figures: the steady key's, and the bursting key's if one burst."""
    result: dict[str, Any] = {"steady": steady_outcomes(steady)}
    if burster is not None:
        result["burst"] = {"key": burster} | burst_outcomes(burst, seconds)
    return result


def start_router(run_dir: Path, args: argparse.Namespace) -> tuple[list[LocalService], str]:
    """The engines and the router; the router's URL."""
    flags = ("--sim-time-scale", str(args.time_scale))
    ids = [f"e{n}" for n in range(args.engines)]
    engines, instances = start_engines(run_dir, ids, MODEL, *flags)
    for engine in engines:
        engine.wait_ready()
    config = one_model_layout({"embedded": True}, instances)
    config["keys"] = {"file": str(write_keys(run_dir / "keys.json", args.limits))}
    path = run_dir / "router.json"
    path.write_text(json.dumps(config))
    router = LocalService(run_dir, "router", "router", "--config", str(path))
    router.wait_ready()
    return [router, *engines], router.url


async def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    services, url = start_router(run_dir, args)
    prompts = Prompts(args.prompt_tokens)
    timeout = aiohttp.ClientTimeout(total=120)
    sessions = {
        key_id: aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0),
            headers={"Authorization": f"Bearer {secret}"},
        )
        for key_id, secret in KEY_OF.items()
    }
    try:
        # connections, the router's cost model
        await paced(sessions["steady"], url, prompts, args.rate, args.warm_up_s, args)
        results: dict[str, Any] = {}
        unloaded: list[Outcome] = []
        for name, burster in PHASES.items():
            steady, burst = await phase(sessions, url, prompts, burster, args)
            results[name] = summary(steady, burst, burster, args.seconds)
            unloaded += steady if burster is None else []
            print(f"{name:>14}: {json.dumps(results[name])}", flush=True)
        results[UNLOADED] = steady_outcomes(unloaded)
        results["rejections"] = await rejections(sessions["steady"], url)
    finally:
        for session in sessions.values():
            await session.close()
        for service in services:
            service.stop()
    return results


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    unloaded = results[UNLOADED]
    lines = [
        f"steady key at {args.rate:g}/s, burst at {args.rate * args.factor:g}/s, "
        f"{args.seconds:g} s a phase, {args.engines} engines, {args.prompt_tokens}-token "
        f"prompts; burst's limits {json.dumps(args.limits)}",
        "| phase | steady TTFT p50 / p99 ms | p99 ÷ unloaded-both | engine TTFT p50 / p99 ms "
        "| steady errors | bursting key: sent | admitted (/s) | 429 (Retry-After s) | other |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in PHASES:
        steady, burst = results[name]["steady"], results[name].get("burst")
        cells = [
            f"{steady['p50_ms']:.1f} / {steady['p99_ms']:.1f}",
            f"{steady['p99_ms'] / unloaded['p99_ms']:.2f}",
            f"{steady['engine_p50_ms']:.1f} / {steady['engine_p99_ms']:.1f}",
            json.dumps(steady["other"]) if steady["other"] else "0",
        ]
        if burst is None:
            cells += ["–"] * 4
        else:
            retry = "–".join(str(s) for s in burst["retry_after_s"]) or "–"
            cells += [
                str(burst["sent"]),
                f"{burst['admitted']} ({burst['admitted_per_s']:.1f})",
                f"{burst['rejected_429']} ({retry})",
                json.dumps(burst["other"]) if burst["other"] else "0",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    both = f"{unloaded['p50_ms']:.1f} / {unloaded['p99_ms']:.1f}"
    lines.append(f"| {UNLOADED} | {both} | 1.00 | " + " | ".join(["–"] * 6) + " |")
    return "\n".join(lines)


def admissions_allowed(limits: dict[str, Any], seconds: float) -> float:
    """The most requests the key's request rate lets in from a burst of ``seconds``: its
    bucket full at the start, refilled meanwhile and while the last ones wait their turn."""
    rate = limits.get("requests_per_second")
    if rate is None:
        return math.inf
    waiting_s = limits.get("max_queue_seconds", 10.0) if limits.get("max_queued") else 0.0
    return limits.get("request_burst", rate) + rate * (seconds + waiting_s)


def goal(results: dict[str, Any], args: argparse.Namespace) -> dict[str, bool]:
    """The issue's goal, and whether the limits held (admissions within the request rate,
    every 429 with its Retry-After)."""
    steady = results["limited"]["steady"]
    burst = results["limited"]["burst"]
    allowed = admissions_allowed(args.limits, args.seconds)
    return {
        "steady_p99_within_10_percent": steady["p99_ms"]
        <= GOAL_RATIO * results[UNLOADED]["p99_ms"],
        "steady_served_all": steady["errors"] == 0,
        "burst_within_its_rate": burst["admitted"] <= allowed,
        "every_429_has_retry_after": burst["retry_after_missing"] == 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=10.0, help="steady's requests/s")
    parser.add_argument("--factor", type=float, default=10.0, help="the burst, × --rate")
    parser.add_argument("--seconds", type=float, default=30.0, help="of each phase")
    parser.add_argument("--warm-up-s", type=float, default=3.0)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--limits", type=json.loads, default=LIMITS, help="burst's, as JSON")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="limits-burst-") as run_dir:
        results = asyncio.run(measure(args, Path(run_dir)))
    setup = machine()  # its load average: the run's
    met = goal(results, args)
    print(table(results, args))
    print("goal: " + json.dumps(met))
    print("machine: " + json.dumps(setup))
    if args.json:
        report = {"setup": vars(args) | {"json": str(args.json)}, "machine": setup}
        args.json.write_text(json.dumps(report | {"results": results, "goal": met}, indent=2))


if __name__ == "__main__":
    main()
