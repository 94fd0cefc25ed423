"""Typed KV events: the one vocabulary every producer's payload is decoded into."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NewType, cast

from .._native import u64_hashes
from ..hashing import token_bytes

MASK64 = 0xFFFFFFFFFFFFFFFF
# a block's hash as its engine published it (unsigned 64-bit); the index maps it to its
# own prefix hash (``conductor.hashing.PrefixHash``)
EngineHash = NewType("EngineHash", int)


class DecodeError(ValueError):
    """A payload or event that does not match any known producer layout."""


class Tier(IntEnum):
    """Where a block lives; the order is the order of the cumulative /query answer."""

    GPU = 0
    CPU = 1
    DISK = 2


_MEDIA = {
    "gpu": Tier.GPU,
    "npu": Tier.GPU,  # an Ascend engine's device memory (upstream's later tier name)
    "cpu": Tier.CPU,
    "cpu_pinned": Tier.CPU,
    "disk": Tier.DISK,
    "storage": Tier.DISK,
    "external": Tier.DISK,
}


def parse_medium(value: object) -> Tier | None:
    """Normalize a producer's medium string (case-insensitive); None means 'not said'."""
    if value is None:
        return None
    if isinstance(value, str):
        tier = _MEDIA.get(value.lower())
        if tier is not None:
            return tier
    raise DecodeError(f"unknown medium {value!r}")


def normalize_hash(value: object) -> EngineHash:
    """Unsigned 64-bit form of an int (signed int64 wraps) or a digest (low 8 bytes, BE)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return EngineHash(value & MASK64)
    if isinstance(value, bytes) and value:
        return EngineHash(int.from_bytes(value[-8:], "big"))
    raise DecodeError(f"block hash must be an int or non-empty bytes, got {value!r:.40}")


def normalize_hashes(values: object) -> list[EngineHash]:
    if not isinstance(values, list):
        raise DecodeError(f"block_hashes must be an array, got {type(values).__name__}")
    hashes = u64_hashes(values)  # every hash an int: vLLM's default, SGLang, Mooncake
    if hashes is not None:
        return cast(list[EngineHash], hashes)
    return [normalize_hash(h) for h in values]


def int32_tokens(packed: bytes) -> array[int]:
    """Token ids from their int32 little-endian bytes: what the decoders give, one machine
    int each (the values the conductor hashes; a list of Python ints costs many times the
    memory: bench.index_bench measures bytes per block)."""
    tokens = array("i")
    tokens.frombytes(packed)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


@dataclass(slots=True)
class BlockStored:
    """Blocks cached by a producer. ``token_ids`` may be empty (some store tiers); whatever
    sequence of ints it is given, it holds them as ``int32_tokens`` (values outside int32
    wrapped, as the Go conductor casts them; TypeError for anything but ints)."""

    block_hashes: list[EngineHash]
    parent_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int | None = None
    tier: Tier | None = None
    lora_name: str | None = None
    salt: str | None = None
    group_idx: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, array):
            self.token_ids = int32_tokens(token_bytes(self.token_ids))


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[EngineHash]
    tier: Tier | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One decoded batch; events that failed to decode are in ``rejected`` (reasons)."""

    timestamp: float
    events: list[Event]
    dp_rank: int | None = None
    rejected: list[str] = field(default_factory=list)
