"""The Mooncake-store tier: KV blocks saved to and loaded from a real Mooncake store.

A prefix computed on one engine and saved to the store can be loaded by any other engine
instead of recomputed. This module is the engine side of that path, for any engine or test
that holds KV blocks as torch tensors: a client of ``MooncakeDistributedStore`` (PyPI
``mooncake-transfer-engine-non-cuda``: TCP transport, the master's built-in HTTP metadata
server) that puts and gets blocks by engine block hash, and the running store itself
(``mooncake_master`` plus a ``mooncake_client`` process holding the memory, the layout that
proved reliable over TCP; engines are pure clients).

Blocks made by ``kv_block`` are derived from their hash, so a block loaded anywhere can be
checked byte for byte against what the saving engine put. The Mooncake binaries bind some
sockets on every interface whatever their flags say, so tests run them in a network
namespace whose only interface is loopback.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .local import free_port

MIB = 1 << 20


class StoreError(RuntimeError):
    """The store refused an operation (its return code or a missing key)."""


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a store is: its master's RPC address and its metadata server's URL."""

    master: str  # host:port, also the store's name in registrations (``kv_store``)
    metadata_url: str  # http://host:port/metadata


@dataclass(frozen=True, slots=True)
class KVBlockShape:
    """One block of KV cache as vLLM lays it out per layer: K and V for every KV head."""

    layers: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def nbytes(self) -> int:
        count = self.layers * 2 * self.kv_heads * self.block_size * self.head_dim
        return count * torch.tensor([], dtype=self.dtype).element_size()


def kv_block(shape: KVBlockShape, block_hash: int) -> torch.Tensor:
    """The block an engine would hold for ``block_hash``: content derived from the hash."""
    generator = torch.Generator().manual_seed(block_hash & ((1 << 63) - 1))
    return torch.randn(shape.dims, generator=generator).to(shape.dtype)


def block_key(model: str, block_hash: int) -> str:
    return f"{model}/kv/{block_hash & ((1 << 64) - 1):016x}"


class KVBlockStore:
    """A store client that saves and loads KV blocks by engine block hash."""

    def __init__(
        self,
        address: StoreAddress,
        model: str,
        local_hostname: str = "127.0.0.1",
        buffer_bytes: int = 64 * MIB,
    ) -> None:
        from mooncake.store import MooncakeDistributedStore  # the optional [store] extra

        self.model = model
        self._store = MooncakeDistributedStore()
        code = self._store.setup(
            local_hostname,
            address.metadata_url,
            0,  # no segment of its own: the store process holds the memory
            buffer_bytes,
            "tcp",
            "",
            address.master,
        )
        if code != 0:
            raise StoreError(f"store setup against {address.master} failed with code {code}")

    def put(self, block_hash: int, block: torch.Tensor) -> None:
        code = self._store.put_tensor(block_key(self.model, block_hash), block)
        if code != 0:
            raise StoreError(f"put of block {block_hash:#x} failed with code {code}")

    def get(self, block_hash: int) -> torch.Tensor:
        block = self._store.get_tensor(block_key(self.model, block_hash))
        if block is None:
            raise StoreError(f"block {block_hash:#x} is not in the store")
        return block

    def contains(self, block_hashes: Sequence[int]) -> list[bool]:
        """Which blocks the store holds now (one round trip for all of them)."""
        keys = [block_key(self.model, h) for h in block_hashes]
        answers = self._store.batch_is_exist(keys)
        if any(answer < 0 for answer in answers):
            raise StoreError("the store could not answer an existence check")
        return [answer == 1 for answer in answers]

    def close(self) -> None:
        self._store.close()


# Mooncake's transfer engine advertises (and is reached on) the first non-loopback
# interface it finds unless told otherwise; every store process and client gets this
LOOPBACK_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
# vLLM's ``--kv-transfer-config`` for its store connector (engines save and load blocks)
STORE_CONNECTOR = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}


def connector_config(address: StoreAddress, local_buffer_bytes: int) -> dict[str, str]:
    """The JSON an engine's ``MOONCAKE_CONFIG_PATH`` names: a pure client of the store
    (no segment of its own; the store process lends the memory, the reliable layout)."""
    return {
        "mode": "standalone-store",
        "metadata_server": address.metadata_url,
        "master_server_address": address.master,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": "0",
        "local_buffer_size": f"{local_buffer_bytes // MIB}MB",
    }


def binary(name: str) -> Path:
    """``mooncake_master`` or ``mooncake_client``, shipped inside the wheel."""
    import mooncake

    return Path(mooncake.__file__).with_name(name)


def master_command(rpc_port: int, metadata_port: int, metrics_port: int) -> list[str]:
    return [
        str(binary("mooncake_master")),
        f"-rpc_port={rpc_port}",
        "-rpc_address=127.0.0.1",
        "-enable_http_metadata_server=true",
        "-http_metadata_server_host=127.0.0.1",
        f"-http_metadata_server_port={metadata_port}",
        "-metrics_host=127.0.0.1",
        f"-metrics_port={metrics_port}",
    ]


def store_process_command(address: StoreAddress, port: int, segment_bytes: int) -> list[str]:
    """The process that lends the store its memory (engines only borrow it)."""
    return [
        str(binary("mooncake_client")),
        "-host=127.0.0.1",
        f"-port={port}",
        f"-global_segment_size={segment_bytes // MIB}MB",
        f"-master_server_address={address.master}",
        f"-metadata_server={address.metadata_url}",
        "-protocol=tcp",
    ]


def _wait_listening(port: int, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StoreError(f"exited at start-up:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise StoreError(f"nothing listens on {port}:\n{log.read_text(errors='replace')[-2000:]}")


class LocalStore:
    """A store on this machine: ``mooncake_master`` and one store process lending it
    ``segment_bytes`` of memory, on free loopback ports; logs in ``run_dir``."""

    def __init__(self, run_dir: Path, segment_bytes: int, timeout: float = 20.0) -> None:
        self.run_dir, self.segment_bytes, self.timeout = run_dir, segment_bytes, timeout
        self.rpc_port, self.metadata_port = free_port(), free_port()
        self.metrics_port, self.store_port = free_port(), free_port()
        self.address = StoreAddress(
            f"127.0.0.1:{self.rpc_port}", f"http://127.0.0.1:{self.metadata_port}/metadata"
        )
        self.processes: list[subprocess.Popen] = []

    def _spawn(self, name: str, command: list[str], port: int) -> None:
        log = self.run_dir / f"{name}.log"
        with log.open("ab") as output:
            process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                env={**os.environ, **LOOPBACK_ENV},
            )
        self.processes.append(process)
        _wait_listening(port, process, log, self.timeout)

    def start(self) -> None:
        master = master_command(self.rpc_port, self.metadata_port, self.metrics_port)
        self._spawn("master", master, self.metadata_port)
        store = store_process_command(self.address, self.store_port, self.segment_bytes)
        self._spawn("store", store, self.store_port)
        time.sleep(0.5)  # the store process mounts its segment right after its port opens

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
        self.processes = []
