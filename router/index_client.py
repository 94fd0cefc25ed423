"""Stage 3's interface: what the router asks of the KV-cache index, whichever it is, a
conductor service over HTTP (``conductor_client.ConductorClient``) or the index inside the
router (``embedded.EmbeddedConductor``).

Both answer the same questions (a prompt's hits per instance, how far the index has got,
the stores' states, whether it can be asked at all) and take the same reports (the
streams to subscribe to, engines out of rotation, the prompts routed), so nothing else in
the router needs to know which one it has.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from conductor.hashing import PrefixHash, prefix_hashes
from conductor.states import StoreState

from .config import ModelSection

Hits = dict[str, tuple[int, int, int]]  # instance -> cumulative (GPU, CPU, DISK) hit, tokens
MAX_TOKENS = 2**31 - 1  # the Go API's int32: a larger count is no count this router believes


class ConductorState(StrEnum):
    """One conductor as ``/health`` shows it: ``down`` while its calls fail."""

    UP = "up"
    DOWN = "down"


class ConductorUnavailable(Exception):
    """No usable answer in time: the caller falls back to a load-only policy."""


@dataclass(frozen=True, slots=True)
class IndexContext:
    """What the index keys a prompt's blocks by, besides its salt: the tenant the engines
    registered under, the model, the LoRA adapter ("": none) and the block size."""

    tenant_id: str
    model: str
    lora_name: str
    block_size: int


class PromptBlocks:
    """A prompt as an index reads it: its ids packed as int32 (what a conductor is sent, and
    hashes itself), the context it is asked in, and its block hashes, salted with its
    ``cache_salt`` (what the embedded index and the prompts in flight compare), hashed
    once, when first read."""

    __slots__ = ("packed", "context", "cache_salt", "lease", "_hashes")

    def __init__(self, packed: bytes, context: IndexContext, cache_salt: str) -> None:
        self.packed = packed
        self.context = context
        self.cache_salt = cache_salt
        # the decision lease its query took on the conductor (``conductor.loads``), if any
        self.lease: int | None = None
        self._hashes: list[PrefixHash] | None = None

    @property
    def tokens(self) -> int:
        return len(self.packed) // 4

    @property
    def hashes(self) -> Sequence[PrefixHash]:
        """One chained hash per complete block, as the conductor computes them."""
        if self._hashes is None:
            self._hashes = prefix_hashes(self.packed, self.context.block_size, self.cache_salt)
        return self._hashes


class IndexClient(Protocol):
    """The index the router asks for hits and tells what it sees."""

    async def hits(self, prompt: PromptBlocks, progress_of: Collection[str]) -> Hits:
        """Each instance's cumulative (GPU, CPU, DISK) hit on ``prompt`` in its context;
        ``progress_of``: instances whose indexing progress (``indexed_until``) to learn
        too. Raises ConductorUnavailable without an answer in time."""
        ...

    def indexed_until(self, instance_id: str) -> float | None:
        """The index holds everything the instance published up to this time (the engine's
        clock); None: not known."""
        ...

    async def register(self, models: Sequence[ModelSection]) -> bool:
        """Have the index follow every event stream of the models' instances (idempotent);
        True when it follows all of them."""
        ...

    async def report_instance(
        self, instance_id: str, tenant_id: str, down: bool, ttl_s: float, reason: str
    ) -> None:
        """An instance is out of rotation (``down``, for ``ttl_s``) or back: its blocks stop
        counting, or count again. Never raises."""
        ...

    def report_routed(self, prompt: PromptBlocks, instance_id: str) -> None:
        """``prompt`` was sent to ``instance_id``: for the other router replicas, whose
        index counts it there until its events are indexed. Never waits, never raises."""
        ...

    def decided(self, prompt: PromptBlocks) -> None:
        """``prompt``'s request was claimed on an instance: its decision is in this router's
        load, for the other replicas (it ends the decision lease its query took). Never
        waits, never raises."""
        ...

    async def store_states(self, timeout: float) -> dict[str, StoreState]:
        """Each Mooncake store's state as the index knows it; raises ConductorUnavailable
        without an answer."""
        ...

    def states(self) -> dict[str, ConductorState]:
        """Each conductor asked, as ``/health`` lists them."""
        ...

    def degraded_reasons(self) -> list[str]:
        """Why the index cannot be asked now (``/health``); empty while it can."""
        ...

    def exposition(self) -> bytes:
        """The index's own series for the router's ``/metrics``, in Prometheus's text
        format (empty when they live elsewhere)."""
        ...

    async def close(self) -> None:
        """Release its connections or subscriptions."""
        ...


def answer_text(answer: Any) -> str:
    """A conductor's answer for a log line: its error message, else its text (cut short)."""
    if isinstance(answer, dict) and "error" in answer:
        answer = answer["error"]
    if isinstance(answer, bytes):
        answer = answer.decode(errors="replace")
    return str(answer)[:300]
