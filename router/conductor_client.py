"""Talks to the conductor: registers the prefill instances' event streams, asks for hits.

Requests are msgpack with int32-packed tokens (the cheapest form for the conductor to
parse); answers in the Go shape ``{tenant: {instance: {GPU, CPU, DISK, ...}}}`` and in the
C++ rewrite's ``{"instances": {id: {gpu, cpu, disk}}}`` are both understood.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgpack

from conductor.hashing import token_bytes

from .config import ConductorSection, PrefillInstance, PrefillModelConfig

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
Hits = dict[str, tuple[int, int, int]]
STORE_STATES = ("up", "down", "unchecked")


class ConductorUnavailable(Exception):
    """No usable answer in time: the caller falls back to a load-only policy."""


class ConductorClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        section: ConductorSection,
        model: PrefillModelConfig,
    ) -> None:
        self._session = session
        self._section = section
        self._model = model

    async def _post(self, path: str, body: dict[str, Any], timeout: float) -> tuple[int, Any]:
        async with self._session.post(
            self._section.address + path,
            data=msgpack.packb(body),
            headers={"Content-Type": MSGPACK, "Accept": MSGPACK},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            raw = await response.read()
            try:
                return response.status, msgpack.unpackb(raw)
            except Exception:
                return response.status, raw[:200]

    async def register(self, instances: Sequence[PrefillInstance]) -> None:
        """Register every stream (idempotent: the conductor answers 200 to a repeat),
        retrying until the conductor is up or the registration timeout ends."""
        deadline = time.monotonic() + self._section.registration_timeout_seconds
        for instance in instances:
            for stream in instance.registrations:
                body = {
                    "endpoint": stream.endpoint,
                    "replay_endpoint": stream.replay_endpoint,
                    "type": "vLLM",
                    "modelname": self._model.modelname,
                    "lora_name": self._model.lora_name,
                    "tenant_id": self._model.tenant_id,
                    "instance_id": instance.instance_id,
                    "block_size": self._model.block_size,
                    "dp_rank": stream.dp_rank,
                }
                if instance.kv_store:  # our extension: absent for the Go conductor's sake
                    body["kv_store"] = instance.kv_store
                await self._register_one(body, deadline)

    async def _register_one(self, body: dict[str, Any], deadline: float) -> None:
        delay = 0.1
        while True:
            try:
                status, answer = await self._post("/register", body, timeout=2.0)
                if status == 200:
                    log.info("registered instance=%s rank=%s", body["instance_id"], body["dp_rank"])
                    return
                raise RuntimeError(f"conductor refused registration {body}: {status} {answer}")
            except (aiohttp.ClientError, TimeoutError) as error:
                if time.monotonic() + delay > deadline:
                    raise RuntimeError(f"conductor unreachable for registration: {error}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def store_states(self, timeout: float) -> dict[str, str]:
        """Each Mooncake store's state as the conductor's ``/health`` reports it (``up``,
        ``down`` or ``unchecked``); raises ConductorUnavailable without an answer."""
        try:
            async with self._session.get(
                self._section.address + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                health = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            raise ConductorUnavailable(f"health failed: {error!r}") from None
        return parse_store_states(health)

    async def query(self, token_ids: Sequence[int], cache_salt: str | None = None) -> Hits:
        """Cumulative (GPU, CPU, DISK) hit in tokens per instance of the model's context."""
        try:
            packed = token_bytes(token_ids)  # int32 wrapping as the conductor hashes them
        except TypeError as error:
            raise ConductorUnavailable(f"token ids are not integers: {error}") from None
        body: dict[str, Any] = {
            "model": self._model.modelname,
            "block_size": self._model.block_size,
            "token_ids": packed,
            "tenant_id": self._model.tenant_id,
            "lora_name": self._model.lora_name,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        try:
            status, answer = await self._post(
                "/query", body, timeout=self._section.query_timeout_seconds
            )
        except (aiohttp.ClientError, TimeoutError) as error:
            raise ConductorUnavailable(f"query failed: {error!r}") from None
        if status != 200 or not isinstance(answer, dict):
            raise ConductorUnavailable(f"query answered {status}: {answer!r:.200}")
        return parse_hits(answer, self._model.tenant_id)


def _tokens(entry: dict[str, Any], *keys: str) -> int:
    for key in keys:
        value = entry.get(key)
        if isinstance(value, int):
            return value
    return 0


def parse_hits(answer: dict[str, Any], tenant_id: str) -> Hits:
    """Both conductor answer shapes -> {instance: (gpu, cpu, disk)}; junk entries skipped."""
    instances = answer.get("instances")
    if not isinstance(instances, dict):
        instances = answer.get(tenant_id, {})
    hits: Hits = {}
    for name, entry in instances.items() if isinstance(instances, dict) else ():
        if isinstance(entry, dict):
            gpu = _tokens(entry, "GPU", "gpu")
            cpu = max(gpu, _tokens(entry, "CPU", "cpu"))
            disk = max(cpu, _tokens(entry, "DISK", "disk", "longest_matched"))
            hits[str(name)] = (gpu, cpu, disk)
    return hits


def parse_store_states(health: Any) -> dict[str, str]:
    """``{master: state}`` from a ``/health`` answer's ``kv_stores``
    (``{master: {"blocks", "state", "checked_s_ago"}}``). A store without a state this
    router knows (an older conductor lists only block counts) is ``unchecked``."""
    stores = health.get("kv_stores") if isinstance(health, dict) else None
    states: dict[str, str] = {}
    for master, entry in stores.items() if isinstance(stores, dict) else ():
        state = entry.get("state") if isinstance(entry, dict) else None
        states[str(master)] = state if state in STORE_STATES else "unchecked"
    return states
