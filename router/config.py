"""The router's configuration: the upstream Mooncake cache-aware proxy's JSON layout
plus our optional sections, or the equivalent CLI flags.

Where a setting comes from: a flag given on the command line, else its environment variable,
else the config file, else the default (docs/router.md has the table). Unknown keys are
errors naming the key and its section; the few keys of the upstream proxy's layout that
this router has no use for are listed in ``UPSTREAM_ONLY_KEYS`` and ignored. A bad value is
a ``ConfigError`` naming where it came from: the config file, the flag or the variable.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from conductor.config import PeerUrls, master_address, one_line
from conductor.runtime import port_number
from tokenization.prompt_encoder import CHUNK_CACHE_TOKENS
from tokenization.tokenizer import hub_cache_directory

from .pending import GRACE_S, MAX_PENDING_S
from .policy import REGISTRY, PrefillCostModel, RoutingParams
from .tracing import TracingSection


class ConfigError(ValueError):
    """Settings the router cannot start with; the message says where the bad one is."""


class _Section(BaseModel):
    """A section: unknown keys are rejected by name, but for ``upstream_only`` (keys of the
    upstream proxy's layout that mean nothing here)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    upstream_only: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_upstream_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.upstream_only:
            return {k: v for k, v in data.items() if k not in cls.upstream_only}
        return data


def _with_scheme(value: str) -> str:
    value = value.strip().rstrip("/")
    if not value:
        raise ValueError("a conductor address cannot be empty")
    return value if "://" in value else f"http://{value}"


ConductorAddress = Annotated[str, AfterValidator(_with_scheme)]


class ConductorSection(_Section):
    # one address or several (also ``addresses``): registered with all, queried one at a
    # time, failing over to the next on an error or a timeout
    address: ConductorAddress | list[ConductorAddress] = "http://127.0.0.1:13333"
    addresses: list[ConductorAddress] = Field(default_factory=list)
    # sent as ``Authorization: Bearer`` on every conductor call ("": none)
    auth_token: str = ""
    query_timeout_seconds: float = Field(default=0.2, gt=0)
    registration_timeout_seconds: float = Field(default=10.0, gt=0)
    # ours: re-register (idempotent) this often, so a restarted conductor relearns the fleet
    reregister_interval_seconds: float = Field(default=15.0, gt=0)
    # ours, with a store configured: how often to ask the conductor's /health whether the
    # store is up (a load from a store that is down is a recomputation)
    store_check_interval_seconds: float = Field(default=1.0, gt=0)
    # ours: index the engines' events inside the router (router/embedded.py) instead of
    # asking a conductor service; the addresses are then unused
    embedded: bool = False
    # ours, with ``embedded``: the embedded index's snapshot, as a conductor's settings of
    # the same names (docs/operations.md, "Snapshots"): the file written every
    # ``snapshot_interval_s`` and at shutdown and read at start ("": none), and the
    # conductors' (or embedded-index routers') URLs a snapshot is taken from at start
    snapshot_path: str = ""
    snapshot_interval_s: float = Field(default=60.0, gt=0, le=86_400)
    peers: PeerUrls = ()
    peer_timeout_s: float = Field(default=10.0, gt=0, le=600)
    # ours: report each routed prompt to the conductors (``/routed``), where the other router
    # replicas' queries count it for this long; false for a conductor without the route
    share_routed: bool = True
    share_routed_ttl_seconds: float = Field(default=10.0, gt=0, le=60)
    # ours: report this router's load per instance to the conductors (``/loads``) and add
    # the other replicas' to it (router/replica_load.py); a report counts for this long
    share_load: bool = True
    share_load_ttl_seconds: float = Field(default=3.0, gt=0, le=60)

    def urls(self) -> list[str]:
        """Every conductor, in failover order, each once."""
        first = [self.address] if isinstance(self.address, str) else self.address
        return list(dict.fromkeys([*first, *self.addresses]))

    @model_validator(mode="after")
    def _some_address(self) -> ConductorSection:
        if not self.urls():
            raise ValueError("conductor.address: give at least one conductor address")
        if not self.embedded and (self.snapshot_path or self.peers):
            raise ValueError(
                "conductor.snapshot_path and conductor.peers are the embedded index's "
                "(conductor.embedded: true); a conductor service has its own"
            )
        return self


class UpstreamSection(_Section):
    """Ours: how long the router waits on an engine (every call has a timeout)."""

    connect_timeout_seconds: float = Field(default=2.0, gt=0)
    # until the answer's first byte (a non-streamed answer's first byte is its end)
    first_byte_timeout_seconds: float = Field(default=300.0, gt=0)
    # until a streamed answer's headers (vLLM sends them before the first token): an engine
    # that accepted the connection and says nothing is passed over long before the above
    stream_headers_timeout_seconds: float = Field(default=15.0, gt=0)
    # between two chunks of an answer once it started
    idle_timeout_seconds: float = Field(default=120.0, gt=0)
    # one /tokenize call; past it the next engine's tokenizer is asked
    tokenize_timeout_seconds: float = Field(default=2.0, gt=0)
    # /health probes, /metrics scrapes, /v1/models
    control_timeout_seconds: float = Field(default=1.0, gt=0)
    # how often an upstream out of rotation is probed (and reported down to the conductor)
    probe_interval_seconds: float = Field(default=1.0, gt=0)
    # how often each engine's /metrics is read (its own load, its store loads)
    metrics_interval_seconds: float = Field(default=2.0, gt=0)
    # the engines' own API key (their --api-key), sent as ``Authorization: Bearer``; "": the
    # client's Authorization is passed on, unless the router checks keys itself (then none)
    api_key: str = Field(default="", repr=False)


class LimitsSection(_Section):
    """Ours: what one request may hold, so that none holds the event loop for long."""

    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    # JSON values in a request body (commas, counted before parsing) and tokens in a prompt
    max_json_items: int = Field(default=150_000, gt=0)
    max_json_depth: int = Field(default=32, gt=0)
    body_read_timeout_seconds: float = Field(default=30.0, gt=0)


class TokenizerSection(_Section):
    """Ours: tokenize in the router with a model directory's HF tokenizer (tokenizer.json,
    tokenizer_config.json's chat template) instead of asking an engine's ``/tokenize``."""

    # the model directory; absent: the served model's name when it is a local directory
    # holding a tokenizer.json, else its snapshot in the Hugging Face cache, else the
    # directory the model's engines name (/v1/models ``root``) when this host can read it;
    # till then every prompt goes to an engine's /tokenize
    path: Path | None = None
    # compare with an engine's /tokenize (a few probe prompts) before trusting it
    verify: bool = True
    # ids of long prompts' chunks kept for the next prompt sharing them (0: no chunks)
    chunk_cache_tokens: int = Field(default=CHUNK_CACHE_TOKENS, ge=0)
    # send a completion's text prompt on as the ids the router computed (vLLM takes a
    # prompt of ids), so the engine does not tokenize it again; a request with ``echo``
    # keeps its text (the engine would echo the ids' decoding)
    forward_token_ids: bool = True

    def directory(self, modelname: str) -> Path | None:
        """The directory to load: ``path``, else ``modelname`` when it names one holding a
        tokenizer.json, else the model's snapshot in the local Hugging Face cache."""
        if self.path is not None:
            return self.path.expanduser()
        candidate = Path(modelname).expanduser()
        if (candidate / "tokenizer.json").is_file():
            return candidate
        return hub_cache_directory(modelname)


class KeysSection(_Section):
    """Ours: client API keys (docs/keys.md). Without a file every request is served as the
    shared default tenant's, with no limits but the models' own."""

    file: Path | None = None
    # how often the file is looked at for changes (also reread on SIGHUP)
    reload_interval_seconds: float = Field(default=5.0, gt=0)


class StreamRegistration(_Section):
    """One KV-event stream of a prefill instance (one per DP rank)."""

    endpoint: str = Field(min_length=1)
    replay_endpoint: str = ""
    dp_rank: int = Field(default=0, ge=0)
    type: Literal["vLLM", "SGLang"] = "vLLM"  # the engine publishing it, for the conductor


class PrefillModelConfig(_Section):
    upstream_only = frozenset({"hash_profile"})  # the conductor hashes as the engines do

    modelname: str = Field(min_length=1)
    block_size: int = Field(gt=0)
    tenant_id: str = "default"
    # the LoRA the model name's own requests are indexed under (upstream's one-adapter
    # proxy); the adapters a request names are in ``ModelSection.adapters``
    lora_name: str = ""


class PrefillInstance(_Section):
    instance_id: str = Field(min_length=1)
    http_endpoint: str = Field(min_length=1)
    registrations: list[StreamRegistration] = Field(default_factory=list)
    # ours: the Mooncake store master (host:port) the engine saves its KV to and loads from
    # (vLLM's MooncakeStoreConnector); sent in its registrations. Empty: none
    kv_store: Annotated[str, AfterValidator(lambda v: v and master_address(v))] = ""


class DecodeInstance(_Section):
    instance_id: str = ""
    http_endpoint: str = Field(min_length=1)


class PrefillSection(_Section):
    config: PrefillModelConfig
    instances: list[PrefillInstance] = Field(min_length=1)


class DecodeSection(_Section):
    instances: list[DecodeInstance] = Field(default_factory=list)


def _known_policy(value: str) -> str:
    if value not in REGISTRY:
        raise ValueError(f"must be one of {', '.join(REGISTRY)}")
    return value


PolicyName = Annotated[str, AfterValidator(_known_policy)]


class RoutingSection(_Section):
    policy: PolicyName = "ttft"
    overlap_weight: float = 1.0
    temperature: float = Field(default=0.0, ge=0)
    # KV balancing through the store; absent: on at STORE_BALANCE_THRESHOLD when a prefill
    # instance has a kv_store ("inf" turns it off)
    balance_threshold: float | None = Field(default=None, ge=1)
    ttft_slo_ms: float | None = Field(default=None, gt=0)
    ttft_slack: float = Field(default=RoutingParams().ttft_slack, ge=0)
    learn_cost_model: bool = True
    # count a prompt sent to an instance as cached there while it runs and after it ends
    # until the index has it (as the conductor says: ours, or the embedded index); where
    # the conductor cannot say (the Go service), for in_flight_grace_seconds after the end
    in_flight_prefixes: bool = True
    in_flight_grace_seconds: float = Field(default=GRACE_S, gt=0, le=MAX_PENDING_S)
    cost: PrefillCostModel = PrefillCostModel()

    @field_validator("cost")
    @classmethod
    def _store_cost(cls, cost: PrefillCostModel) -> PrefillCostModel:
        if not (cost.store_bytes_per_token > 0 and cost.store_bandwidth_bytes_s > 0):
            raise ValueError("store_bytes_per_token and store_bandwidth_bytes_s must be > 0")
        return cost


class ModelSection(PrefillModelConfig):
    """Ours: one served model, its engines, LoRA adapters and settings. The upstream layout's
    ``prefill`` (and ``decode``) sections are the one-model case of a ``models`` list."""

    # the LoRA adapters its engines serve, by the names requests give (vLLM's
    # ``--lora-modules NAME=PATH``); adapters the engines list in /v1/models count too
    adapters: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    default: bool = False  # requests without a model go here (else to the first model)
    instances: list[PrefillInstance] = Field(min_length=1)
    decode: list[DecodeInstance] = Field(default_factory=list)
    # the top-level sections' keys, overridden key by key (the tokenizer's path is per model)
    routing: RoutingSection = RoutingSection()
    tokenizer: TokenizerSection = TokenizerSection()
    max_concurrent_requests: int = Field(default=0, ge=0)  # at the engines at once; 0: any
    max_queued_requests: int = Field(default=1024, ge=0)  # waiting for one of those

    def kv_stores(self) -> dict[str, str]:
        """instance_id → the store it shares, for the instances that have one."""
        return {i.instance_id: i.kv_store for i in self.instances if i.kv_store}

    def routing_params(self) -> RoutingParams:
        routing = self.routing
        return RoutingParams(
            policy=routing.policy,
            block_size=self.block_size,
            overlap_weight=routing.overlap_weight,
            temperature=routing.temperature,
            balance_threshold=routing.balance_threshold,
            ttft_slo_s=None if routing.ttft_slo_ms is None else routing.ttft_slo_ms / 1000,
            ttft_slack=routing.ttft_slack,
            cost=routing.cost,
        )

    @model_validator(mode="after")
    def _balancing_needs_a_store(self) -> ModelSection:
        _check_balancing(self)
        return self


def _check_balancing(model: ModelSection) -> None:
    """KV balancing pulls a peer's prefix through a shared store: without one no engine can
    load it, and the router would promise hits that are recomputed."""
    threshold = model.routing.balance_threshold
    if threshold is not None and math.isfinite(threshold) and not model.kv_stores():
        raise ValueError(
            "routing.balance_threshold needs a KV transfer path: set kv_store (the Mooncake "
            "store master host:port the engines save to) on the prefill instances, or drop "
            "balance_threshold"
        )


def _inherit(section: Any, defaults: Any, skip: tuple[str, ...] = ()) -> Any:
    """A model's section over the top-level one's keys (both as written in the file)."""
    if section is None:
        section = {}
    if not isinstance(section, dict) or not isinstance(defaults, dict):
        return section
    return {**{k: v for k, v in defaults.items() if k not in skip}, **section}


class RouterConfig(_Section):
    conductor: ConductorSection = ConductorSection()
    # the upstream layout's one model, or ours: several (one of the two)
    prefill: PrefillSection | None = None
    decode: DecodeSection = DecodeSection()
    models: list[ModelSection] = Field(default_factory=list)
    routing: RoutingSection = RoutingSection()
    upstream: UpstreamSection = UpstreamSection()
    limits: LimitsSection = LimitsSection()
    tokenizer: TokenizerSection = TokenizerSection()
    keys: KeysSection = KeysSection()
    tracing: TracingSection = TracingSection()

    @model_validator(mode="before")
    @classmethod
    def _models_inherit(cls, data: Any) -> Any:
        """Each listed model's routing and tokenizer: the top-level keys, then its own."""
        if not isinstance(data, dict) or not isinstance(data.get("models"), list):
            return data
        routing, tokenizer = data.get("routing"), data.get("tokenizer")
        models = [
            {
                **model,
                "routing": _inherit(model.get("routing"), routing),
                "tokenizer": _inherit(model.get("tokenizer"), tokenizer, skip=("path",)),
            }
            if isinstance(model, dict)
            else model
            for model in data["models"]
        ]
        return {**data, "models": models}

    @model_validator(mode="after")
    def _one_layout(self) -> RouterConfig:
        if self.prefill is None and not self.models:
            raise ValueError("give the served models: `models`, or `prefill` for one model")
        if self.prefill is not None and self.models:
            raise ValueError("give `prefill` (one model) or `models`, not both")
        if self.models and self.decode.instances:
            raise ValueError("with `models`, each model lists its own `decode` instances")
        if self.prefill is not None:  # the upstream layout is checked as one model too
            _check_balancing(self.served_models()[0])
        _check_unique(self.served_models())
        return self

    def served_models(self) -> list[ModelSection]:
        """The served models: ``models``, or the one model the upstream layout describes."""
        if self.models or self.prefill is None:
            return self.models
        return [
            ModelSection.model_construct(  # of validated parts
                **self.prefill.config.model_dump(),
                instances=self.prefill.instances,
                decode=self.decode.instances,
                routing=self.routing,
                tokenizer=self.tokenizer,
            )
        ]

    def kv_stores(self) -> dict[str, str]:
        """instance_id → the store it shares, for the instances that have one."""
        return {k: v for model in self.served_models() for k, v in model.kv_stores().items()}


def _check_unique(models: list[ModelSection]) -> None:
    """Names a request or the index tells apart: model and adapter names, instance ids."""
    names = [m.modelname for m in models] + [a for m in models for a in m.adapters]
    instances = [i.instance_id for m in models for i in m.instances]
    instances += [i.instance_id for m in models for i in m.decode if i.instance_id]
    for what, values in (("model and adapter names", names), ("instance_id values", instances)):
        if repeated := sorted({v for v in values if values.count(v) > 1}):
            raise ValueError(f"{what} must be unique: {', '.join(repeated)} repeated")
    if sum(m.default for m in models) > 1:
        raise ValueError("at most one model can be the default")


# flag (argparse dest) → where its value goes in the layout
FLAG_KEYS: dict[str, tuple[str, ...]] = {
    "conductor_address": ("conductor", "address"),
    "query_timeout_seconds": ("conductor", "query_timeout_seconds"),
    "registration_timeout_seconds": ("conductor", "registration_timeout_seconds"),
    "stream_headers_timeout_seconds": ("upstream", "stream_headers_timeout_seconds"),
    "modelname": ("prefill", "config", "modelname"),
    "block_size": ("prefill", "config", "block_size"),
    "tenant_id": ("prefill", "config", "tenant_id"),
    "lora_name": ("prefill", "config", "lora_name"),
    "policy": ("routing", "policy"),
    "ttft_slo_ms": ("routing", "ttft_slo_ms"),
    "max_body_bytes": ("limits", "max_body_bytes"),
    "tokenizer": ("tokenizer", "path"),
    "keys_file": ("keys", "file"),
    "otlp_endpoint": ("tracing", "otlp_endpoint"),
}
# environment variable → where its value goes (below flags, above the file)
ENV_KEYS: dict[str, tuple[str, ...]] = {
    "ROUTER_CONDUCTOR_ADDRESS": ("conductor", "address"),  # comma-separated for several
    "ROUTER_CONDUCTOR_TOKEN": ("conductor", "auth_token"),
    "ROUTER_KEYS_FILE": ("keys", "file"),
    "ROUTER_UPSTREAM_API_KEY": ("upstream", "api_key"),
    "ROUTER_OTLP_ENDPOINT": ("tracing", "otlp_endpoint"),
}
CLI_ONLY_DEFAULTS = {"prefill": {"config": {"block_size": 16}}}  # without a config file


def _hosts_ports(hosts: list[str], ports: list[int], what: str) -> list[str]:
    if len(ports) == 1 and len(hosts) > 1:
        ports = ports * len(hosts)
    if len(hosts) != len(ports):
        raise ConfigError(f"--{what}-hosts and --{what}-ports must pair up")
    return [f"http://{host}:{port}" for host, port in zip(hosts, ports, strict=True)]


def _prefill_instances(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prefill instances the upstream proxy's flags describe."""
    prefill_urls = _hosts_ports(args.prefiller_hosts, args.prefiller_ports, "prefiller")
    ids = args.prefiller_instance_ids or [f"prefill-{i}" for i in range(len(prefill_urls))]
    if len(ids) != len(prefill_urls):
        raise ConfigError("--prefiller-instance-ids must name every prefill instance")
    registrations: dict[str, list[dict[str, Any]]] = {name: [] for name in ids}
    for name, rank, endpoint in args.prefiller_registration or []:
        if name not in registrations:
            raise ConfigError(f"--prefiller-registration names unknown instance {name}")
        registrations[name].append({"endpoint": endpoint, "dp_rank": int(rank)})
    return [
        {"instance_id": name, "http_endpoint": url, "registrations": registrations[name]}
        for name, url in zip(ids, prefill_urls, strict=True)
    ]


def _put(layout: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set ``layout[a][b]... = value``, making (or replacing non-object) sections."""
    for key in path[:-1]:
        section = layout.get(key)
        layout[key] = section = section if isinstance(section, dict) else {}
        layout = section
    layout[path[-1]] = value


def read_file(path: Path) -> dict[str, Any]:
    """The config file's JSON object; raises ConfigError naming the file and what is wrong."""
    if not path.expanduser().exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = json.loads(path.expanduser().read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        where = f"line {error.lineno} column {error.colno}"
        raise ConfigError(f"{path}: not valid JSON: {error.msg} at {where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a JSON object")
    return data


def layout(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """The config file (or the flags' defaults), then the environment, then the flags."""
    if args.config is not None:
        data = read_file(args.config)
    elif not args.prefiller_hosts or args.modelname is None:
        raise ConfigError("give --config FILE, or --prefiller-hosts/--ports and --modelname")
    else:
        data = json.loads(json.dumps(CLI_ONLY_DEFAULTS))
    for name, path in ENV_KEYS.items():
        if environ.get(name):
            value = [a for a in environ[name].split(",") if a.strip()]
            _put(data, path, value if path[-1] == "address" else environ[name])
    for dest, path in FLAG_KEYS.items():
        if (value := getattr(args, dest)) is not None:
            _put(data, path, value)
    if args.prefiller_hosts:
        _put(data, ("prefill", "instances"), _prefill_instances(args))
    elif args.prefiller_registration:
        raise ConfigError("--prefiller-registration needs --prefiller-hosts")
    if args.decoder_hosts:
        urls = _hosts_ports(args.decoder_hosts, args.decoder_ports, "decoder")
        _put(data, ("decode", "instances"), [{"http_endpoint": url} for url in urls])
    return data


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    """The upstream proxy's flags and ours; each overrides the config file's value."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="JSON config in the upstream Mooncake proxy's layout plus our sections "
        "(docs/router.md); the flags below override its values",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("ROUTER_HOST", "0.0.0.0"),
        help="address to listen on (env ROUTER_HOST; default 0.0.0.0: all)",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=os.environ.get("ROUTER_PORT", "8000"),  # a string default goes through type
        help="port to listen on (env ROUTER_PORT; default 8000)",
    )
    parser.add_argument(
        "--prefiller-hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts of the prefill instances (replaces the file's prefill.instances)",
    )
    parser.add_argument(
        "--prefiller-ports",
        nargs="+",
        type=port_number,
        default=[],
        metavar="PORT",
        help="their HTTP ports, one per host (or one for all)",
    )
    parser.add_argument(
        "--prefiller-instance-ids",
        nargs="+",
        metavar="ID",
        help="their instance ids as their KV events name them (default prefill-0, prefill-1...)",
    )
    parser.add_argument(
        "--prefiller-registration",
        nargs=3,
        action="append",
        metavar=("INSTANCE_ID", "DP_RANK", "ENDPOINT"),
        help="a KV-event stream to register with the conductor (repeatable)",
    )
    parser.add_argument(
        "--decoder-hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="hosts of the decode instances, for prefill/decode disaggregation "
        "(replaces the file's decode.instances)",
    )
    parser.add_argument(
        "--decoder-ports",
        nargs="+",
        type=port_number,
        default=[],
        metavar="PORT",
        help="their HTTP ports, one per host (or one for all)",
    )
    parser.add_argument(
        "--conductor-address",
        nargs="+",
        help="one conductor or several, in failover order (env ROUTER_CONDUCTOR_ADDRESS)",
    )
    parser.add_argument(
        "--modelname", help="the served model's name, as the engines and their events name it"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        help="the engines' KV block size in tokens (default 16 without --config)",
    )
    parser.add_argument(
        "--tenant-id", help="the tenant the streams are registered under (default: default)"
    )
    parser.add_argument(
        "--lora-name", help="the LoRA adapter the engines serve, if any (part of the cache key)"
    )
    parser.add_argument(
        "--query-timeout-seconds",
        type=float,
        help="how long a request waits for a conductor's answer before routing by load "
        "(default 0.2)",
    )
    parser.add_argument(
        "--registration-timeout-seconds",
        type=float,
        help="how long one registration round retries an unreachable conductor (default "
        "10; the router serves meanwhile and tries again later)",
    )
    parser.add_argument(
        "--stream-headers-timeout-seconds",
        type=float,
        help="how long a streamed request waits for an engine's response headers before "
        "the next engine is tried (default 15)",
    )
    parser.add_argument(
        "--policy",
        choices=list(REGISTRY),
        help="the routing policy (default ttft): "
        + "; ".join(policy.describe() for policy in REGISTRY.values()),
    )
    parser.add_argument(
        "--ttft-slo-ms",
        type=float,
        help="reject (429) a request whose best estimated time to first token exceeds this",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, help="largest request body accepted (default 8 MiB)"
    )
    parser.add_argument(
        "--keys-file",
        help="client API keys, tenants and limits (docs/keys.md); reread when it changes "
        "(env ROUTER_KEYS_FILE). Without it every request is served, unauthenticated",
    )
    parser.add_argument(
        "--otlp-endpoint",
        help="export request traces to this OTLP/HTTP collector (docs/tracing.md; env "
        "ROUTER_OTLP_ENDPOINT; needs the tracing extra)",
    )
    parser.add_argument(
        "--tokenizer",
        help="model directory whose HF tokenizer the router tokenizes with (default: the "
        "served model's name when it is a local directory; else engines' /tokenize)",
    )


def load(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> RouterConfig:
    """The settings from every source; raises ConfigError: ``<source>: <key path>: <reason>``,
    the source being the flag or environment variable that set the value, else the file."""
    data = layout(args, environ)
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as error:
        location = tuple(str(part) for part in error.errors()[0]["loc"])
        source = _source(location, args, environ) or args.config
        reason = one_line(error)
        raise ConfigError(f"{source}: {reason}" if source else reason) from None


def _source(
    location: tuple[str, ...], args: argparse.Namespace, environ: Mapping[str, str]
) -> str | None:
    """The flag, else the environment variable, that set the value at ``location``."""
    set_by = [
        (path, "--" + dest.replace("_", "-"))
        for dest, path in FLAG_KEYS.items()
        if getattr(args, dest) is not None
    ]
    if args.prefiller_hosts:
        set_by.append((("prefill", "instances"), "--prefiller-hosts"))
    if args.decoder_hosts:
        set_by.append((("decode", "instances"), "--decoder-hosts"))
    set_by += [(path, name) for name, path in ENV_KEYS.items() if environ.get(name)]
    return next((where for path, where in set_by if location[: len(path)] == path), None)
