"""The simulator's ``MooncakeStoreConnector``: KV blocks through a real Mooncake store.

What vLLM's connector does, the simulator does with real store traffic:

- **Lookup and load**: before a request is queued, the prompt's blocks (all but the last
  token, as vLLM) are checked in the store in one round trip; if the store holds a longer
  prefix than the GPU does now, the blocks past the GPU hit are loaded in one more round
  trip, each verified byte for byte against ``kv_block`` (a mismatch is an error, counted and
  logged, and that block and the rest are recomputed). The request then waits in the queue
  like any other, and its admission counts the loaded blocks as cached (vLLM's
  ``cached_tokens`` and ``external_prefix_cache_*``), loaded rather than computed. Like
  vLLM's asynchronous load, the request's wall-clock TTFT includes the real load time; the
  model clock prices the load with the timing model, as it prices every other KV load.
- **Save**: after a request's prefill, its prompt's full blocks that the store lacks are
  put, and announced as the connector does: a batch of its own after the GPU batch, one
  ``BlockStored`` per block with medium ``"cpu"``, the previous prompt block as parent, the
  block's tokens, no extra keys. Nothing is announced when the store evicts.

Store calls block, so they run on one worker thread, off the event loop, and each is
recorded as vLLM records it (``store_metrics``). When the master does not answer, the tier
goes down at once: requests are served by recomputing, nothing is saved or announced, and
it is logged once; a TCP probe of the master every ``retry_s`` brings the tier back when the
master listens again (a call to a dead master takes seconds, a probe does not).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, field_validator

from conductor.wire.events import BlockStored, Tier

from ..encoding import WireEvent
from ..mooncake_store import (
    KVBlockShape,
    KVBlockStore,
    MooncakeConfig,
    StoreError,
    StoreUnavailable,
    kv_block,
    model_key_name,
    same_bytes,
)
from .block_hash import event_hash
from .block_manager import KV_CACHE_GROUP, BlockManager
from .scheduler import EngineRequest
from .store_metrics import StoreCollector, StoreOperations, StoreStats

log = logging.getLogger(__name__)

STORE_CONNECTOR = "MooncakeStoreConnector"
CONNECTOR_MEDIUM = "cpu"  # what vLLM's store connector names its tier, lowercase
PROBE_TIMEOUT_S = 0.5
T = TypeVar("T")


class KVTransferConfig(BaseModel):
    """vLLM's ``--kv-transfer-config``, for the one connector the simulator has."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kv_connector: str
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"]
    kv_connector_extra_config: dict[str, Any] = {}
    engine_id: str | None = None

    @field_validator("kv_connector")
    @classmethod
    def _supported(cls, value: str) -> str:
        if value != STORE_CONNECTOR:
            raise ValueError(f"the simulator implements {STORE_CONNECTOR} only, not {value!r}")
        return value

    @property
    def loads(self) -> bool:
        return self.kv_role != "kv_producer"

    @property
    def saves(self) -> bool:
        return self.kv_role != "kv_consumer"


class StoreTier:
    """One engine's connector to one store; ``close`` it after the engine loop."""

    def __init__(
        self,
        client: KVBlockStore,
        shape: KVBlockShape,
        master: str,
        labels: dict[str, str],
        *,
        loads: bool = True,
        saves: bool = True,
        retry_s: float = 1.0,
    ) -> None:
        self.client, self.shape, self.master = client, shape, master
        self.loads, self.saves, self.retry_s = loads, saves, retry_s
        self.stats = StoreStats()
        self.operations = StoreOperations(labels)
        self.collector = StoreCollector(self.operations, self.stats)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-store")
        self._probe: asyncio.Task[None] | None = None

    async def prefetch(self, request: EngineRequest, blocks: BlockManager) -> range:
        """Load what the store has of the prompt past the GPU hit; the loaded block range."""
        prompt = request.prompt_token_ids
        limit = (len(prompt) - 1) // blocks.block_size  # the last token is always computed
        digests = blocks.prompt_digests(prompt, request.cache_salt, request.lora)[:limit]
        gpu = blocks.num_gpu_prefix_blocks(digests)
        if not self.loads or gpu == len(digests):
            return range(gpu, gpu)
        loaded = await self._call(self._load, digests, gpu)
        return range(gpu, gpu) if loaded is None else loaded

    async def save(self, request: EngineRequest, blocks: BlockManager) -> list[WireEvent]:
        """Put the prompt's full blocks the store lacks; the connector's events for them."""
        prompt = request.prompt_token_ids
        digests = blocks.prompt_digests(prompt, request.cache_salt, request.lora)
        if not self.saves or not digests:
            return []
        saved = await self._call(self._save, digests)
        if saved is None:
            return []
        size = blocks.block_size
        return [
            WireEvent(
                BlockStored(
                    block_hashes=[event_hash(digests[index])],
                    parent_hash=event_hash(digests[index - 1]) if index else None,
                    token_ids=list(prompt[index * size : (index + 1) * size]),
                    block_size=size,
                    tier=Tier.CPU,
                    group_idx=KV_CACHE_GROUP,
                ),
                medium=CONNECTOR_MEDIUM,
                extra_keys=None,
            )
            for index in saved
        ]

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        self.client.close()

    # -- on the store thread ---------------------------------------------------------------

    def _timed(self, operation: str, keys: int, call: Callable[[], T], num_bytes: int = 0) -> T:
        """One store call, recorded as vLLM records it (an error counts all its keys)."""
        started = time.perf_counter()
        try:
            result = call()
        except StoreError:
            seconds = time.perf_counter() - started
            self.operations.record(operation, seconds, keys, 0, keys, "error")
            raise
        self.operations.record(operation, time.perf_counter() - started, keys, num_bytes)
        return result

    def _load(self, digests: Sequence[bytes], gpu: int) -> range:
        present = self._timed("lookup_exists", len(digests), partial(self.client.contains, digests))
        end = present.index(False) if False in present else len(present)
        if end <= gpu:
            return range(gpu, gpu)
        wanted = digests[gpu:end]
        started = time.perf_counter()
        loaded = self.client.get(wanted, self.shape)
        got = sum(1 for block in loaded if block is not None)
        self.operations.record("load_get", time.perf_counter() - started, len(wanted),
                               got * self.shape.nbytes, len(wanted) - got)  # fmt: skip
        verdicts: list[bool] = []  # every loaded block is checked, byte for byte
        for digest, block in zip(wanted, loaded, strict=True):
            if block is None:
                self.stats.missing_blocks += 1
                verdicts.append(False)
                continue
            same = same_bytes(block, kv_block(self.shape, digest))
            if not same:
                self.stats.mismatched_blocks += 1
                log.error("store block mismatch key=%s: recomputing", self.client.keys([digest])[0])
            verdicts.append(same)
        good = verdicts.index(False) if False in verdicts else len(verdicts)
        self.stats.loaded_blocks += good
        return range(gpu, gpu + good)

    def _save(self, digests: Sequence[bytes]) -> list[int]:
        present = self._timed("save_exists", len(digests), partial(self.client.contains, digests))
        missing = [index for index, there in enumerate(present) if not there]
        wanted = [digests[index] for index in missing]
        if wanted:
            put = partial(self.client.put, wanted, [kv_block(self.shape, d) for d in wanted])
            self._timed("save_put", len(wanted), put, len(wanted) * self.shape.nbytes)
        self.stats.saved_blocks += len(wanted)
        return missing

    # -- availability ----------------------------------------------------------------------

    async def _call(self, function: Callable[..., T], *args: Any) -> T | None:
        """Run a store call on the store thread; None when the store cannot serve it."""
        if not self.stats.up:
            self.stats.unavailable_calls += 1
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, self._guarded, function, *args
            )
        except StoreUnavailable as error:
            self.stats.unavailable_calls += 1
            self._went_down(error)
        except StoreError as error:  # a reachable store refused (full): skip, as vLLM does
            log.warning("store operation failed: %s", error)
        return None

    def _guarded(self, function: Callable[..., T], *args: Any) -> T:
        """Calls queued before the tier went down must not wait on the dead master too."""
        if not self.stats.up:
            raise StoreUnavailable("the store is down")
        return function(*args)

    def _went_down(self, error: StoreError) -> None:
        if not self.stats.up:
            return
        self.stats.up = False
        log.warning("store unreachable master=%s (%s): recomputing until it is back",
                    self.master, error)  # fmt: skip
        self._probe = asyncio.create_task(self._wait_for_master(), name="kv-store-probe")

    async def _wait_for_master(self) -> None:
        host, _, port = self.master.rpartition(":")
        while True:
            await asyncio.sleep(self.retry_s)
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port)), PROBE_TIMEOUT_S
                )
            except (OSError, TimeoutError):
                continue
            writer.close()
            self.stats.up = True
            log.info("store reachable again master=%s", self.master)
            return


def connect(
    transfer: KVTransferConfig,
    config: MooncakeConfig,
    model: str,
    shape: KVBlockShape,
    labels: dict[str, str],
) -> StoreTier:
    """The tier ``vllm serve``'s flag and environment describe (blocks while the client
    sets up). It advertises the address vLLM's connector would: its override, then
    ``VLLM_HOST_IP``, else loopback."""
    hostname = (
        os.environ.get("MOONCAKE_REQUESTER_LOCAL_HOSTNAME")
        or os.environ.get("VLLM_HOST_IP")
        or "127.0.0.1"
    )
    client = KVBlockStore(
        config.address,
        model_key_name(model),
        hostname,
        buffer_bytes=config.local_buffer_size,
        segment_bytes=config.global_segment_size,
        protocol=config.protocol,
        device_name=config.device_name,
    )
    master = config.master_server_address
    return StoreTier(client, shape, master, labels, loads=transfer.loads, saves=transfer.saves)
