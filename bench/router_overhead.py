"""The router's own overhead: its ``x-conductor-overhead-ms`` (body read, tokenize, the
conductor's answer, the choice; upstream time excluded), idle and under bursts.

Starts a conductor, simulated engines that tokenize with the tiny model's HF tokenizer
(``--tokenizer``) and publish their KV events (every router registers them, so each query
hashes and walks a live index) and one router per way of getting a prompt's ids, then sends the same
text prompts (chat and completions, about ``--prompt-tokens`` each) to each router:

- ``local``: the router tokenizes in-process (``tokenizer.path``, once an engine agreed),
  reusing the ids of long prompts' chunks it saw before;
- ``local-whole``: the same with ``tokenizer.chunk_cache_tokens: 0`` (every prompt whole);
- ``engine``: the router asks an engine's ``/tokenize`` (no tokenizer configured);
- ``ids``: the prompt is token ids already (what ``bench.router_replay`` sends);
- ``ids-embedded``: the same with the index inside the router (``conductor.embedded``): no
  HTTP hop to a conductor;
- ``local-embedded``: text tokenized in-process, the index inside the router.

The prompts are random words sharing their first half in groups of four, or with
``--trace conversation|synthetic`` the trace's first requests as text (``text_prompts``), in
trace order: each conversation's turns repeat its history. Ten prompts warm each router up,
the next half of ``--requests`` go one at a time (``idle``), the rest ``--burst`` at once
then a pause (``burst``; the conversation replay's bursts are 16). Also reads each router's
conductor-query and loop-lag histograms and how many prompt ids its chunk cache gave; the
JSON has the client's time from sending to the answer's end too (``client_p50_ms``,
``client_p99_ms``). ``bench.gateway_overhead`` reuses these parts for a router serving
several models with client keys. Run under the shared lock, on a quiet machine for figures
to publish:

    flock /tmp/bench.lock python -m bench.router_overhead [--requests 200] [--json FILE]
    flock /tmp/bench.lock python -m bench.router_overhead --trace conversation
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness import bucket_quantile, percentile
from bench.text_prompts import hf_words
from bench.trace_sim import load_trace, prompt_tokens, trace_path
from fleet.tiny_model import write_tiny_model
from publishers.local import LocalService, free_port
from tokenization.tokenizer import LocalTokenizer

MODEL = "tiny-llama"
BLOCK = 16
MODES = ("local", "local-whole", "engine", "ids", "ids-embedded", "local-embedded")
WARM_UP = 10  # prompts each router gets before measuring (connections, caches)
READY_TIMEOUT_S = 60.0


def prompts(tokenizer: LocalTokenizer, count: int, tokens: int, seed: int) -> list[str]:
    """Texts of ``tokens`` tokens (words the tokenizer holds whole, each with its leading
    space), sharing their first half in groups of four (as conversations do)."""
    rng = random.Random(seed)
    words = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
    vocab = [w for w in words if w.startswith(" ") and w[1:].isalpha()]
    half = tokens // 2
    shared = ["".join(rng.choices(vocab, k=half)) for _ in range(count // 4 + 1)]
    return [shared[n // 4] + "".join(rng.choices(vocab, k=tokens - half)) for n in range(count)]


def trace_prompts(name: str, count: int, model_dir: Path) -> list[str]:
    """The trace's first ``count`` prompts as text the tokenizer splits word by word."""
    words = hf_words(model_dir)
    return [words.text(prompt_tokens(request)) for request in load_trace(trace_path(name), count)]


@dataclass(frozen=True)
class Request:
    """One request as the benchmark sends it (headers: a client key, when any)."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


# one answer's figures: the router's x-conductor-overhead-ms, the client's wall ms
Sample = tuple[float, float]


def bodies(texts: list[str], mode: str, tokenizer: LocalTokenizer) -> list[Request]:
    """A request per text, alternating completions and chat (ids: completions only)."""
    out = []
    for n, text in enumerate(texts):
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
        if mode.startswith("ids"):
            out.append(Request("/v1/completions", body | {"prompt": tokenizer.encode(text, True)}))
        elif n % 2:
            messages = [{"role": "user", "content": text}]
            out.append(Request("/v1/chat/completions", body | {"messages": messages}))
        else:
            out.append(Request("/v1/completions", body | {"prompt": text}))
    return out


async def send(http: aiohttp.ClientSession, url: str, request: Request) -> Sample:
    """The router's own time for the request, and the client's from sending to the end."""
    started = time.perf_counter()
    async with http.post(url + request.path, json=request.body, headers=request.headers) as r:
        await r.read()
        client_ms = (time.perf_counter() - started) * 1000
        if r.status != 200:
            raise RuntimeError(f"{request.path}: HTTP {r.status}")
        if r.headers.get("x-conductor-fallback"):
            print(f"  fallback: {r.headers['x-conductor-fallback']}")
        return float(r.headers["x-conductor-overhead-ms"]), client_ms


async def idle(http: aiohttp.ClientSession, url: str, requests: list[Request]) -> list[Sample]:
    return [await send(http, url, request) for request in requests]


async def bursts(
    http: aiohttp.ClientSession, url: str, requests: list[Request], size: int, pause_s: float
) -> list[Sample]:
    samples: list[Sample] = []
    for start in range(0, len(requests), size):
        group = requests[start : start + size]
        samples += await asyncio.gather(*(send(http, url, request) for request in group))
        await asyncio.sleep(pause_s)
    return samples


def quantiles(samples: list[Sample]) -> dict[str, float]:
    """p50/p99 of the router's own time, and (``client_``) of the client's."""
    overhead = sorted(sample[0] for sample in samples)
    client = sorted(sample[1] for sample in samples)
    return {
        "p50_ms": percentile(overhead, 50),
        "p99_ms": percentile(overhead, 99),
        "client_p50_ms": percentile(client, 50),
        "client_p99_ms": percentile(client, 99),
    }


async def histogram(http: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """p50/p99 (ms) of one of the router's histograms (Prometheus' interpolation)."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    buckets = [
        (float(le), float(count))
        for le, count in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)
    ]
    return {f"p{q}_ms": bucket_quantile(buckets, q / 100) * 1000 for q in (50, 99)}


async def chunk_tokens(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Prompt ids the router's chunk cache gave (reused) and its tokenizer computed."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    pattern = r'^router_tokenizer_chunk_tokens_total{model="[^"]*",source="(\w+)"} (\S+)$'
    found = re.findall(pattern, text, re.M)
    return {source: float(count) for source, count in found}


async def wait_local(http: aiohttp.ClientSession, router: LocalService, models: int = 1) -> None:
    """Until the router trusts its tokenizer on both paths of every model (an engine agreed)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        async with http.get(router.url + "/metrics") as response:
            text = await response.text()
        active = re.findall(r"^router_local_tokenizer_active\{[^}]*\} 1\.0$", text, re.M)
        if len(active) == 2 * models:
            return
        await asyncio.sleep(0.2)
    active = re.findall(r"^router_local_tokenizer_active.*$", text, re.M)
    raise TimeoutError(
        f"{router.name} did not start tokenizing in-process: {active}\n{router.log_tail()}"
    )


def start_conductor(run_dir: Path) -> LocalService:
    """A conductor the routers register the engines with."""
    config = run_dir / "conductor.json"
    config.write_text(json.dumps({"register_allow": ["127.0.0.0/8"]}))
    return LocalService(run_dir, "conductor", "conductor", "--config", str(config))


def start_engines(
    run_dir: Path, ids: list[str], model: str, *flags: str
) -> tuple[list[LocalService], list[dict[str, Any]]]:
    """Engine simulators serving ``model``, publishing their KV events (so that every query
    hashes and walks a live index), and their entries as a router's prefill instances."""
    services, instances = [], []
    for instance_id in ids:
        events = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
        events["replay_endpoint"] = f"tcp://127.0.0.1:{free_port()}"
        engine = LocalService(
            run_dir, f"engine-{instance_id}", "publishers.engine",
            "--served-model-name", model, "--block-size", str(BLOCK),
            "--sim-instance-id", instance_id,
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True, **events}),
            "--sim-kv-bind", *flags,
        )  # fmt: skip
        services.append(engine)
        instances.append(
            {"instance_id": instance_id, "http_endpoint": engine.url, "registrations": [events]}
        )
    return services, instances


def one_model_layout(
    conductor: dict[str, Any], instances: list[dict[str, Any]], model: str = MODEL
) -> dict:
    """The upstream proxy's layout: one model on ``instances``."""
    return {
        "conductor": conductor,
        "prefill": {"config": {"modelname": model, "block_size": BLOCK}, "instances": instances},
        "routing": {"policy": "ttft"},
    }


def start(run_dir: Path, model_dir: Path, engines: int) -> tuple[list[LocalService], dict]:
    """A conductor and the engines; the routers' shared config layout."""
    conductor = start_conductor(run_dir)
    ids = [f"e{n}" for n in range(engines)]
    flags = ("--tokenizer", str(model_dir), "--sim-time-scale", "0.01")
    services, instances = start_engines(run_dir, ids, MODEL, *flags)
    return [conductor, *services], one_model_layout({"address": conductor.url}, instances)


def mode_config(layout: dict[str, Any], mode: str, model_dir: Path) -> dict[str, Any]:
    """The layout with the mode's way of getting prompt ids (in every model, when several)."""
    config = dict(layout)
    tokenizer: dict[str, Any] = {}
    if mode.startswith("local"):
        tokenizer["path"] = str(model_dir)
    if mode == "local-whole":
        tokenizer["chunk_cache_tokens"] = 0
    if tokenizer and "models" in config:  # a model's tokenizer path is its own
        config["models"] = [model | {"tokenizer": tokenizer} for model in config["models"]]
    elif tokenizer:
        config["tokenizer"] = tokenizer
    if mode.endswith("-embedded"):  # the index inside the router: no conductor hop
        config["conductor"] = {**config["conductor"], "embedded": True}
    return config


def router(run_dir: Path, layout: dict, mode: str, model_dir: Path, name: str = "") -> LocalService:
    name = name or f"router-{mode}"
    path = run_dir / f"{name}.json"
    path.write_text(json.dumps(mode_config(layout, mode, model_dir)))
    return LocalService(run_dir, name, "router", "--config", str(path))


async def measure(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    model_dir = write_tiny_model(run_dir / "model")
    tokenizer = LocalTokenizer.load(model_dir)
    count = WARM_UP + args.requests
    if args.trace:
        texts = trace_prompts(args.trace, count, model_dir)
    else:
        texts = prompts(tokenizer, count, args.prompt_tokens, seed=1)
    half = WARM_UP + args.requests // 2
    services, layout = start(run_dir, model_dir, args.engines)
    routers: dict[str, LocalService] = {}
    results: dict[str, Any] = {}
    try:
        for service in services:  # the engines answer before a router asks them
            service.wait_ready()
        routers.update((mode, router(run_dir, layout, mode, model_dir)) for mode in MODES)
        for service in routers.values():
            service.wait_ready()
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for mode in MODES:
                if mode.startswith("local"):
                    await wait_local(http, routers[mode])
            for mode, service in routers.items():
                requests = bodies(texts, mode, tokenizer)
                await idle(http, service.url, requests[:WARM_UP])
                results[mode] = {
                    "idle": quantiles(await idle(http, service.url, requests[WARM_UP:half])),
                    "burst": quantiles(
                        await bursts(http, service.url, requests[half:], args.burst, args.pause_s)
                    ),
                    "conductor_query": await histogram(
                        http, service.url, "router_conductor_query_seconds"
                    ),
                    "loop_lag": await histogram(http, service.url, "router_event_loop_lag_seconds"),
                    "chunk_tokens": await chunk_tokens(http, service.url),
                }
                print(f"{mode:>6}: {json.dumps(results[mode])}", flush=True)
    finally:
        for service in [*routers.values(), *services]:
            service.stop()
    return results


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    prompts_are = f"the {args.trace} trace's" if args.trace else f"~{args.prompt_tokens}-token"
    lines = [
        f"router overhead (ms), {args.requests} {prompts_are} prompts, bursts of {args.burst}",
        "| prompt ids | idle p50 | idle p99 | burst p50 | burst p99 | conductor p50 | p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        cells = [r["idle"]["p50_ms"], r["idle"]["p99_ms"], r["burst"]["p50_ms"]]
        cells += [r["burst"]["p99_ms"], *r["conductor_query"].values()]
        lines.append(f"| {mode} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--trace", help="conversation, synthetic or a trace file: its prompts")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--pause-s", type=float, default=0.2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as run_dir:
        results = asyncio.run(measure(args, Path(run_dir)))
    print(table(results, args))
    if args.json:
        args.json.write_text(json.dumps({"setup": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
