"""Mooncake store events.

RFC #1527 maps (master ``main`` and the ``dev/conductor`` variant) identify blocks by
``seq_hashes`` (u64) or ``block_hashes`` (int64-cast); they carry no tokens, so the index
places them through hashes it already learned from engines. The legacy ``mooncake`` topic
sends ``BlockStoreEvent`` arrays with decimal (or, fixed here, ``0x`` hex) string hashes.
"""

from __future__ import annotations

import re
from typing import Any

from .events import (
    MASK64,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EngineHash,
    Event,
    Tier,
    normalize_hash,
    normalize_hashes,
    parse_medium,
)
from .vllm import _optional_int, _optional_str, _token_ids


def decode_rfc_event(event: dict[str, Any]) -> Event:
    """A Mooncake master RFC #1527 event map (``event_type`` stored/removed/cleared)."""
    kind = event.get("event_type")
    if kind == "cleared":
        return AllBlocksCleared()
    if kind not in ("stored", "removed"):
        raise DecodeError(f"unknown Mooncake event_type {kind!r:.40}")
    seq_hashes = event.get("seq_hashes")
    hashes = normalize_hashes(seq_hashes if seq_hashes else event.get("block_hashes") or [])
    if not hashes:
        raise DecodeError(f"Mooncake {kind} event without seq_hashes or block_hashes")
    tier = parse_medium(event.get("medium"))
    if kind == "removed":
        return BlockRemoved(hashes, tier)
    parent = event.get("parent_hash")
    if parent is None:
        parent = event.get("parent_block_hash")
    salt = _optional_str(event.get("additional_salt"), "additional_salt")
    return BlockStored(
        block_hashes=hashes,
        parent_hash=None if parent is None else normalize_hash(parent),
        token_ids=_token_ids(event.get("token_ids")),
        block_size=_optional_int(event.get("block_size"), "block_size"),
        tier=tier,
        lora_name=_optional_str(event.get("lora_name"), "lora_name"),
        salt=salt or None,
    )


_SEPARATORS = re.compile(r"[,\s]+")


def _hash_text(value: str) -> EngineHash:
    text = value.strip()
    try:
        return EngineHash(int(text, 16 if text.lower().startswith("0x") else 10) & MASK64)
    except ValueError:
        raise DecodeError(f"bad Mooncake hash string {value!r:.40}") from None


def _legacy_hashes(value: object) -> list[EngineHash]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [_hash_text(part) for part in _SEPARATORS.split(value.strip()) if part]
    if isinstance(value, list):
        return [_hash_text(h) if isinstance(h, str) else normalize_hash(h) for h in value]
    return [normalize_hash(value)]


def _legacy_tier(replicas: object) -> Tier:
    """Replica descriptors ``[[type, location], ...]``: disk-like types mean DISK, else CPU."""
    if isinstance(replicas, list):
        for replica in replicas:
            kind = replica[0] if isinstance(replica, list) and replica else replica
            if isinstance(kind, str) and any(w in kind.lower() for w in ("disk", "ssd", "file")):
                return Tier.DISK
    return Tier.CPU


def decode_legacy_event(event: list[Any]) -> Event:
    """``["BlockStoreEvent", key, replicas, model, block_size, hashes, parent, tokens]``."""
    if not event or event[0] != "BlockStoreEvent":
        raise DecodeError(f"unknown legacy Mooncake event {event[0] if event else None!r:.40}")
    if len(event) < 8:
        raise DecodeError(f"BlockStoreEvent needs 8 elements, got {len(event)}")
    hashes = _legacy_hashes(event[5])
    if not hashes:
        raise DecodeError("BlockStoreEvent without block hashes")
    parent = _legacy_hashes(event[6])
    return BlockStored(
        block_hashes=hashes,
        parent_hash=parent[0] if parent and parent[0] != 0 else None,
        token_ids=_token_ids(event[7]),
        block_size=_optional_int(event[4], "block_size"),
        tier=_legacy_tier(event[2]),
    )
