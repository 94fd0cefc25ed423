"""The router's configuration: the upstream Mooncake cache-aware proxy's JSON layout
plus an optional ``routing`` section, or the equivalent CLI flags."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from conductor.config import master_address

from .policy import POLICIES, PrefillCostModel, RoutingParams


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)  # upstream keys like hash_profile


class ConductorSection(_Section):
    address: str = "http://127.0.0.1:13333"
    query_timeout_seconds: float = Field(default=0.2, gt=0)
    registration_timeout_seconds: float = Field(default=10.0, gt=0)
    # ours: re-register (idempotent) this often, so a restarted conductor relearns the fleet
    reregister_interval_seconds: float = Field(default=15.0, gt=0)
    # ours, with a store configured: how often to ask the conductor's /health whether the
    # store is up (a load from a store that is down is a recomputation)
    store_check_interval_seconds: float = Field(default=1.0, gt=0)

    @field_validator("address")
    @classmethod
    def _with_scheme(cls, value: str) -> str:
        value = value.rstrip("/")
        return value if "://" in value else f"http://{value}"


class StreamRegistration(_Section):
    """One KV-event stream of a prefill instance (one per DP rank)."""

    endpoint: str = Field(min_length=1)
    replay_endpoint: str = ""
    dp_rank: int = Field(default=0, ge=0)


class PrefillModelConfig(_Section):
    modelname: str = Field(min_length=1)
    block_size: int = Field(gt=0)
    tenant_id: str = "default"
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

    @model_validator(mode="after")
    def _unique_ids(self) -> PrefillSection:
        ids = [i.instance_id for i in self.instances]
        if len(ids) != len(set(ids)):
            raise ValueError("prefill instance_id values must be unique")
        return self


class DecodeSection(_Section):
    instances: list[DecodeInstance] = Field(default_factory=list)


def _known_policy(value: str) -> str:
    if value not in POLICIES:
        raise ValueError(f"must be one of {', '.join(POLICIES)}")
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
    cost: PrefillCostModel = PrefillCostModel()

    @field_validator("cost")
    @classmethod
    def _store_cost(cls, cost: PrefillCostModel) -> PrefillCostModel:
        if not (cost.store_bytes_per_token > 0 and cost.store_bandwidth_bytes_s > 0):
            raise ValueError("store_bytes_per_token and store_bandwidth_bytes_s must be > 0")
        return cost


class RouterConfig(_Section):
    conductor: ConductorSection = ConductorSection()
    prefill: PrefillSection
    decode: DecodeSection = DecodeSection()
    routing: RoutingSection = RoutingSection()

    @model_validator(mode="after")
    def _balancing_needs_a_store(self) -> RouterConfig:
        """KV balancing pulls a peer's prefix through a shared store: without one no engine
        can load it, and the router would promise hits that are recomputed."""
        threshold = self.routing.balance_threshold
        if threshold is not None and math.isfinite(threshold) and not self.kv_stores():
            raise ValueError(
                "routing.balance_threshold needs a KV transfer path: set kv_store (the "
                "Mooncake store master host:port the engines save to) on the prefill "
                "instances, or drop balance_threshold"
            )
        return self

    def kv_stores(self) -> dict[str, str]:
        """instance_id → the store it shares, for the instances that have one."""
        return {i.instance_id: i.kv_store for i in self.prefill.instances if i.kv_store}

    def routing_params(self) -> RoutingParams:
        routing = self.routing
        return RoutingParams(
            policy=routing.policy,
            block_size=self.prefill.config.block_size,
            overlap_weight=routing.overlap_weight,
            temperature=routing.temperature,
            balance_threshold=routing.balance_threshold,
            ttft_slo_s=None if routing.ttft_slo_ms is None else routing.ttft_slo_ms / 1000,
            ttft_slack=routing.ttft_slack,
            cost=routing.cost,
        )


def _hosts_ports(hosts: list[str], ports: list[int], what: str) -> list[str]:
    if len(ports) == 1 and len(hosts) > 1:
        ports = ports * len(hosts)
    if len(hosts) != len(ports):
        raise ValueError(f"--{what}-hosts and --{what}-ports must pair up")
    return [f"http://{host}:{port}" for host, port in zip(hosts, ports, strict=True)]


def from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The same layout built from the upstream proxy's flags."""
    prefill_urls = _hosts_ports(args.prefiller_hosts, args.prefiller_ports, "prefiller")
    ids = args.prefiller_instance_ids or [f"prefill-{i}" for i in range(len(prefill_urls))]
    if len(ids) != len(prefill_urls):
        raise ValueError("--prefiller-instance-ids must name every prefill instance")
    registrations: dict[str, list[dict[str, Any]]] = {name: [] for name in ids}
    for name, rank, endpoint in args.prefiller_registration or []:
        if name not in registrations:
            raise ValueError(f"--prefiller-registration names unknown instance {name!r}")
        registrations[name].append({"endpoint": endpoint, "dp_rank": int(rank)})
    decode_urls = (
        _hosts_ports(args.decoder_hosts, args.decoder_ports, "decoder")
        if args.decoder_hosts
        else []
    )
    routing: dict[str, Any] = {"policy": args.policy}
    if args.ttft_slo_ms is not None:
        routing["ttft_slo_ms"] = args.ttft_slo_ms
    return {
        "conductor": {
            "address": args.conductor_address,
            "query_timeout_seconds": args.query_timeout_seconds,
            "registration_timeout_seconds": args.registration_timeout_seconds,
        },
        "prefill": {
            "config": {
                "modelname": args.modelname,
                "block_size": args.block_size,
                "tenant_id": args.tenant_id,
                "lora_name": args.lora_name,
            },
            "instances": [
                {"instance_id": name, "http_endpoint": url, "registrations": registrations[name]}
                for name, url in zip(ids, prefill_urls, strict=True)
            ],
        },
        "decode": {"instances": [{"http_endpoint": url} for url in decode_urls]},
        "routing": routing,
    }


def add_cli_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="JSON config (upstream proxy layout)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefiller-hosts", nargs="+", default=[])
    parser.add_argument("--prefiller-ports", nargs="+", type=int, default=[])
    parser.add_argument("--prefiller-instance-ids", nargs="+")
    parser.add_argument(
        "--prefiller-registration",
        nargs=3,
        action="append",
        metavar=("INSTANCE_ID", "DP_RANK", "ENDPOINT"),
        help="a KV-event stream to register with the conductor (repeatable)",
    )
    parser.add_argument("--decoder-hosts", nargs="+", default=[])
    parser.add_argument("--decoder-ports", nargs="+", type=int, default=[])
    parser.add_argument("--conductor-address", default="http://127.0.0.1:13333")
    parser.add_argument("--modelname")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tenant-id", default="default")
    parser.add_argument("--lora-name", default="")
    parser.add_argument("--query-timeout-seconds", type=float, default=0.2)
    parser.add_argument("--registration-timeout-seconds", type=float, default=10.0)
    parser.add_argument("--policy", default="ttft", choices=POLICIES)
    parser.add_argument("--ttft-slo-ms", type=float)


def load(args: argparse.Namespace) -> RouterConfig:
    """``--config FILE`` or the CLI flags; raises ValueError (pydantic's) with the reason."""
    if args.config is not None:
        data = json.loads(args.config.read_text(encoding="utf-8"))
    else:
        if not args.prefiller_hosts or not args.modelname:
            raise ValueError("give --config FILE, or --prefiller-hosts/--ports and --modelname")
        data = from_cli(args)
    return RouterConfig.model_validate(data)
