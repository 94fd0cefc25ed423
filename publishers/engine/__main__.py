"""``mooncake-engine-sim``: a GPU-less stand-in for ``vllm serve``.

Flags that exist in vLLM keep vLLM's names and meanings (``--block-size``,
``--num-gpu-blocks-override``, ``--kv-events-config`` ...), so launch scripts and docs for a
real fleet work with the simulator; everything only the simulator has starts with ``--sim-``.
``PYTHONHASHSEED`` is read from the environment for the NONE_HASH seed, as vLLM does.

With ``--sim-register-with URL`` the engine registers its own event stream with a conductor
(retrying with capped backoff until the conductor answers) and unregisters on shutdown, so
the conductor never routes to a stopped simulator's cache.

With ``--sim-engine sglang`` it is a stand-in for SGLang 0.5.23 instead where our stack can
tell: SGLang's KV-event layout and page hashes, its radix cache's events (``block_manager``),
an AllBlocksCleared as sequence 0, ``POST /flush_cache``, its usage report, and SGLang's
``--kv-events-config`` JSON (``bind`` included, no ``enable_kv_cache_events``); the other
flags and routes stay vLLM's.

With vLLM's ``--kv-transfer-config '{"kv_connector": "MooncakeStoreConnector", "kv_role":
"kv_both"}'`` and ``MOONCAKE_CONFIG_PATH`` naming vLLM's config file, the engine saves
blocks to and loads them from a real Mooncake store as vLLM's connector does
(``store_tier.py``; block shape ``--sim-store-*``, the tiny model's by default), and its
registration carries the store's master address (``kv_store``).

With vLLM's ``--enable-lora --lora-modules NAME=PATH ...`` it serves LoRA adapters as vLLM
does where the cache and the API can tell (``models.py``): no weights are read, only the
adapters' names and paths, which key their blocks and their KV events.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import aiohttp
import zmq
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from conductor.failures import cannot_listen, describe
from conductor.runtime import add_version_flag, configure_logging, log_level, port_number, run

from ..mooncake_store import KVBlockShape, MooncakeConfig, StoreError
from ..publisher import KVEventPublisher, binds, offset_endpoint
from .block_hash import ENGINES, HASH_ALGORITHMS, BlockHasher, PageHasher, SGLangBlockHasher
from .block_manager import BlockManager
from .loop import EngineLoop
from .metrics import EngineMetrics, cache_config_info
from .models import MAX_LORA_RANKS, LoraModule, ServedModels, parse_lora_module
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Scheduler
from .server import ServerSettings, create_app
from .store_tier import KVTransferConfig, StoreTier, connect
from .timing import TimingModel
from .tokenizer import EngineTokenizer, ModelTokenizer, Tokenizer

log = logging.getLogger("publishers.engine")

DEFAULT_MODEL = "mooncake-sim"
DEFAULT_MAX_MODEL_LEN = 131_072  # LLaMA-3.1-70B, the model the default timing describes
DEFAULT_HBM_BYTES = 8 * 80e9  # 8 x A800-80GB, as the timing model's defaults
WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::")
SHUTDOWN_SECONDS = 0.5  # per stage; SIGTERM to exit stays well under 2 s
REGISTER_BACKOFF = (0.1, 5.0)  # first and largest delay between attempts, seconds
_TIMING_FIELDS = list(fields(TimingModel))
STORE_DTYPES = ("float32", "float16", "bfloat16")


class KVEventsConfig(BaseModel):
    """vLLM's ``KVEventsConfig`` (the JSON of ``--kv-events-config``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, as vLLM
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000  # accepted; the publisher's queue is unbounded
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @property
    def bind(self) -> bool | None:
        return None  # vLLM decides from the endpoint (``publisher.binds``)


class SGLangKVEventsConfig(BaseModel):
    """SGLang's ``KVEventsConfig``: events are on when the publisher is ``zmq``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None  # None: decided from the endpoint, as vLLM
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000  # accepted; the publisher's queue is unbounded
    topic: str = ""
    format: Literal["default"] = "default"  # SGLang's own events ("dynamo" is not simulated)

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"


def _timing_flag(name: str) -> tuple[str, float]:
    """``prefill_overhead_s`` -> ``--sim-prefill-overhead-ms`` (times 1000), others as named."""
    if name.endswith("_s"):
        return f"--sim-{name[:-2].replace('_', '-')}-ms", 1000.0
    return f"--sim-{name.replace('_', '-')}", 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-engine-sim",
        description="A vLLM look-alike without GPUs: OpenAI API, prefix cache, KV events.",
    )
    vllm = parser.add_argument_group("vLLM flags (same names and meanings)")
    vllm.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, help=f"model name (default {DEFAULT_MODEL})"
    )
    vllm.add_argument(
        "--served-model-name", nargs="+", help="names the API accepts (default: the model name)"
    )
    vllm.add_argument(
        "--tokenizer",
        type=Path,
        help="an HF model directory to tokenize with, as vLLM does (tokenizer.json and its "
        "chat template); default: the simulator's stand-in tokenizer",
    )
    vllm.add_argument("--host", help="HTTP address (default: every interface)")
    vllm.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
    vllm.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    vllm.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        help="KV blocks of the GPU pool (default: what --sim-hbm-bytes leaves after the weights)",
    )
    vllm.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of HBM for weights and KV blocks (default 0.9)",
    )
    vllm.add_argument(
        "--max-model-len",
        type=int,
        default=DEFAULT_MAX_MODEL_LEN,
        help=f"longest prompt plus output, in tokens (default {DEFAULT_MAX_MODEL_LEN})",
    )
    vllm.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"most requests running at once (default {DEFAULT_MAX_NUM_SEQS})",
    )
    vllm.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=f"tokens one engine step computes (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}, "
        "or at least --max-model-len without chunked prefill, as vLLM)",
    )
    vllm.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split prompts over steps to fit the token budget (vLLM V1's default)",
    )
    vllm.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="serve /v1/completions/render and /v1/chat/completions/render (403 otherwise)",
    )
    vllm.add_argument(
        "--prefix-caching-hash-algo",
        choices=HASH_ALGORITHMS,
        help="block hash of the prefix cache and of the KV events (default sha256; vLLM only)",
    )
    vllm.add_argument(
        "--kv-events-config",
        help="vLLM's KVEventsConfig as JSON, e.g. '{\"enable_kv_cache_events\": true, "
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'; with '
        '--sim-engine sglang, SGLang\'s, e.g. \'{"publisher": "zmq", "endpoint": '
        '"tcp://127.0.0.1:5557", "bind": true}\' (default: no events)',
    )
    vllm.add_argument(
        "--kv-transfer-config",
        type=_kv_transfer_config,
        help='\'{"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}\': save '
        "blocks to and load them from the Mooncake store MOONCAKE_CONFIG_PATH describes",
    )
    vllm.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="serve the --lora-modules adapters (vLLM's flag)",
    )
    vllm.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help='LoRA adapters, as NAME=PATH or vLLM\'s JSON {"name", "path", '
        '"base_model_name"}; a request naming one runs with it. No weights are read: the '
        "simulator only needs each adapter's name and path, which key its blocks as in vLLM",
    )
    vllm.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="most adapters one engine step runs (default 1, vLLM's)",
    )
    vllm.add_argument(
        "--max-lora-rank",
        type=int,
        choices=MAX_LORA_RANKS,
        default=16,
        help="accepted for vLLM's command lines; nothing to size without weights (default 16)",
    )
    vllm.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help="rank in events and registration; offsets the event ports by it, as vLLM (default 0)",
    )

    sim = parser.add_argument_group("simulator flags")
    sim.add_argument(
        "--sim-engine",
        choices=ENGINES,
        default="vllm",
        help="the engine to imitate: its prefix cache, block hashes, KV events and cache "
        "flush (vllm: /reset_prefix_cache; sglang: /flush_cache) (default vllm)",
    )
    sim.add_argument(
        "--sim-instance-id",
        help="the engine's name in registrations, metrics and answers "
        "(default: <advertised host>:<port>)",
    )
    sim.add_argument(
        "--sim-register-with",
        metavar="URL",
        help="conductor to register the event stream with (unregistered at shutdown)",
    )
    sim.add_argument(
        "--sim-advertise-host",
        help="host peers use to reach this engine: in its registration and in the "
        "kv_transfer_params of prefills (default: --host, or 127.0.0.1 for a wildcard)",
    )
    sim.add_argument(
        "--sim-kv-bind",
        action="store_true",
        help="bind the event PUB socket whatever its endpoint (vLLM binds only '*', '::', "
        "ipc and inproc endpoints and connects to any other)",
    )
    sim.add_argument(
        "--sim-cpu-offload-blocks",
        type=int,
        default=0,
        help="KV blocks of a CPU tier that keeps blocks evicted from the GPU pool (default 0)",
    )
    sim.add_argument(
        "--sim-time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (0.01: a hundred times faster; 0: no waiting)",
    )
    sim.add_argument(
        "--sim-kv-transfer-timeout",
        type=float,
        default=480.0,
        help="wall seconds a prefill keeps its blocks for an absent decode side (vLLM NIXL's)",
    )
    sim.add_argument(
        "--sim-hbm-bytes",
        type=float,
        default=DEFAULT_HBM_BYTES,
        help="HBM of the instance, sizing the KV pool without --num-gpu-blocks-override",
    )
    sim.add_argument(
        "--sim-log-level",
        type=log_level,
        default="INFO",
        help="DEBUG, INFO, WARNING or ERROR (default INFO)",
    )
    add_version_flag(parser)
    store = parser.add_argument_group(
        "store blocks (--kv-transfer-config): [layers, 2, kv heads, block size, head dim]"
    )
    store.add_argument(
        "--sim-store-layers", type=int, default=2, help="layers (default 2, the tiny model's)"
    )
    store.add_argument("--sim-store-kv-heads", type=int, default=2, help="KV heads (default 2)")
    store.add_argument("--sim-store-head-dim", type=int, default=32, help="head size (default 32)")
    store.add_argument(
        "--sim-store-dtype",
        choices=STORE_DTYPES,
        default="float32",
        help="element type (default float32)",
    )
    timing = parser.add_argument_group("timing model (TimingModel's fields)")
    for field in _TIMING_FIELDS:
        flag, factor = _timing_flag(field.name)
        default = field.default * factor  # type: ignore[operator]
        unit = " ms" if factor != 1 else ""
        meaning = field.metadata["help"]
        timing.add_argument(
            flag, type=float, default=default, help=f"{meaning} (default {default:g}{unit})"
        )
    return parser


def kv_events_config(engine: str, text: str | None) -> KVEventsConfig | SGLangKVEventsConfig:
    """The engine's own ``KVEventsConfig`` from its JSON (None: events off)."""
    model = SGLangKVEventsConfig if engine == "sglang" else KVEventsConfig
    return model() if text is None else model.model_validate_json(text)


def _lora_module(text: str) -> LoraModule:
    try:
        return parse_lora_module(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def served_models(args: argparse.Namespace) -> ServedModels:
    """The base model's names (vLLM's ``--served-model-name``, default the model) and the
    adapters; ``check`` has vetted them."""
    names = args.served_model_name or [args.model]
    return ServedModels(names, args.model, args.lora_modules)


def _kv_transfer_config(text: str) -> KVTransferConfig:
    try:
        return KVTransferConfig.model_validate_json(text)
    except ValidationError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def store_shape(args: argparse.Namespace) -> KVBlockShape:
    return KVBlockShape(
        args.sim_store_layers,
        args.sim_store_kv_heads,
        args.block_size,
        args.sim_store_head_dim,
        args.sim_store_dtype,
    )


def open_store(args: argparse.Namespace, labels: dict[str, str]) -> StoreTier | None:
    """The store tier when ``--kv-transfer-config`` asks for one (``check`` vetted it)."""
    if args.kv_transfer_config is None:
        return None
    config, shape = args.mooncake_config, store_shape(args)
    tier = connect(args.kv_transfer_config, config, args.model, shape, labels)
    log.info("kv store master=%s model_key=%s", tier.master, tier.client.model_name)
    return tier


def timing_model(args: argparse.Namespace) -> TimingModel:
    values: dict[str, Any] = {}
    for field in _TIMING_FIELDS:
        flag, factor = _timing_flag(field.name)
        value = getattr(args, flag[2:].replace("-", "_")) / factor
        values[field.name] = int(value) if isinstance(field.default, int) else value
    return TimingModel(**values)


def max_num_batched_tokens(args: argparse.Namespace) -> int:
    """vLLM's rule: without chunked prefill the default budget fits any prompt."""
    if args.max_num_batched_tokens is not None:
        return args.max_num_batched_tokens
    if args.enable_chunked_prefill:
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_model_len)


def default_num_gpu_blocks(args: argparse.Namespace, timing: TimingModel) -> int:
    """vLLM's sizing: what HBM leaves for KV after the weights, in blocks."""
    free = args.sim_hbm_bytes * args.gpu_memory_utilization - timing.weight_bytes
    return max(1, int(free // (timing.kv_bytes_per_token * args.block_size)))


def connectable(endpoint: str, host: str) -> str:
    """A bound endpoint as peers reach it: a wildcard host becomes ``host``."""
    scheme, _, address = endpoint.partition("://")
    bound_host, _, port = address.rpartition(":")
    if scheme != "tcp" or bound_host.strip("[]") not in WILDCARD_HOSTS:
        return endpoint
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def create_publisher(args: argparse.Namespace) -> KVEventPublisher | None:
    config: KVEventsConfig | SGLangKVEventsConfig = args.kv_events_config
    if not config.enabled:
        return None
    return KVEventPublisher(
        config.endpoint,
        config.replay_endpoint,
        data_parallel_rank=args.data_parallel_rank,
        topic=config.topic,
        layout=args.sim_engine,
        buffer_steps=config.buffer_steps,
        hwm=config.hwm,
        bind=True if args.sim_kv_bind else config.bind,
    )


def kv_event_source(
    config: KVEventsConfig | SGLangKVEventsConfig, publisher: KVEventPublisher | None
) -> dict[str, Any] | None:
    """``/kv_event_sources``' entry: the config with the endpoints as bound (ports resolved)."""
    if publisher is None:
        return None
    bound = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
    return config.model_dump() | {"publisher": "zmq"} | bound


async def register(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bool:
    """POST /register until the conductor answers; False if it refuses (a 4xx is final)."""
    delay, max_delay = REGISTER_BACKOFF
    while True:
        try:
            async with session.post(f"{url}/register", json=body) as response:
                if response.status == 200:
                    log.info("registered conductor=%s endpoint=%s", url, body["endpoint"])
                    return True
                answer = await response.text()
                if response.status < 500:
                    log.error("registration refused status=%d body=%s", response.status, answer)
                    return False
                log.warning("registration failed status=%d body=%s", response.status, answer)
        except (aiohttp.ClientError, TimeoutError) as error:
            log.warning("conductor unreachable url=%s error=%s", url, describe(error))
        await asyncio.sleep(delay)
        delay = min(2 * delay, max_delay)


async def unregister(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """Best effort, bounded: a conductor that is gone must not delay shutdown."""
    try:
        async with session.post(
            f"{url}/unregister",
            json={"instance_id": body["instance_id"], "dp_rank": body["dp_rank"]},
            timeout=aiohttp.ClientTimeout(total=SHUTDOWN_SECONDS),
        ) as response:
            log.info("unregistered status=%d", response.status)
    except (aiohttp.ClientError, TimeoutError) as error:
        log.warning("unregister failed url=%s error=%s", url, describe(error))


class Registration:
    """This engine's event stream registered with a conductor while the engine runs.

    ``context`` is a ``cleanup_ctx``: it starts registering (retrying in the background) and,
    at the end, ``withdraw``s; shutdown withdraws earlier (``on_shutdown``), so the conductor
    stops counting this engine's cache before its requests end.
    """

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.url, self.body = url, body
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[bool] | None = None

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self._task = asyncio.create_task(register(self._session, self.url, self.body))
        yield
        await self.withdraw(app)

    async def withdraw(self, app: web.Application) -> None:
        """Stop registering; unregister if the conductor had accepted. Idempotent."""
        task, session, self._task, self._session = self._task, self._session, None, None
        if task is not None and session is not None:
            task.cancel()
            (registered,) = await asyncio.gather(task, return_exceptions=True)
            if registered is True:
                await unregister(session, self.url, self.body)
            await session.close()


def add_lifecycle(
    app: web.Application,
    engine: EngineLoop,
    publisher: KVEventPublisher | None,
    store: StoreTier | None,
    registration: Registration | None,
) -> None:
    """Every resource's start and stop as aiohttp ``cleanup_ctx``: started in this order when
    the app starts, stopped in reverse when it is cleaned up, also after a failed start.

    Shutdown (``on_shutdown``, before the server waits up to ``SHUTDOWN_SECONDS`` for its
    handlers) first unregisters, then ends every request, so a streaming client reads the
    engine's "shut down" error instead of a cut connection.
    """

    async def publisher_open(app: web.Application) -> AsyncIterator[None]:
        yield
        if publisher is not None:
            publisher.close(timeout=SHUTDOWN_SECONDS)

    async def store_open(app: web.Application) -> AsyncIterator[None]:
        yield
        if store is not None:
            await store.close()

    async def engine_running(app: web.Application) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.close()  # a no-op after end_requests; needed when start-up failed

    async def end_requests(app: web.Application) -> None:
        await engine.close()

    app.cleanup_ctx.extend([publisher_open, store_open, engine_running])
    if registration is not None:
        app.cleanup_ctx.append(registration.context)
        app.on_shutdown.append(registration.withdraw)
    app.on_shutdown.append(end_requests)


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGINT/SIGTERM; the app's lifecycle (``add_lifecycle``) opens and closes
    everything else."""
    tokenizer: EngineTokenizer = (
        Tokenizer() if args.tokenizer is None else ModelTokenizer(args.tokenizer)
    )
    timing = timing_model(args)
    blocks = BlockManager(
        args.num_gpu_blocks_override
        if args.num_gpu_blocks_override is not None
        else default_num_gpu_blocks(args, timing),
        args.block_size,
        num_cpu_blocks=args.sim_cpu_offload_blocks,
        hasher=page_hasher(args),
        engine=args.sim_engine,
    )
    scheduler = Scheduler(
        blocks,
        timing,
        num_ordinary_tokens=tokenizer.num_ordinary,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens(args),
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_loras=args.max_loras if args.enable_lora else None,
    )
    host = args.sim_advertise_host or (
        "127.0.0.1" if args.host in (None, *WILDCARD_HOSTS) else args.host
    )
    models = served_models(args)
    labels = {"model_name": models.names[0], "engine": str(args.data_parallel_rank)}
    store = open_store(args, labels)
    publisher = create_publisher(args)
    settings = ServerSettings(
        models=models,
        max_model_len=args.max_model_len,
        instance_id=args.sim_instance_id or f"{host}:{args.port}",
        remote_host=host,
        remote_port=args.port,
        data_parallel_rank=args.data_parallel_rank,
        enable_scale_out=args.enable_scale_out,
        kv_events_config=kv_event_source(args.kv_events_config, publisher),
        engine=args.sim_engine,
    )
    metrics = EngineMetrics(
        scheduler,
        labels,
        args.max_model_len,
        cache_config_info(
            block_size=args.block_size,
            num_gpu_blocks=blocks.num_gpu_blocks,
            num_cpu_blocks=args.sim_cpu_offload_blocks,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            gpu_memory_utilization=args.gpu_memory_utilization,
            prefix_caching_hash_algo=str(args.prefix_caching_hash_algo),  # SGLang: None
            kv_bytes_per_token=timing.kv_bytes_per_token,
            max_model_len=args.max_model_len,
        ),
        max_loras=args.max_loras if args.enable_lora else None,
    )
    if store is not None:
        metrics.registry.register(store.collector)
    engine = EngineLoop(
        scheduler,
        publisher,
        time_scale=args.sim_time_scale,
        kv_transfer_timeout=args.sim_kv_transfer_timeout,
        observer=metrics,
        connector=store,
    )
    registration = None
    if args.sim_register_with and publisher is not None:
        body = registration_body(args, settings, publisher, host, store)
        registration = Registration(args.sim_register_with, body)
    app = create_app(engine, tokenizer, settings, metrics)
    add_lifecycle(app, engine, publisher, store, registration)
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,  # a client that disconnects aborts its request
        shutdown_timeout=SHUTDOWN_SECONDS,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await runner.setup()
        try:
            await web.TCPSite(runner, args.host, args.port).start()
        except OSError as error:
            raise OSError(cannot_listen(args.host, args.port, error)) from None
        log.info(
            "serving host=%s port=%d instance_id=%s gpu_blocks=%d kv_endpoint=%s",
            args.host or "*",
            args.port,
            settings.instance_id,
            blocks.num_gpu_blocks,
            publisher.endpoint if publisher else None,
        )
        await stop.wait()
        log.info("shutting down")
    finally:
        await runner.cleanup()


def page_hasher(args: argparse.Namespace) -> PageHasher:
    """vLLM's hash as configured (``PYTHONHASHSEED`` from the environment, as vLLM), or
    SGLang's, which has no options."""
    if args.sim_engine == "sglang":
        return SGLangBlockHasher()
    return BlockHasher(args.prefix_caching_hash_algo, os.environ.get("PYTHONHASHSEED"))


def registration_body(
    args: argparse.Namespace,
    settings: ServerSettings,
    publisher: KVEventPublisher,
    host: str,
    store: StoreTier | None = None,
) -> dict[str, Any]:
    """The conductor's ``/register`` body for this engine's stream, as peers reach it; with
    a store, its master's address (``kv_store``), which shares the blocks the engine saves."""
    replay = publisher.replay_endpoint
    kv_store = {} if store is None else {"kv_store": store.master}
    return kv_store | {
        "endpoint": connectable(publisher.endpoint, host),
        "replay_endpoint": connectable(replay, host) if replay else "",
        "type": "SGLang" if args.sim_engine == "sglang" else "vLLM",
        "modelname": settings.models.names[0],
        "instance_id": settings.instance_id,
        "block_size": args.block_size,
        "dp_rank": args.data_parallel_rank,
    }


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse configurations that would start but never work; read the engine's own
    ``--kv-events-config``."""
    check_engine(args, parser)
    config: KVEventsConfig | SGLangKVEventsConfig = args.kv_events_config
    if args.sim_register_with:
        if not config.enabled:
            parser.error("--sim-register-with needs --kv-events-config with events enabled")
        endpoint = offset_endpoint(config.endpoint, args.data_parallel_rank)
        if not (args.sim_kv_bind or config.bind or binds(endpoint)):
            parser.error(
                f"--sim-register-with: the PUB socket connects to {endpoint} (vLLM's rule), "
                "so a conductor cannot subscribe to it; use a '*' endpoint or --sim-kv-bind"
            )
    if args.sim_time_scale < 0:
        parser.error("--sim-time-scale must be >= 0")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        parser.error("--max-num-batched-tokens must be >= 1")
    if not args.enable_chunked_prefill and max_num_batched_tokens(args) < args.max_model_len:
        parser.error(  # vLLM refuses this too: a long prompt could never be scheduled
            "--max-num-batched-tokens must be >= --max-model-len without chunked prefill"
        )
    check_store(args, parser)
    check_lora(args, parser)


def check_lora(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What vLLM refuses at start-up: adapters without --enable-lora, clashing names."""
    if args.max_loras < 1:
        parser.error("--max-loras must be >= 1")
    if not args.lora_modules:
        return
    if not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora (vLLM loads no adapter without it)")
    if args.sim_engine == "sglang":
        parser.error("--lora-modules is simulated for vLLM only, not with --sim-engine sglang")
    try:
        served_models(args)
    except ValueError as error:
        parser.error(f"argument --lora-modules: {error}")


def check_engine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The engine's events config; what only the vLLM stand-in simulates, refused for SGLang."""
    try:
        args.kv_events_config = kv_events_config(args.sim_engine, args.kv_events_config)
    except ValidationError as error:
        parser.error(f"argument --kv-events-config: {error}")
    if args.sim_engine == "vllm":
        args.prefix_caching_hash_algo = args.prefix_caching_hash_algo or "sha256"
        return
    vllm_only = {
        "--prefix-caching-hash-algo": args.prefix_caching_hash_algo is not None,
        "--sim-cpu-offload-blocks": args.sim_cpu_offload_blocks > 0,
        "--kv-transfer-config": args.kv_transfer_config is not None,
    }
    for flag in (flag for flag, given in vllm_only.items() if given):
        parser.error(f"{flag} is simulated for vLLM only, not with --sim-engine sglang")


def check_store(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A store connector needs its config file (vLLM's rule), the wheel, and a block shape."""
    args.mooncake_config = None
    if args.kv_transfer_config is None:
        return
    dims = (args.sim_store_layers, args.sim_store_kv_heads, args.sim_store_head_dim)
    if min(dims) < 1:
        parser.error("--sim-store-layers, --sim-store-kv-heads, --sim-store-head-dim must be >= 1")
    if importlib.util.find_spec("mooncake") is None or importlib.util.find_spec("torch") is None:
        parser.error("--kv-transfer-config needs the store client: pip install -e '.[store]'")
    try:
        args.mooncake_config = MooncakeConfig.from_env()
    except ValueError as error:
        parser.error(f"--kv-transfer-config: {error}")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(args, parser)
    configure_logging(args.sim_log_level)
    try:
        run(serve(args))
    except (OSError, zmq.ZMQError, ValueError, StoreError) as error:
        sys.exit(f"mooncake-engine-sim: {error}")


if __name__ == "__main__":
    main()
