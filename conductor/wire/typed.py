"""The fast path for the common layout: a batch of vLLM / SGLang tagged-map events.

msgspec decodes such a batch straight into typed structs (the way vLLM itself encodes
them), skipping a dict per event and most per-field checks in Python. It only *accepts*:
anything it does not take whole — another layout, the legacy ``mooncake`` topic, an odd
field, one bad event — returns None, and the generic decoder (``decode.py``) decodes the
batch as before, with its per-event error reports. So both paths give the same answer for
every batch the fast one accepts (pinned by tests over every captured payload).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import _native
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Event,
    EventBatch,
    int32_tokens,
    normalize_hash,
    normalize_hashes,
    parse_medium,
)
from .vllm import salt_from_extra_keys

_Hash = int | bytes


class _Stored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw()  # read in place by _native.int32_tokens
    block_size: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    cache_salt: str | None = None  # SGLang
    event_type: Any = msgspec.UNSET  # present: a Mooncake RFC map, not ours to decode


class _Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None
    event_type: Any = msgspec.UNSET


class _Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    event_type: Any = msgspec.UNSET


class _Batch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):  # [ts, events(, rank)]
    timestamp: int | float
    events: list[_Stored | _Removed | _Cleared]
    dp_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(_Batch)


def _event(event: _Stored | _Removed | _Cleared) -> Event:
    if event.event_type is not msgspec.UNSET:
        raise DecodeError("a Mooncake map")
    if isinstance(event, _Stored):
        salt = event.cache_salt
        if salt is None:
            salt = salt_from_extra_keys(event.extra_keys, event.lora_name)
        parent = event.parent_block_hash
        packed = _native.int32_tokens(event.token_ids)
        if packed is None:
            raise DecodeError("token_ids are not an array of integers")
        return BlockStored(
            block_hashes=normalize_hashes(event.block_hashes),
            parent_hash=None if parent is None else normalize_hash(parent),
            token_ids=int32_tokens(packed),
            block_size=event.block_size,
            tier=parse_medium(event.medium),
            lora_name=event.lora_name,
            salt=salt,
            group_idx=event.group_idx,
        )
    if isinstance(event, _Removed):
        return BlockRemoved(
            normalize_hashes(event.block_hashes), parse_medium(event.medium), event.group_idx
        )
    return AllBlocksCleared()


def decode_map_batch(payload: bytes) -> EventBatch | None:
    """The batch if it is wholly well-formed tagged-map events; None: use the generic path."""
    try:
        batch = _decoder.decode(payload)
        if batch.dp_rank is not None and batch.dp_rank < 0:
            return None
        events = [_event(event) for event in batch.events]
    except (msgspec.ValidationError, msgspec.DecodeError, DecodeError):
        return None
    timestamp = batch.timestamp
    if isinstance(timestamp, int):  # milliseconds, as the generic path reads them
        timestamp = timestamp / 1000.0
    return EventBatch(float(timestamp), events, batch.dp_rank)
