"""Trace replay through the real stack: router, conductor and engine simulators as processes.

``bench.trace_sim`` answers "which policy routes best?" in a discrete-event simulation
that calls the project's code in process. This benchmark answers the question the
simulation cannot: does the *deployed* stack — ``python -m router`` in front of ``python -m
conductor`` and E ``python -m publishers.engine`` simulators, talking HTTP and ZMQ on
127.0.0.1 — get the same hits and TTFTs, and what does the router itself cost?

For each policy it starts a fresh fleet (conductor, engines, router: no cache, index, load
accounting or learned cost model carries over from the previous policy), warms every engine
with the trace's first request (as trace_sim's default ``warm_start``), then sends the
first N requests at their trace arrival times divided by ``--speedup`` through the router,
streaming. The engines run ``--sim-time-scale 1/speedup``, so their model clock and the
compressed arrivals agree: TTFTs are read on the model clock (``x-engine-ttft-ms``) and are
comparable with the trace's own seconds.

``--peers`` puts a router users pick instead (``bench.peer_routers``: vllm-router,
sglang-router) in front of the same engines, one fresh fleet each after our policies: same
engine flags, same warm-up, same requests. Prompts are token ids, or text that tokenizes back
to the same ids (``bench.text_prompts``; the default with peers, since sglang-router takes
only text).

``--store on`` (or ``both``) gives every run a fresh real Mooncake store (master and store
process, ``publishers.mooncake_store.LocalStore``): the engines save every prefilled block to it and
load from it what their own cache lacks (vLLM's MooncakeStoreConnector, simulated), the
conductor indexes it as a shared CPU tier and the router prices loads from it. The bytes
moved are small stand-in blocks (``STORE_BLOCK_FLAGS``: 64 bytes per token); the engines
charge a load the timing model's time for the modelled engine's KV, like every other cost.
The store's binaries listen on every interface: run it inside
``scripts/isolated-net.sh``.

``--mixed`` asks whether serving several models and LoRA adapters from one router costs
cache hits: the slice is split by conversation across two base models and an adapter of
each (E/2 engines per model, each serving its model and its adapter; the router configured
with ``models``), then each name's requests are replayed alone on E/2 engines of its model,
and each name's hit ratio and TTFTs in the mixed run are set against its run alone.

Run ``python -m bench.router_replay --help``; bench/README.md says how it works and
bench/results/router-replay.md has its results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import signal
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import machine, percentile
from bench.peer_routers import PEERS, TEXT_ONLY, PeerEngine, find_binary, installed_version
from bench.peer_routers import wait_http_ready as wait_peer_ready
from bench.text_prompts import WordTable, hf_words, stand_in_words
from bench.trace_sim import (
    DEFAULT_SLOS_S,
    MODEL,
    SimConfig,
    TraceRequest,
    imbalance,
    json_safe,
    load_trace,
    pooled_reference,
    prompt_tokens,
    trace_path,
    unbounded_token_hits,
)
from publishers.engine.timing import TimingModel
from publishers.local import HOST, LocalService, free_port
from publishers.mooncake_store import (
    LOOPBACK_ENV,
    MIB,
    STORE_CONNECTOR,
    LocalStore,
    connector_config,
)
from router.conductor_client import parse_hits
from router.policy import POLICIES

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
DEFAULT_BLOCK_SIZE = 16  # a 512-token trace block is 32 engine blocks
MAX_TOKENS_CAP = 4  # decode is not what routing decides; a few tokens keep the run fast
SPECIALS_SLACK = 8  # context beyond the longest prompt: an HF tokenizer adds a BOS token
DEFAULT_POLICIES = ("ttft", "max_prefix", "least_loaded", "round_robin")
DEFAULT_SPEEDUP = 10.0
QUICK = {"requests": 60, "engines": 2, "policies": "ttft,round_robin", "speedup": 20.0}
STARTUP_TIMEOUT_S = 30.0
WARM_UP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 900.0  # wall; an overloaded engine queues for a long time, not forever
STOP_TIMEOUT_S = 5.0
STORE_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
STORE_SEGMENT_MB = 1024
STORE_BUFFER_BYTES = 64 << 20  # each engine's transfer buffer
# one layer, one KV head of dim 8: real bytes through the real store, 64 bytes per token
STORE_BLOCK_FLAGS = ("--sim-store-layers", "1", "--sim-store-kv-heads", "1",
                     "--sim-store-head-dim", "8")  # fmt: skip
DEFAULT_CONCURRENCY = 1024  # above any slice's in-flight peak: arrivals stay open-loop
LATE_WARNING_S = 0.5  # wall; a client this late no longer replays the trace's arrivals
PEER_SETTLE_S = 0.5  # wall; lets a peer subscribed to KV events take in the warm-up's


# -- setup -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A base model of the fleet: its engines, their pool, and the LoRA adapters they serve
    besides it (vLLM's ``--lora-modules``). A request names the model or an adapter."""

    name: str
    engines: int
    gpu_blocks: int  # per engine
    adapters: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.adapters)


@dataclass(frozen=True, slots=True)
class ReplaySetup:
    """Everything a run depends on, fixed before the first process starts."""

    trace: str
    requests: list[TraceRequest]  # arrivals already divided by ``speedup`` (wall seconds)
    models: tuple[ServedModel, ...]  # the fleet: each base model on engines of its own
    names: tuple[str, ...]  # per request, the model or adapter it names
    policies: tuple[str, ...]
    speedup: float
    max_model_len: int
    concurrency: int
    slos_s: tuple[float, ...]
    reject_slo_ms: float | None
    engine_speed: float  # GPU FLOPs relative to TimingModel's default engine
    block_size: int = DEFAULT_BLOCK_SIZE  # the engines' (and so the store's keys')
    store_runs: tuple[bool, ...] = (False,)  # each policy without and/or with a store
    store_mb: int = STORE_SEGMENT_MB
    peers: dict[str, Path] = field(default_factory=dict)  # peer router -> its binary
    words: WordTable | None = None  # text prompts (None: token ids)
    tokenizer: Path | None = None  # the engines' HF tokenizer directory (None: stand-in)
    embedded: bool = False  # ours indexes the events itself (conductor.embedded), no service
    part: str = ""  # which of a mixed replay's runs: "mixed", or the one name replayed alone
    replica_runs: tuple[int, ...] = (1,)  # each policy with this many router replicas
    replicas: int = 1  # this run's routers; the client sends request i to router i mod N

    @property
    def routers(self) -> tuple[str, ...]:
        """Every run's router: our policies, then the peers."""
        return (*self.policies, *self.peers)

    @property
    def engines(self) -> int:
        return sum(model.engines for model in self.models)

    @property
    def timing(self) -> TimingModel:
        return replace(TimingModel(), gpu_flops=TimingModel().gpu_flops * self.engine_speed)

    @property
    def time_scale(self) -> float:
        """The engines' ``--sim-time-scale``: wall seconds per model second."""
        return 1.0 / self.speedup

    def by_name(self) -> dict[str, list[TraceRequest]]:
        """Each model or adapter name the requests give, in the fleet's order: its requests."""
        requests: dict[str, list[TraceRequest]] = {}
        for request, name in zip(self.requests, self.names, strict=True):
            requests.setdefault(name, []).append(request)
        order = [name for model in self.models for name in model.names]
        return {name: requests[name] for name in order if name in requests}

    def model_of(self, name: str) -> ServedModel:
        """The base model ``name`` is, or is an adapter of."""
        return next(model for model in self.models if name in model.names)


def max_tokens(request: TraceRequest) -> int:
    return max(1, min(request.output_length, MAX_TOKENS_CAP))


def pool_blocks(requests: Sequence[TraceRequest], engines: int, block_size: int) -> int:
    """Each engine's pool: ~1/E of the requests' distinct tokens (the engines together
    could hold every block once, so where a prefix lives decides hits)."""
    return SimConfig(num_instances=engines, block_size=block_size).gpu_blocks_for(requests)


def build_setup(args: argparse.Namespace) -> ReplaySetup:
    """The slice on one model's E engines (``--mixed``: split across models and adapters)."""
    requests = load_trace(trace_path(args.trace), args.requests, time_scale=1 / args.speedup)
    setup = ReplaySetup(
        trace=args.trace,
        requests=requests,
        models=(
            ServedModel(MODEL, args.engines, pool_blocks(requests, args.engines, args.block_size)),
        ),
        names=(MODEL,) * len(requests),
        policies=tuple(p for p in args.policies.split(",") if p),
        speedup=args.speedup,
        max_model_len=max(r.input_length + max_tokens(r) for r in requests) + SPECIALS_SLACK,
        concurrency=args.concurrency,
        slos_s=tuple(args.slo_s),
        reject_slo_ms=args.reject_slo_ms,
        engine_speed=args.engine_speed,
        block_size=args.block_size,
        store_runs=STORE_MODES[args.store],
        replica_runs=tuple(args.replicas),
        store_mb=args.store_mb,
        peers=args.peer_binaries,
        words=prompt_words(args.prompts, args.tokenizer),
        tokenizer=args.tokenizer,
        embedded=args.conductor == "embedded",
    )
    return mixed_setup(setup) if args.mixed else setup


def prompt_words(prompts: str, tokenizer: Path | None) -> WordTable | None:
    """How trace tokens become text for ``--prompts text`` (None: send token ids)."""
    if prompts == "ids":
        return None
    return hf_words(tokenizer) if tokenizer is not None else stand_in_words()


def describe(setup: ReplaySetup) -> dict[str, Any]:
    """The setup's figures for the JSON, with the references a policy is measured against:
    the ideal hit ratio of never-evicting caches (one per model and adapter: their blocks
    never match each other's), the hit ratio of one LRU pool of the whole fleet's size
    (trace_sim's ``pooled`` ceiling; one model only) and the offered load."""
    requests = setup.requests
    subsets = setup.by_name()
    hits = [unbounded_token_hits(subset, warm_start=True) for subset in subsets.values()]
    reused, total = (sum(column) for column in zip(*hits, strict=True))  # as the fleet is
    pooled = None
    if len(subsets) == 1:
        sizing = SimConfig(num_instances=setup.engines, block_size=setup.block_size)
        pooled = pooled_reference(requests, sizing).hit_ratio
    span_s = (requests[-1].arrival_s - requests[0].arrival_s) * setup.speedup

    def offered_load(served: Sequence[TraceRequest], engines: int) -> float:
        """Prefill seconds of ``served``, all uncached, per engine-second of the span."""
        work_s = sum(setup.timing.prefill_seconds(r.input_length) for r in served)
        return work_s / (engines * span_s) if span_s else math.nan

    return {
        "trace": setup.trace,
        "requests": len(requests),
        "engines": setup.engines,
        "models": [
            {
                "model": model.name,
                "adapters": list(model.adapters),
                "engines": model.engines,
                "gpu_blocks_per_engine": model.gpu_blocks,
                "requests": {name: len(subsets.get(name, ())) for name in model.names},
                "offered_load_uncached": offered_load(
                    [r for name in model.names for r in subsets.get(name, ())], model.engines
                ),
            }
            for model in setup.models
        ],
        "engine_speed": setup.engine_speed,
        "policies": list(setup.policies),
        "conductor": "embedded" if setup.embedded else "service",
        "peers": {
            name: {
                "binary": str(binary),
                "version": installed_version(binary, PEERS[name].distribution),
            }
            for name, binary in setup.peers.items()
        },
        "prompts": "ids" if setup.words is None else f"text ({setup.words.source} tokenizer)",
        "speedup": setup.speedup,
        "engine_time_scale": setup.time_scale,
        "engine_block_size": setup.block_size,
        "max_model_len": setup.max_model_len,
        "max_tokens_cap": MAX_TOKENS_CAP,
        "client_concurrency": setup.concurrency,
        "trace_span_s": span_s,
        "offered_load_uncached": offered_load(requests, setup.engines),
        "warm_up_prompt_tokens": len(prompt_tokens(requests[0])),
        "ideal_hit_ratio": reused / total if total else 0.0,
        "pooled_hit_ratio": pooled,
        "slos_s": list(setup.slos_s),
        "reject_slo_ms": setup.reject_slo_ms,
        "store_runs": list(setup.store_runs),
        "replica_runs": list(setup.replica_runs),
        "store_segment_mb": setup.store_mb,
    }


# -- several models ----------------------------------------------------------------------

# ``--mixed``: two base models, each with one LoRA adapter, on half the engines each
MIXED_MODELS = (("model-a", ("model-a-sql",)), ("model-b", ("model-b-chat",)))
MIXED_DEFAULTS: dict[str, Any] = {
    "policies": "ttft",
    "json": RESULTS_DIR / "router_replay_mixed.json",
}
HIT_GOAL = 0.97  # issue #27: each name's hit ratio mixed ≥ this × its hit ratio alone
# ``compare_mixed``'s TTFT figures, in its table's order
MIXED_TTFT_KEYS = tuple(
    f"ttft_{q}_s_{where}" for q in ("p50", "p99") for where in ("mixed", "alone")
)


def conversation_name(request: TraceRequest, names: Sequence[str]) -> str:
    """The name a request is sent as: its conversation's, hashed. The traces carry no
    session ids; a conversation's turns extend its earlier prompt, so its first two blocks
    (the conversation trace's shared system prompt, then the conversation's own first
    block) name it. In the conversation trace's first 3,000 requests every prefix reused
    beyond block 0 is reused within the same pair: the split loses no possible hit."""
    key = ",".join(map(str, request.hash_ids[:2])).encode()
    return names[zlib.crc32(key) % len(names)]


def mixed_setup(setup: ReplaySetup) -> ReplaySetup:
    """The slice split by conversation across ``MIXED_MODELS``' names, the engines split
    evenly across the base models. An engine's pool is the sum of what each name it serves
    would get alone on its model's engines (``alone_setup``): the same memory per name."""
    per_model = setup.engines // len(MIXED_MODELS)
    all_names = [name for model, adapters in MIXED_MODELS for name in (model, *adapters)]
    names = tuple(conversation_name(request, all_names) for request in setup.requests)

    def blocks(name: str) -> int:
        subset = [r for r, n in zip(setup.requests, names, strict=True) if n == name]
        return pool_blocks(subset, per_model, setup.block_size) if subset else 0

    models = tuple(
        ServedModel(model, per_model, sum(blocks(n) for n in (model, *adapters)), adapters)
        for model, adapters in MIXED_MODELS
    )
    return replace(setup, models=models, names=names, part="mixed")


def alone_setup(mixed: ReplaySetup, name: str) -> ReplaySetup:
    """``name``'s requests alone, on as many engines of its model (still serving its
    adapters) as the mixed fleet had, each with the pool ``name`` needs."""
    model = mixed.model_of(name)
    requests = mixed.by_name()[name]
    blocks = pool_blocks(requests, model.engines, mixed.block_size)
    return replace(
        mixed,
        requests=requests,
        models=(replace(model, gpu_blocks=blocks),),
        names=(name,) * len(requests),
        part=name,
    )


# -- processes ---------------------------------------------------------------------------


class StopSignals:
    """SIGTERM and SIGINT unwind the stack (SystemExit), so every fleet's ``finally`` stops
    its processes. While a child is being started and recorded the exit waits: raised
    between ``Popen`` and the bookkeeping, it would orphan that child."""

    def __init__(self) -> None:
        self._deferring = False
        self._pending: int | None = None

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self._deferring:
            self._pending = signum
            return
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
            if self._pending is not None:
                raise SystemExit(128 + self._pending)


STOPPING = StopSignals()


@dataclass(slots=True)
class Engine:
    instance_id: str
    service: LocalService
    endpoint: str  # KV-event PUB socket
    replay_endpoint: str
    model: ServedModel  # what it serves


def run_label(policy: str, store: bool, part: str = "", replicas: int = 1) -> str:
    """``policy``, ``policy+store``; a mixed replay's runs add ``@mixed`` or ``@NAME``,
    several router replicas ``xN``."""
    label = f"{policy}+store" if store else policy
    label = f"{label}@{part}" if part else label
    return f"{label}x{replicas}" if replicas > 1 else label


class Fleet:
    """E fresh engine simulators behind a fresh router: ours with one policy and its own
    conductor, or a peer router (which needs no conductor); with ``store``, a fresh Mooncake
    store the engines share.

    Fresh processes per policy rather than reset caches: the conductor's index, the
    router's load accounting and learned cost model and the engines' model clocks all start
    from zero, so no policy inherits another's state. Use as a context manager: every
    process is stopped on the way out, whatever happened.
    """

    def __init__(self, setup: ReplaySetup, policy: str, log_dir: Path, store: bool) -> None:
        self.setup, self.policy, self.log_dir = setup, policy, log_dir
        self.peer = PEERS.get(policy)
        self.label = run_label(policy, store, setup.part, setup.replicas)
        self.store: LocalStore | None = None
        if store:
            store_dir = log_dir / f"{self.label}-store"
            store_dir.mkdir(parents=True, exist_ok=True)
            self.store = LocalStore(store_dir, setup.store_mb * MIB)
        self.services: list[LocalService] = []
        self.engines: list[Engine] = []
        self.conductor: LocalService | None = None
        self.routers: list[LocalService] = []  # ours: the replicas; a peer: its one process

    @property
    def router(self) -> LocalService | None:
        """The first router: the one the warm-up and the metrics read."""
        return self.routers[0] if self.routers else None

    def __enter__(self) -> Fleet:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _start(self) -> None:
        if self.store is not None:
            with STOPPING.deferred():
                self.store.start()
        if self.peer is None and not self.setup.embedded:
            conductor_config = self.log_dir / f"conductor-{self.label}.json"
            conductor_config.write_text(json.dumps(self.conductor_config(), indent=2))
            self.conductor = self._spawn(
                "conductor", "conductor", "--config", str(conductor_config)
            )
        for model in self.setup.models:
            for _ in range(model.engines):
                self.engines.append(self._engine(f"engine-{len(self.engines)}", model))
        for service in self.services:
            service.wait_ready(STARTUP_TIMEOUT_S)
        if self.peer is not None:
            self._start_peer()
            return
        config_path = self.log_dir / f"router-{self.label}.json"
        config_path.write_text(json.dumps(self.router_config(), indent=2))
        for n in range(self.setup.replicas):  # replicas share one config and conductor
            name = "router" if n == 0 else f"router-{n}"
            args = ("--config", str(config_path), "--log-level", "WARNING")
            self.routers.append(self._spawn(name, "router", *args))
        for router in self.routers:
            router.wait_ready(STARTUP_TIMEOUT_S)  # it listens once it registered every stream

    def _start_peer(self) -> None:
        """The peer's binary in front of the engines, ready once it has registered them."""
        assert self.peer is not None
        engines = [PeerEngine(e.service.url, e.endpoint, e.replay_endpoint) for e in self.engines]
        arguments = self.peer.arguments(engines, self.setup.block_size, MODEL)
        binary = str(self.setup.peers[self.policy])
        router = self._spawn("router", "bench.peer_routers", binary, *arguments)
        self.routers.append(router)
        router.wait_ready(STARTUP_TIMEOUT_S)
        wait_peer_ready(router.url + self.peer.ready_path, STARTUP_TIMEOUT_S)

    def _spawn(
        self, name: str, module: str, *args: str, env: dict[str, str] | None = None
    ) -> LocalService:
        with STOPPING.deferred():
            service = LocalService(
                self.log_dir,
                f"{self.label}-{name}",
                module,
                *args,
                env={"CONDUCTOR_LOG_LEVEL": "WARN", **(env or {})},
            )
            self.services.append(service)
        return service

    def _engine(self, instance_id: str, model: ServedModel) -> Engine:
        setup = self.setup
        endpoint, replay = (f"tcp://{HOST}:{free_port()}" for _ in range(2))
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
        }
        store_args: tuple[str, ...] = ()
        tokenizer_args = () if setup.tokenizer is None else ("--tokenizer", str(setup.tokenizer))
        lora_args: tuple[str, ...] = ()
        if model.adapters:  # no weights are read: the path only keys the adapter's blocks
            lora_args = ("--enable-lora", "--lora-modules",
                         *(f"{name}=/adapters/{name}" for name in model.adapters))  # fmt: skip
        env: dict[str, str] = {}
        if self.store is not None:
            mooncake_config = self.log_dir / f"mooncake-{self.label}.json"
            config = connector_config(self.store.address, STORE_BUFFER_BYTES)
            mooncake_config.write_text(json.dumps(config))
            store_args = ("--kv-transfer-config", json.dumps(STORE_CONNECTOR), *STORE_BLOCK_FLAGS)
            env = {"MOONCAKE_CONFIG_PATH": str(mooncake_config), **LOOPBACK_ENV}
        service = self._spawn(
            instance_id,
            "publishers.engine",
            "--served-model-name", model.name,
            "--block-size", str(setup.block_size),
            "--num-gpu-blocks-override", str(model.gpu_blocks),
            "--max-model-len", str(setup.max_model_len),
            "--kv-events-config", json.dumps(events),
            "--sim-kv-bind",  # bind the loopback endpoint (vLLM would connect to it)
            "--sim-instance-id", instance_id,
            "--sim-time-scale", repr(setup.time_scale),
            "--sim-gpu-flops", repr(setup.timing.gpu_flops),
            "--sim-log-level", "WARNING",
            "--enable-scale-out",  # vllm-router renders every prompt on every engine
            *tokenizer_args,
            *lora_args,
            *store_args,
            env=env,
        )  # fmt: skip
        return Engine(instance_id, service, endpoint, replay, model)

    def conductor_config(self) -> dict[str, Any]:
        """No services of its own (the router registers the engines); where the store's
        admin server is, so the conductor can expire what the store evicts."""
        if self.store is None:
            return {}
        return {"kv_store_admin_urls": {self.store.address.master: self.store.admin_url}}

    def router_config(self) -> dict[str, Any]:
        """The router's config file: the engines and their event streams, one policy. One
        model is the upstream layout's ``prefill`` section; several, or adapters, ``models``
        (each with its own engines)."""
        routing: dict[str, Any] = {"policy": self.policy}
        if self.setup.reject_slo_ms is not None:
            routing["ttft_slo_ms"] = self.setup.reject_slo_ms
        # with the engines' HF tokenizer, ours tokenizes in process as it would in service
        tokenizer = (
            {"tokenizer": {"path": str(self.setup.tokenizer)}} if self.setup.tokenizer else {}
        )
        config: dict[str, Any] = {
            "conductor": (
                {"embedded": True} if self.conductor is None else {"address": self.conductor.url}
            ),
            "routing": routing,
        }
        block_size, models = self.setup.block_size, self.setup.models
        if len(models) == 1 and not models[0].adapters:
            config["prefill"] = {
                "config": {"modelname": models[0].name, "block_size": block_size},
                "instances": self.instances(models[0]),
            }
            return {**config, **tokenizer}
        config["models"] = [
            {
                "modelname": model.name,
                "block_size": block_size,
                "adapters": list(model.adapters),
                "instances": self.instances(model),
                **tokenizer,  # a model's own (the top-level path is not inherited)
            }
            for model in models
        ]
        return config

    def instances(self, model: ServedModel) -> list[dict[str, Any]]:
        """The router config's prefill instances of ``model``: its engines' streams."""
        return [
            {
                "instance_id": engine.instance_id,
                "http_endpoint": engine.service.url,
                "kv_store": self.store.address.master if self.store else "",
                "registrations": [
                    {
                        "endpoint": engine.endpoint,
                        "replay_endpoint": engine.replay_endpoint,
                        "dp_rank": 0,
                    }
                ],
            }
            for engine in self.engines
            if engine.model is model
        ]

    def serving(self, name: str) -> list[Engine]:
        """The engines that serve model or adapter ``name``."""
        return [engine for engine in self.engines if name in engine.model.names]

    def stop(self) -> None:
        """Router first (no new work), then engines, then the conductor, then the store."""
        for service in reversed(self.services):
            service.stop(STOP_TIMEOUT_S)
        if self.store is not None:
            self.store.stop()

    def routing_cpu_s(self) -> float:
        """CPU seconds the routing side has used so far: the router's process tree and, for
        ours, the conductor's (a peer that indexes KV events does so in its own process)."""
        total = 0.0
        for service in (*self.routers, self.conductor):
            if service is None:
                continue
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(service.process.pid)
                for member in (process, *process.children(recursive=True)):
                    with contextlib.suppress(psutil.Error):
                        times = member.cpu_times()
                        total += times.user + times.system
        return total

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ({s.log_path})\n{s.log_tail()}" for s in self.services)


# -- the client --------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What one request got, as the client saw it."""

    index: int
    status: int = 0
    instance: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    router_cached_tokens: int = 0  # the hit the router's decision counted on
    ttft_s: float | None = None  # model clock, from the engine
    client_ttft_s: float | None = None  # wall time to the first byte × speedup
    overhead_ms: float | None = None  # wall time spent in the router before forwarding
    fallback: str | None = None
    send_lag_s: float = 0.0  # wall: how late the client sent it
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def prompt(request: TraceRequest, words: WordTable | None) -> str | list[int]:
    """The request's prompt: its trace tokens as ids, or as text when ``words`` says how."""
    tokens = prompt_tokens(request)
    return tokens if words is None else words.text(tokens)


def request_bodies(setup: ReplaySetup) -> list[bytes]:
    """Every request's JSON body, naming its model or adapter, encoded before the clock
    starts so that sending stays on schedule. Streaming with usage: the client sees the
    first token (and the router acts on it) as a production client would, and still gets
    cached_tokens at the end."""
    return [
        json.dumps(
            {
                "model": name,
                "prompt": prompt(request, setup.words),
                "max_tokens": max_tokens(request),
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            separators=(",", ":"),
        ).encode()
        for request, name in zip(setup.requests, setup.names, strict=True)
    ]


def last_usage(sse_text: str) -> dict[str, Any] | None:
    """The ``usage`` of the final SSE chunk; raises ValueError on an error chunk."""
    usage = None
    for line in sse_text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise ValueError(f"error chunk: {chunk['error']}")
        usage = chunk.get("usage") or usage
    return usage


def read_headers(outcome: Outcome, headers: Any) -> None:
    """Our router names the engine it chose; through a peer, the engine's own header does
    (the simulator's, passed on by every router)."""
    outcome.instance = headers.get("x-conductor-prefill-instance") or headers.get(
        "x-engine-instance-id"
    )
    outcome.fallback = headers.get("x-conductor-fallback")
    if (cached := headers.get("x-conductor-cached-tokens")) is not None:
        outcome.router_cached_tokens = int(cached)
    if (overhead := headers.get("x-conductor-overhead-ms")) is not None:
        outcome.overhead_ms = float(overhead)
    if (ttft := headers.get("x-engine-ttft-ms")) is not None:
        outcome.ttft_s = float(ttft) / 1000


async def send(
    session: aiohttp.ClientSession, url: str, body: bytes, outcome: Outcome, speedup: float
) -> None:
    """One request; fills ``outcome`` (never raises)."""
    sent = time.perf_counter()
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as response:
            outcome.status = response.status
            outcome.client_ttft_s = (time.perf_counter() - sent) * speedup  # headers: 1st token
            read_headers(outcome, response.headers)
            text = await response.text()
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {text[:200]}"
            return
        usage = last_usage(text)
        if usage is None or outcome.instance is None or outcome.ttft_s is None:
            outcome.error = "answer without usage, instance or TTFT header"
            return
        outcome.prompt_tokens = usage["prompt_tokens"]
        outcome.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as error:
        outcome.error = f"{type(error).__name__}: {error}"


async def replay(
    setup: ReplaySetup, router_urls: Sequence[str], bodies: list[bytes]
) -> list[Outcome]:
    """Send every request at its (compressed) arrival time, request i to router i mod N
    (as a load balancer in front of replicas would); at most ``concurrency`` in flight (a
    request over the bound waits, and its lateness is recorded)."""
    urls = [f"{router}/v1/completions" for router in router_urls]
    outcomes = [Outcome(r.index) for r in setup.requests]
    bound = asyncio.Semaphore(setup.concurrency)
    connector = aiohttp.TCPConnector(limit=setup.concurrency)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.2

    async def one(request: TraceRequest, body: bytes, outcome: Outcome) -> None:
        async with bound:
            outcome.send_lag_s = loop.time() - (start + request.arrival_s)
            await send(session, urls[request.index % len(urls)], body, outcome, setup.speedup)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        for request, body, outcome in zip(setup.requests, bodies, outcomes, strict=True):
            await asyncio.sleep(max(0.0, start + request.arrival_s - loop.time()))
            tasks.append(asyncio.create_task(one(request, body, outcome)))
        await asyncio.gather(*tasks)
    return outcomes


async def warm_up(fleet: Fleet) -> None:
    """Serve each model's or adapter's first request on every engine serving it directly
    (not measured), then wait until the conductor reports it cached on each: proof that
    every event stream is subscribed. With a store, each engine's turn waits until the
    store holds what the one before saved, so the later engines load the prompt from the
    store, as they would in service. A peer router has no conductor to ask: the fleet waits
    ``PEER_SETTLE_S`` instead; ours with the index embedded (one name only) counts the blocks
    each stream stored on its ``/metrics``. The engines get the same prompts whatever the
    router, so every run starts from the same caches (a peer whose tree learns from the
    requests it routes starts knowing none of them).

    A fleet in service already holds its application's shared prefix; starting cold, the
    first engine to cache the conversation trace's common first block would be every later
    request's longest match (trace_sim's ``warm_up`` explains the same choice)."""
    setup = fleet.setup
    bodies: dict[str, dict[str, Any]] = {
        name: {"model": name, "prompt": prompt(requests[0], setup.words), "max_tokens": 1}
        for name, requests in setup.by_name().items()
    }
    size = setup.block_size
    timeout = aiohttp.ClientTimeout(total=WARM_UP_TIMEOUT_S)
    conductor = fleet.conductor

    async def indexed_everywhere(session: aiohttp.ClientSession, name: str, which: int) -> None:
        if fleet.peer is not None:
            await asyncio.sleep(PEER_SETTLE_S)
            return
        engines = fleet.serving(name)
        tokens = await engine_tokens(session, engines[0], name, bodies[name]["prompt"])
        expected = len(tokens) // size * size
        base = engines[0].model.name
        query = {
            "model": base,
            "lora_name": "" if name == base else name,  # an adapter's blocks are its own
            "block_size": size,
            "token_ids": tokens,
        }
        deadline = time.monotonic() + WARM_UP_TIMEOUT_S
        while time.monotonic() < deadline:
            seen: dict[str, Any]
            if conductor is None:  # embedded: every stream stored the prompt's blocks
                assert fleet.router is not None
                seen = await blocks_stored(session, fleet.router.url)
                if len(seen) == len(fleet.engines) and min(seen.values()) * size >= expected:
                    return
            else:
                async with session.post(f"{conductor.url}/query", json=query) as answer:
                    seen = parse_hits(await answer.json(), "default")
                if all(seen.get(e.instance_id, (0, 0, 0))[which] >= expected for e in engines):
                    return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"the warm-up of {name} is not indexed on every engine: {seen}")

    async with aiohttp.ClientSession(timeout=timeout) as session:
        for engine in fleet.engines:
            served = [name for name in bodies if name in engine.model.names]
            for name in served:
                url = f"{engine.service.url}/v1/completions"
                async with session.post(url, json=bodies[name]) as answer:
                    if answer.status != 200:
                        text = await answer.text()
                        raise RuntimeError(f"warm-up of {name} on {engine.instance_id}: {text}")
            if fleet.store is not None:  # the store's pool is every engine's CPU tier
                for name in served:
                    await indexed_everywhere(session, name, 1)
        for name in bodies:
            await indexed_everywhere(session, name, 0)


async def metric_samples(
    session: aiohttp.ClientSession, url: str, name: str
) -> list[tuple[dict[str, str], float]]:
    """Every series of metric ``name`` on ``url``'s ``/metrics``: (labels, value)."""
    async with session.get(f"{url}/metrics") as answer:
        text = await answer.text()
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


async def blocks_stored(session: aiohttp.ClientSession, router_url: str) -> dict[str, float]:
    """Blocks each event stream stored, per the router's embedded index's metrics."""
    samples = await metric_samples(session, router_url, "conductor_blocks_stored_total")
    return {labels["stream"]: value for labels, value in samples}


async def forgone_tokens(router_url: str) -> float:
    """Prompt tokens our router saw cached on another instance than the one it chose."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        samples = await metric_samples(session, router_url, "router_cache_forgone_tokens_total")
    return sum(value for _, value in samples)


async def engine_tokens(
    session: aiohttp.ClientSession, engine: Engine, name: str, prompt: str | list[int]
) -> list[int]:
    """The ids ``engine`` computes for ``prompt`` to model or adapter ``name``: what its KV
    events (and so the conductor) are keyed by, whichever tokenizer it runs."""
    if isinstance(prompt, list):
        return prompt
    request = {"model": name, "prompt": prompt}
    async with session.post(f"{engine.service.url}/tokenize", json=request) as answer:
        if answer.status != 200:
            raise RuntimeError(f"/tokenize on {engine.instance_id}: {await answer.text()}")
        return (await answer.json())["tokens"]


async def store_loaded_tokens(fleet: Fleet) -> int:
    """Prompt tokens the engines loaded from the store rather than computed (the warm-up
    included): the sum of their ``vllm:external_prefix_cache_hits_total``."""
    name, total = "vllm:external_prefix_cache_hits_total", 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for engine in fleet.engines:
            samples = await metric_samples(session, engine.service.url, name)
            total += sum(value for _, value in samples)
    return int(total)


# -- summaries ---------------------------------------------------------------------------


def quantiles(values: Sequence[float], prefix: str, unit: str) -> dict[str, float | None]:
    """p50, p90, p99, mean and max; every one None without values (a peer reports no
    ``x-conductor-overhead-ms``)."""
    ordered = sorted(values)
    figures: dict[str, float | None] = {
        f"{prefix}_p{q}_{unit}": percentile(ordered, q) if ordered else None for q in (50, 90, 99)
    }
    figures[f"{prefix}_mean_{unit}"] = sum(ordered) / len(ordered) if ordered else None
    figures[f"{prefix}_max_{unit}"] = ordered[-1] if ordered else None
    return figures


def path_overheads_ms(served: Sequence[Outcome], speedup: float) -> list[float]:
    """Per request, the wall time from sending to the first byte that the engine's TTFT does
    not account for: the router's own time, its two extra hops, and the engine's parsing and
    tokenizing before its TTFT clock starts. The same measure for every router, ours (whose
    ``x-conductor-overhead-ms`` is its part before forwarding) or a peer (which reports
    none); the engine's TTFT is model time, ``speedup`` times its wall time."""
    return [
        (o.client_ttft_s - o.ttft_s) / speedup * 1000
        for o in served
        if o.client_ttft_s is not None and o.ttft_s is not None
    ]


def per_instance(outcomes: Sequence[Outcome], instances: Sequence[str]) -> dict[str, dict]:
    """Requests, prompt tokens and computed (uncached) tokens each engine served."""
    load = {name: {"requests": 0, "prompt_tokens": 0, "computed_tokens": 0} for name in instances}
    for outcome in outcomes:
        if outcome.ok and outcome.instance in load:
            entry = load[outcome.instance]
            entry["requests"] += 1
            entry["prompt_tokens"] += outcome.prompt_tokens
            entry["computed_tokens"] += outcome.prompt_tokens - outcome.cached_tokens
    return load


def summarize(
    label: str, outcomes: Sequence[Outcome], setup: ReplaySetup, instances: Sequence[str]
) -> dict[str, Any]:
    """One policy's figures. SLO attainment is over every request sent: a rejected (429)
    or failed request is a miss, as trace_sim counts rejections."""
    served = [o for o in outcomes if o.ok]
    rejected = [o for o in outcomes if o.status == 429]
    failed = [o for o in outcomes if not o.ok and o.status != 429]
    prompt = sum(o.prompt_tokens for o in served)
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    load = per_instance(outcomes, instances)
    summary: dict[str, Any] = {
        "policy": label,
        "requests": len(outcomes),
        "served": len(served),
        "rejected": len(rejected),
        "errors": len(failed),
        "error_samples": [f"#{o.index}: {o.error}" for o in failed[:5]],
        "hit_ratio": sum(o.cached_tokens for o in served) / prompt if prompt else 0.0,
        "router_expected_hit_ratio": (
            sum(o.router_cached_tokens for o in served) / prompt if prompt else 0.0
        ),
        "prompt_tokens": prompt,
        "cached_tokens": sum(o.cached_tokens for o in served),
        **quantiles(ttfts, "ttft", "s"),
        "slo_attainment": {
            f"{slo:g}": sum(1 for t in ttfts if t <= slo) / len(outcomes) if outcomes else 0.0
            for slo in setup.slos_s
        },
        **quantiles([o.client_ttft_s for o in served if o.client_ttft_s], "client_ttft", "s"),
        **quantiles([o.overhead_ms for o in served if o.overhead_ms is not None], "overhead", "ms"),
        **quantiles(path_overheads_ms(served, setup.speedup), "path_overhead", "ms"),
        "fallbacks": dict(Counter(o.fallback for o in served if o.fallback)),
        "send_lag_max_s": max((o.send_lag_s for o in outcomes), default=0.0),
        "instances": load,
    }
    for key in ("requests", "prompt_tokens", "computed_tokens"):
        summary[f"imbalance_{key}"] = imbalance([v[key] for v in load.values()])
    return summary


def format_table(setup: dict[str, Any], runs: Sequence[dict[str, Any]]) -> str:
    """A markdown table: paste it into a results file (bench/results/) as is."""
    slos = [f"{slo:g}" for slo in setup["slos_s"]]
    head = ["policy", "hit", "forgone", "TTFT mean", "p50", "p90", "p99", "client p50", "p99",
            *(f"≤{s} s" for s in slos), "imb req", "imb tok", "err", "rej", "router p50 ms",
            "p99 ms", "path p50 ms", "p99 ms", "CPU ms/req", "fallb", "wall s"]  # fmt: skip
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    for run in runs:
        cells = [
            run["policy"],
            f"{run['hit_ratio']:.1%}",
            num(run.get("forgone_hit_ratio"), ".1%"),
            *(num(run[f"ttft_{k}_s"], ".2f") for k in ("mean", "p50", "p90", "p99")),
            *(num(run[f"client_ttft_{k}_s"], ".2f") for k in ("p50", "p99")),
            *(f"{run['slo_attainment'][s]:.0%}" for s in slos),
            num(run["imbalance_requests"], ".2f"),
            num(run["imbalance_prompt_tokens"], ".2f"),
            str(run["errors"]),
            str(run["rejected"]),
            num(run["overhead_p50_ms"], ".1f"),
            num(run["overhead_p99_ms"], ".1f"),
            num(run["path_overhead_p50_ms"], ".1f"),
            num(run["path_overhead_p99_ms"], ".1f"),
            num(run["routing_cpu_ms_per_request"], ".1f"),
            str(sum(run["fallbacks"].values())),
            f"{run['wall_s']:.0f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# -- driver ------------------------------------------------------------------------------


def run_policy(
    setup: ReplaySetup, policy: str, bodies: list[bytes], log_dir: Path, store: bool = False
) -> dict:
    """Start a fleet for ``policy``, warm it up, replay, stop it; the policy's summary."""
    started = time.perf_counter()
    with Fleet(setup, policy, log_dir, store) as fleet:
        assert fleet.router is not None
        try:
            asyncio.run(warm_up(fleet))
        except (OSError, aiohttp.ClientError, RuntimeError, TimeoutError) as error:
            raise RuntimeError(f"{fleet.label}: warm-up failed: {error}\n{fleet.logs()}") from None
        cpu_before = fleet.routing_cpu_s()
        replay_started = time.perf_counter()
        outcomes = asyncio.run(replay(setup, [r.url for r in fleet.routers], bodies))
        replay_s = time.perf_counter() - replay_started
        cpu_s = fleet.routing_cpu_s() - cpu_before
        summary = summarize(fleet.label, outcomes, setup, [e.instance_id for e in fleet.engines])
        summary["routing_cpu_s"] = cpu_s
        summary["routing_cpu_ms_per_request"] = cpu_s * 1000 / len(outcomes)
        summary["store_loaded_tokens"] = asyncio.run(store_loaded_tokens(fleet))
        if fleet.peer is None and summary["prompt_tokens"]:
            forgone = sum(asyncio.run(forgone_tokens(r.url)) for r in fleet.routers)
            summary["forgone_hit_ratio"] = forgone / summary["prompt_tokens"]
        if len(set(setup.names)) > 1:
            summary["models"] = per_name(fleet, outcomes)
        if summary["errors"]:
            summary["logs"] = fleet.logs()
    summary["replay_wall_s"] = replay_s
    summary["wall_s"] = time.perf_counter() - started
    return summary


def per_name(fleet: Fleet, outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """A run of several models and adapters: each name's figures, from its own requests on
    the engines serving it."""
    setup = fleet.setup
    return {
        name: summarize(
            name,
            [o for o, named in zip(outcomes, setup.names, strict=True) if named == name],
            setup,
            [engine.instance_id for engine in fleet.serving(name)],
        )
        for name in setup.by_name()
    }


def _counts(text: str) -> tuple[int, ...]:
    """``1,2,4``: positive counts."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated counts: {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be 1 or more: {text!r}")
    return counts


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="router_replay.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--trace", default="conversation", help="conversation, synthetic or a path")
    add("--requests", type=int, default=500, help="replay the first N requests")
    add("--engines", type=int, default=4)
    add(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="the engines' block size (a store holds one key per block)",
    )
    add(
        "--engine-speed",
        type=float,
        default=2.0,
        help="engine GPU FLOPs relative to the default LLaMA3-70B/8xA800 model: 2 lets the "
        "4 default engines carry the conversation slice's load (about 0.95x uncached)",
    )
    add("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated router policies")
    add(
        "--peers",
        default="",
        help=f"comma-separated peer routers, each on a fleet of its own after our policies: "
        f"{', '.join(PEERS)}",
    )
    add(
        "--peer-bin-dir",
        type=Path,
        help="where the peers' executables are (e.g. a venv's bin with the project's routers "
        "extra); default: PATH",
    )
    add(
        "--prompts",
        choices=("ids", "text"),
        help="send the trace's tokens as token ids or as text that tokenizes back to them "
        "(default: text with --peers or --tokenizer, ids otherwise)",
    )
    add(
        "--tokenizer",
        type=Path,
        help="an HF model directory: the engines tokenize with its tokenizer.json and the "
        "text prompts are built from its vocabulary (default: the simulator's stand-in)",
    )
    add(
        "--speedup",
        type=float,
        default=DEFAULT_SPEEDUP,
        help="trace seconds per wall second; the engines run --sim-time-scale 1/speedup",
    )
    add(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help="client requests in flight at most (a lower bound delays arrivals)",
    )
    add(
        "--slo-s",
        type=float,
        nargs="+",
        default=list(DEFAULT_SLOS_S),
        help="TTFT SLOs (model seconds) to report attainment for",
    )
    add(
        "--reject-slo-ms",
        type=float,
        help="the router's routing.ttft_slo_ms: ttft rejects (429) past this estimate",
    )
    add(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK['requests']} requests, {QUICK['engines']} engines, "
        f"{QUICK['policies']}, speedup {QUICK['speedup']:g} (explicit flags still win)",
    )
    add(
        "--replicas",
        type=_counts,
        default=(1,),
        help="router replicas in front of the engines, comma-separated: each policy runs "
        "with each count, the client sending request i to replica i mod N",
    )
    add(
        "--store",
        choices=sorted(STORE_MODES),
        default="off",
        help="run each policy without a Mooncake store, with one, or both (needs the [store] "
        "extra; run inside scripts/isolated-net.sh)",
    )
    add(
        "--conductor",
        choices=("service", "embedded"),
        default="service",
        help="ours asks a conductor service, or holds the index itself (conductor.embedded)",
    )
    add("--store-mb", type=int, default=STORE_SEGMENT_MB, help="the store's memory")
    add(
        "--mixed",
        action="store_true",
        help="split the slice by conversation across two models and an adapter of each "
        "(E/2 engines per model), then replay each name's requests alone; policy "
        f"{MIXED_DEFAULTS['policies']} and --json {MIXED_DEFAULTS['json'].name} unless given",
    )
    add("--log-dir", type=Path, help="keep the processes' logs and configs here")
    add("--json", type=Path, default=RESULTS_DIR / "router_replay.json")
    args = parser.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(POLICIES) - {""}
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    args.peer_binaries = peer_binaries(parser, args.peers, args.peer_bin_dir)
    if args.prompts is None:
        args.prompts = "text" if args.peer_binaries or args.tokenizer else "ids"
    if args.prompts == "ids" and (args.tokenizer or TEXT_ONLY & set(args.peer_binaries)):
        parser.error("--tokenizer and sglang-router need --prompts text")
    if args.conductor == "embedded" and args.store != "off":
        parser.error("--conductor embedded runs without a store (--store off)")
    if args.mixed and (args.peer_binaries or args.store != "off" or args.conductor != "service"):
        parser.error("--mixed runs ours with a conductor service: no --peers, --store or embedded")
    if args.peer_binaries and args.replicas != (1,):
        parser.error("--replicas runs replicas of ours: no --peers")
    if args.quick:
        keep_given(parser, args, QUICK)
    if args.mixed:
        keep_given(parser, args, MIXED_DEFAULTS)
        if args.engines % len(MIXED_MODELS):
            parser.error(f"--mixed splits the engines across {len(MIXED_MODELS)} models")
    return args


def keep_given(
    parser: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict[str, Any]
) -> None:
    """Set ``defaults`` on ``args`` where the command line left the parser's default."""
    for key, value in defaults.items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def run_all(setup: ReplaySetup, log_dir: Path | None) -> tuple[dict[str, Any], list[dict], float]:
    """Every router's fleet in turn (without and/or with the store; a mixed replay's fleet,
    then each name's alone): the setup's figures, each run's summary and the wall time.
    Logs go to ``log_dir`` (None: a scratch dir)."""
    described = describe(setup)
    parts = [setup]
    if setup.part == "mixed":
        parts += [alone_setup(setup, name) for name in setup.by_name()]
        described["alone"] = {part.part: references(describe(part)) for part in parts[1:]}
    bodies = [request_bodies(part) for part in parts]
    fleet_text = ", ".join(
        f"{'+'.join([model['model'], *model['adapters']])} on {model['engines']} engines × "
        f"{model['gpu_blocks_per_engine']} blocks of {setup.block_size} (offered load "
        f"{model['offered_load_uncached']:.2f}× uncached)"
        for model in described["models"]
    )
    print(
        f"{setup.trace}: {len(setup.requests)} requests over {described['trace_span_s']:.0f} "
        f"trace s at speedup {setup.speedup:g}; {fleet_text}; prompts {described['prompts']}",
        file=sys.stderr,
    )
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="router_replay-") as scratch:
        logs = log_dir or Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        for router in setup.routers:
            for store, replicas in itertools.product(setup.store_runs, setup.replica_runs):
                for part, part_bodies in zip(parts, bodies, strict=True):
                    run = replace(part, replicas=replicas)
                    runs.append(run_policy(run, router, part_bodies, logs, store))
                    print(f"  {runs[-1]['policy']}: {runs[-1]['wall_s']:.1f} s", file=sys.stderr)
    return described, runs, time.perf_counter() - started


def references(described: dict[str, Any]) -> dict[str, Any]:
    """What a run is measured against, from ``describe``."""
    keys = ("requests", "models", "offered_load_uncached", "ideal_hit_ratio", "pooled_hit_ratio")
    return {key: described[key] for key in keys}


def references_text(described: dict[str, Any]) -> str:
    pooled = described["pooled_hit_ratio"]
    return (
        f"ideal hit {described['ideal_hit_ratio']:.1%}, pooled-LRU hit "
        f"{'–' if pooled is None else format(pooled, '.1%')}"
    )


def compare_mixed(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mixed run and name: its hit ratio and TTFTs there against its run alone."""
    by_label = {run["policy"]: run for run in runs}
    rows = []
    for run in runs:
        label, _, part = run["policy"].partition("@")
        if part != "mixed":
            continue
        for name, mixed in run["models"].items():
            alone = by_label[f"{label}@{name}"]
            hit_mixed, hit_alone = mixed["hit_ratio"], alone["hit_ratio"]
            rows.append(
                {
                    "policy": label,
                    "model": name,
                    "requests": mixed["requests"],
                    "hit_mixed": hit_mixed,
                    "hit_alone": hit_alone,
                    "hit_mixed_to_alone": hit_mixed / hit_alone if hit_alone else None,
                    "goal_met": hit_mixed >= HIT_GOAL * hit_alone,
                    **{
                        f"ttft_{q}_s_{where}": figures[f"ttft_{q}_s"]
                        for q in ("p50", "p99")
                        for where, figures in (("mixed", mixed), ("alone", alone))
                    },
                    "errors": mixed["errors"] + alone["errors"],
                }
            )
    return rows


def format_comparison(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of ``compare_mixed``'s rows (TTFTs in model seconds)."""
    head = ["policy", "model", "requests", "hit mixed", "hit alone", "mixed/alone",
            f"≥ {HIT_GOAL:g}", "TTFT p50 mixed", "alone", "p99 mixed", "alone", "err"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ratio = row["hit_mixed_to_alone"]
        cells = [
            row["policy"],
            row["model"],
            str(row["requests"]),
            f"{row['hit_mixed']:.1%}",
            f"{row['hit_alone']:.1%}",
            "–" if ratio is None else f"{ratio:.3f}",
            "yes" if row["goal_met"] else "no",
            *("–" if row[key] is None else f"{row[key]:.2f}" for key in MIXED_TTFT_KEYS),
            str(row["errors"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_runs(runs: Sequence[dict]) -> int:
    """Warn about what makes the figures unreliable; the exit status (1: requests failed)."""
    late = max(run["send_lag_max_s"] for run in runs)
    if late > LATE_WARNING_S:
        print(
            f"the client sent up to {late:.1f} s late: arrivals were not replayed faithfully "
            "(raise --concurrency or lower --speedup)",
            file=sys.stderr,
        )
    errors = sum(run["errors"] for run in runs)
    if errors:
        print(f"{errors} requests failed; samples and logs in the JSON", file=sys.stderr)
    return 1 if errors else 0


def peer_binaries(
    parser: argparse.ArgumentParser, peers: str, bin_dir: Path | None
) -> dict[str, Path]:
    """Each requested peer's executable; a usage error names what is missing."""
    binaries: dict[str, Path] = {}
    for name in dict.fromkeys(p for p in peers.split(",") if p):
        if name not in PEERS:
            parser.error(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
        binary = find_binary(PEERS[name], bin_dir)
        if binary is None:
            where = bin_dir or "PATH"
            parser.error(
                f"{PEERS[name].binary} is not in {where}: pip install the project's routers "
                "extra (or the wheel) and give --peer-bin-dir"
            )
        binaries[name] = binary
    return binaries


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    STOPPING.install()
    setup = build_setup(args)
    described, runs, wall_s = run_all(setup, args.log_dir)
    print(format_table(described, runs))
    print(f"{references_text(described)}; {len(runs)} runs in {wall_s:.0f} s wall")
    extra: dict[str, Any] = {}
    if setup.part == "mixed":
        extra["comparison"] = comparison = compare_mixed(runs)
        print(format_comparison(comparison))
        met = sum(row["goal_met"] for row in comparison)
        print(f"hit ratio mixed ≥ {HIT_GOAL:g} × alone: {met} of {len(comparison)}")
    write_json(args.json, described, runs, wall_s, **extra)
    print(f"wrote {args.json}")
    return check_runs(runs)


def write_json(path: Path, setup: dict, runs: list[dict], wall_s: float, **extra: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "setup": setup,
        "runs": {run["policy"]: run for run in runs},
        **extra,
        "wall_s": wall_s,
        "machine": machine(),
    }
    path.write_text(json.dumps(json_safe(report), indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
