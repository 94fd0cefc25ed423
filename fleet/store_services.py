"""The fleet's Mooncake store: ``mooncake_master`` and one store process lending it memory.

The store process holds all of the store's memory and the engines are pure clients of it
(the layout that moved KV reliably over TCP; with every engine lending a segment of its own,
about one load in three stalled). The master starts first; the store process counts as
ready once the master reports its memory, and the engines start only then.

Every address the fleet gives is 127.0.0.1, and every store process and client advertises
loopback (``LOOPBACK_ENV``). The binaries still open some listening sockets on every
interface whatever their flags say (the master's metadata server, the transfer engine's
RPC and data ports): on a machine others can reach, run the fleet in a network namespace
of its own (``scripts/isolated-net.sh``) or behind a firewall.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from publishers.local import free_port
from publishers.mooncake_store import (
    LOOPBACK_ENV,
    MIB,
    STORE_CONNECTOR,
    StoreAddress,
    connector_config,
    master_command,
    store_process_command,
)

from .service import ServicePlan
from .spec import MASTER_NAME, STORE_NAME, StoreSection
from .tiny_model import write_json

LOOPBACK = "127.0.0.1"
CONFIG_FILE = "mooncake.json"  # what MOONCAKE_CONFIG_PATH names, in the run directory
_CAPACITY = re.compile(r"^master_total_capacity_bytes\s+(\S+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class StorePlan:
    master: ServicePlan
    store: ServicePlan
    address: StoreAddress
    admin_url: str  # the master's admin HTTP server: /health, /metrics, /get_all_keys
    config_path: Path
    segment_mb: int

    def engine_args(self) -> list[str]:
        return ["--kv-transfer-config", json.dumps(STORE_CONNECTOR)]

    def engine_env(self) -> dict[str, str | None]:
        """What vLLM's store connector reads (the simulator reads the same)."""
        return {
            "MOONCAKE_CONFIG_PATH": str(self.config_path),
            "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": LOOPBACK,
            "VLLM_HOST_IP": LOOPBACK,
            **LOOPBACK_ENV,
        }


def segment_mounted(segment_bytes: int, metrics: str) -> bool:
    """Whether the master's metrics count the store process's memory."""
    match = _CAPACITY.search(metrics)
    try:
        return match is not None and float(match.group(1)) >= segment_bytes
    except ValueError:
        return False


def plan_store(section: StoreSection, run_dir: Path) -> StorePlan:
    """The two processes, on the section's ports or free loopback ones, and the engines'
    connector config file."""
    rpc_port = section.master_port or free_port()
    metadata_port = section.metadata_port or free_port()
    admin_port = section.admin_port or free_port()
    store_port = section.store_port or free_port()
    address = StoreAddress(f"{LOOPBACK}:{rpc_port}", f"http://{LOOPBACK}:{metadata_port}/metadata")
    admin_url = f"http://{LOOPBACK}:{admin_port}"
    config_path = write_json(
        run_dir / CONFIG_FILE, connector_config(address, section.local_buffer_mb * MIB)
    )
    segment_bytes = section.segment_mb * MIB
    master = ServicePlan(
        name=MASTER_NAME,
        kind="master",
        argv=[*master_command(rpc_port, metadata_port, admin_port), *section.master_args],
        url=admin_url,
        env=dict(LOOPBACK_ENV),
        details={
            "master_address": address.master,
            "metadata_url": address.metadata_url,
            "mooncake_config": str(config_path),
        },
    )
    store = ServicePlan(
        name=STORE_NAME,
        kind="store",
        argv=store_process_command(address, store_port, segment_bytes),
        url=f"tcp://{LOOPBACK}:{store_port}",
        env=dict(LOOPBACK_ENV),
        health_url=f"{admin_url}/metrics",
        ready_when=partial(segment_mounted, segment_bytes),
        details={"master_address": address.master, "segment_mb": section.segment_mb},
    )
    return StorePlan(master, store, address, admin_url, config_path, section.segment_mb)
