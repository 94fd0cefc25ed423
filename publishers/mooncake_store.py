"""The Mooncake-store tier: KV blocks saved to and loaded from a real Mooncake store.

A prefix computed on one engine and saved to the store can be loaded by any other engine
instead of recomputed. This module is the one place that knows how vLLM's
``MooncakeStoreConnector`` lays blocks out in the store, so the engine simulator, the
conductor's store checks and the tests agree with real vLLM:

- a block's key is ``{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{digest hex}`` (``model``
  is the basename of the engine's model path, the digest the block's full prefix-cache
  hash), and the integer hash the engine's KV events carry for it is the digest's low 64
  bits (``key_event_hash``);
- a block's value is its raw KV bytes, ``[layers, 2, kv_heads, block_size, head_dim]``
  (32 KiB for the tiny model at block size 32, as the connector stores it).

``KVBlockStore`` is a client of ``MooncakeDistributedStore`` (PyPI
``mooncake-transfer-engine-non-cuda``: TCP transport, the master's built-in HTTP metadata
server) that checks, puts and gets a prompt's blocks in one round trip each. ``LocalStore``
runs the store itself (``mooncake_master`` plus a ``mooncake_client`` process holding the
memory, the layout that proved reliable over TCP; engines are pure clients).

Blocks made by ``kv_block`` are derived from their digest, so a block loaded anywhere can be
checked byte for byte against what the saving engine put. The Mooncake binaries bind some
sockets on every interface whatever their flags say, so tests run them in a network
namespace whose only interface is loopback. torch and the wheel are imported only where
blocks move: the key layout and the connector's config need neither.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from conductor.vllm_hash import low64_be

from .local import free_port

if TYPE_CHECKING:
    import torch  # type: ignore[import-not-found, unused-ignore]  # the optional [store] extra

MIB = 1 << 20
MASK64 = (1 << 64) - 1
KEY_RANKS = "tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"  # one rank of every kind, KV group 0
# vLLM's ``--kv-transfer-config`` for its store connector (engines save and load blocks)
STORE_CONNECTOR = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
# Mooncake's transfer engine advertises (and is reached on) the first non-loopback
# interface it finds unless told otherwise; every store process and client gets this
LOOPBACK_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
RPC_FAIL = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer
_KEY = re.compile(rf"^(?P<model>[^@]+)@{re.escape(KEY_RANKS)}@(?P<digest>[0-9a-f]{{16,128}})$")
_SIZE = re.compile(r"^\s*([\d.]+)\s*(gb|mb|kb|b)?\s*$")
_UNITS = {"gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}


class StoreError(RuntimeError):
    """The store refused an operation (a return code, or an answer that makes no sense)."""


class StoreUnavailable(StoreError):
    """The store's master did not answer: nothing can be checked, saved or loaded now."""


# -- the connector's key layout ----------------------------------------------------------


def model_key_name(model: str) -> str:
    """The model part of keys: the basename of the engine's model path, as vLLM takes it."""
    return model.rstrip("/").split("/")[-1]


def block_key(model_name: str, digest: bytes) -> str:
    return f"{model_name}@{KEY_RANKS}@{digest.hex()}"


@dataclass(frozen=True, slots=True)
class BlockKey:
    model_name: str
    digest: bytes

    @property
    def event_hash(self) -> int:
        return low64_be(self.digest)


def parse_block_key(key: str) -> BlockKey:
    """A store key the connector wrote; ValueError for any other key (other objects share
    the store)."""
    match = _KEY.match(key)
    if match is None or len(match["digest"]) % 2:
        raise ValueError(f"not a KV block key of MooncakeStoreConnector: {key[:120]!r}")
    return BlockKey(match["model"], bytes.fromhex(match["digest"]))


def key_event_hash(key: str) -> int:
    return parse_block_key(key).event_hash


# -- the connector's configuration (the file MOONCAKE_CONFIG_PATH names) ----------------------


def parse_size(value: int | str) -> int:
    """vLLM's sizes: bytes, or a string with a 1024-based unit (``"256MB"``)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value.lower())
    if match is None:
        raise ValueError(f"invalid size {value!r} (expected bytes or e.g. '256MB')")
    return int(float(match[1]) * _UNITS[match[2] or "b"])


class MooncakeConfig(BaseModel):
    """vLLM's ``MooncakeStoreConfig``: where the store is and what a client lends it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    metadata_server: str
    master_server_address: str
    protocol: str = "rdma"
    device_name: str = ""
    mode: Literal["embedded", "standalone-store"] = "embedded"
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 4 << 30

    @field_validator("global_segment_size", "local_buffer_size", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        if not isinstance(value, int | str):
            raise ValueError("a size is bytes or a string such as '256MB'")
        return parse_size(value)

    @property
    def address(self) -> StoreAddress:
        return StoreAddress(self.master_server_address, self.metadata_server)

    @model_validator(mode="after")
    def _mode(self) -> MooncakeConfig:
        """vLLM's rules: the store process lends the memory in standalone-store mode only."""
        if self.local_buffer_size <= 0:
            raise ValueError("local_buffer_size must be > 0")
        if self.mode == "embedded" and self.global_segment_size == 0:
            raise ValueError("embedded mode requires global_segment_size > 0")
        if self.mode == "standalone-store" and self.global_segment_size != 0:
            raise ValueError("standalone-store mode requires global_segment_size == 0")
        return self

    @classmethod
    def from_file(cls, path: str | Path) -> MooncakeConfig:
        """The file, validated; ValueError naming the file and what is wrong with it."""
        try:
            return cls.model_validate(json.loads(Path(path).read_text()))
        except (OSError, ValueError, ValidationError) as error:
            raise ValueError(f"Mooncake config {path}: {error}") from None

    @classmethod
    def from_env(cls) -> MooncakeConfig:
        path = os.environ.get("MOONCAKE_CONFIG_PATH")
        if not path:
            raise ValueError("the environment variable 'MOONCAKE_CONFIG_PATH' is not set")
        return cls.from_file(path)


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a store is: its master's RPC address and its metadata server's URL."""

    master: str  # host:port, also the store's name in registrations (``kv_store``)
    metadata_url: str  # http://host:port/metadata


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


# -- blocks ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVBlockShape:
    """One block of KV cache as vLLM lays it out per layer: K and V for every KV head."""

    layers: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str = "float32"  # a torch dtype's name

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {self.dtype!r}")
        return dtype

    @property
    def nbytes(self) -> int:
        import torch

        count = self.layers * 2 * self.kv_heads * self.block_size * self.head_dim
        return count * int(torch.empty((), dtype=self.torch_dtype).element_size())


def kv_block(shape: KVBlockShape, digest: bytes) -> torch.Tensor:
    """The block an engine would hold for ``digest``: content derived from the digest."""
    import torch

    generator = torch.Generator().manual_seed(low64_be(digest) & ((1 << 63) - 1))
    return torch.randn(shape.dims, generator=generator).to(shape.torch_dtype)


def same_bytes(block: torch.Tensor, expected: torch.Tensor) -> bool:
    """Byte for byte (not float equality, which would take -0.0 for 0.0)."""
    import torch

    flat = (t.contiguous().reshape(-1).view(torch.uint8) for t in (block, expected))
    return bool(torch.equal(*flat))


class KVBlockStore:
    """A store client that checks, saves and loads KV blocks by digest, one round trip per
    batch. Calls block: an asyncio caller runs them off its event loop."""

    def __init__(
        self,
        address: StoreAddress,
        model_name: str,
        local_hostname: str = "127.0.0.1",
        buffer_bytes: int = 64 * MIB,
        segment_bytes: int = 0,  # 0: the store process holds the memory
        protocol: str = "tcp",
        device_name: str = "",
    ) -> None:
        import torch  # noqa: F401  (seconds to import: paid here, not by the first request)
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found, unused-ignore]  # [store] extra

        if local_hostname == LOOPBACK_ENV["MC_TCP_BIND_ADDRESS"]:
            for name, value in LOOPBACK_ENV.items():
                os.environ.setdefault(name, value)  # read when the transfer engine starts
        self.model_name = model_name
        self._store = MooncakeDistributedStore()
        code = self._store.setup(
            local_hostname,
            address.metadata_url,
            segment_bytes,
            buffer_bytes,
            protocol,
            device_name,
            address.master,
        )
        if code != 0:
            raise StoreError(f"store setup against {address.master} failed with code {code}")

    def keys(self, digests: Sequence[bytes]) -> list[str]:
        return [block_key(self.model_name, digest) for digest in digests]

    def contains(self, digests: Sequence[bytes]) -> list[bool]:
        """Which blocks the store holds now."""
        if not digests:
            return []
        answers = self._store.batch_is_exist(self.keys(digests))
        failed = [answer for answer in answers if answer < 0]
        if failed:
            raise StoreUnavailable(f"the store could not answer an existence check ({failed[0]})")
        return [answer == 1 for answer in answers]

    def put(self, digests: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> None:
        """Save blocks (raw bytes under the connector's keys) straight from one registered
        buffer; all or none."""
        import torch

        if len(digests) != len(blocks):
            raise ValueError("one block per digest")
        if not digests:
            return
        batch = torch.stack([block.contiguous() for block in blocks])
        with self._registered(batch) as pointers:
            codes = self._store.batch_put_from(self.keys(digests), *pointers)
        if RPC_FAIL in codes:
            raise StoreUnavailable(f"the store's master did not answer a put ({RPC_FAIL})")
        failed = [code for code in codes if code != 0]
        if failed:
            raise StoreError(f"put of {len(failed)} of {len(codes)} blocks failed ({failed[0]})")

    def get(self, digests: Sequence[bytes], shape: KVBlockShape) -> list[torch.Tensor | None]:
        """Load blocks as tensors of ``shape``, straight into one registered buffer; None
        for a block the store does not hold (or holds with another size)."""
        import torch

        if not digests:
            return []
        batch = torch.empty((len(digests), *shape.dims), dtype=shape.torch_dtype)
        with self._registered(batch) as pointers:
            sizes = self._store.batch_get_into(self.keys(digests), *pointers)
        loaded = zip(batch, sizes, strict=True)
        return [block if size == shape.nbytes else None for block, size in loaded]

    @contextmanager
    def _registered(self, batch: torch.Tensor) -> Iterator[tuple[list[int], list[int]]]:
        """The transfer engine moves bytes only to and from memory registered with it: one
        registration for a whole batch; yields each block's address and size."""
        base, size = batch.data_ptr(), batch[0].nbytes
        code = self._store.register_buffer(base, batch.nbytes)
        if code != 0:
            raise StoreError(f"registering {batch.nbytes} bytes failed with code {code}")
        try:
            yield [base + index * size for index in range(len(batch))], [size] * len(batch)
        finally:
            self._store.unregister_buffer(base)

    def close(self) -> None:
        self._store.close()


# -- a store on this machine ----------------------------------------------------------------


def binary(name: str) -> Path:
    """``mooncake_master`` or ``mooncake_client``, shipped inside the wheel."""
    import mooncake  # type: ignore[import-not-found, unused-ignore]

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


def _wait_listening(port: int, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
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


def _end(process: subprocess.Popen[bytes] | None, kill: bool = False) -> None:
    if process is None or process.poll() is not None:
        return
    if kill:
        process.kill()
    else:
        process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


class LocalStore:
    """A store on this machine: ``mooncake_master`` and one store process lending it
    ``segment_bytes`` of memory, on free loopback ports; logs in ``run_dir``.

    ``metrics_port`` is the master's admin HTTP port (``/get_all_keys``, ``/health`` ...).
    ``kill_master`` and ``start_master`` take the master away and bring it back on the same
    ports (with an empty store: a master keeps its objects in memory only).
    """

    def __init__(self, run_dir: Path, segment_bytes: int, timeout: float = 20.0) -> None:
        self.run_dir, self.segment_bytes, self.timeout = run_dir, segment_bytes, timeout
        self.rpc_port, self.metadata_port = free_port(), free_port()
        self.metrics_port, self.store_port = free_port(), free_port()
        self.address = StoreAddress(
            f"127.0.0.1:{self.rpc_port}", f"http://127.0.0.1:{self.metadata_port}/metadata"
        )
        self.master: subprocess.Popen[bytes] | None = None
        self.store: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def _spawn(self, name: str, command: list[str], port: int) -> subprocess.Popen[bytes]:
        log = self.run_dir / f"{name}.log"
        with log.open("ab") as output:
            process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=self.run_dir,
                env={**os.environ, **LOOPBACK_ENV},
            )
        try:
            _wait_listening(port, process, log, self.timeout)
        except StoreError:
            _end(process, kill=True)
            raise
        return process

    def start_master(self) -> None:
        master = master_command(self.rpc_port, self.metadata_port, self.metrics_port)
        self.master = self._spawn("master", master, self.metadata_port)

    def kill_master(self) -> None:
        """SIGKILL: the master dies without a word to its clients."""
        _end(self.master, kill=True)
        self.master = None

    def start(self) -> None:
        """Master, then the store process; a store process that cannot start takes the
        master down with it (no orphan for the caller to find)."""
        self.start_master()
        store = store_process_command(self.address, self.store_port, self.segment_bytes)
        try:
            self.store = self._spawn("store", store, self.store_port)
        except StoreError:
            self.stop()
            raise
        time.sleep(0.5)  # the store process mounts its segment right after its port opens

    def stop(self) -> None:
        _end(self.store)
        _end(self.master)
        self.store = self.master = None
