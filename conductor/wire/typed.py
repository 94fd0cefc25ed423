"""The fast path for the common layouts: a batch of vLLM / SGLang events, all tagged maps
(vLLM >= 0.24, SGLang) or all positional arrays (vLLM <= 0.23).

msgspec decodes such a batch straight into typed structs (the way vLLM itself encodes
them), skipping a dict per event and most per-field checks in Python; token ids stay raw
msgpack until ``_native.int32_tokens`` reads them into int32. It only *accepts*:
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


class _ArrayStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """vLLM <= 0.23: ``[tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name,
    extra_keys, group_idx, ...]``, 6 to 12 elements; those past ``group_idx`` are ignored,
    as the generic decoder ignores them."""

    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: msgspec.Raw
    block_size: int | None
    lora_id: Any
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):  # [ts, events(, rank)]
    timestamp: int | float
    events: list[_Stored | _Removed | _Cleared]
    dp_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    timestamp: int | float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    dp_rank: int | None = None


_decoders = (msgspec.msgpack.Decoder(_Batch), msgspec.msgpack.Decoder(_ArrayBatch))
_Typed = _Stored | _Removed | _Cleared | _ArrayStored | _ArrayRemoved | _ArrayCleared


def _event(event: _Typed) -> Event:
    if isinstance(event, _Stored | _ArrayStored):
        salt = None
        if isinstance(event, _Stored):
            if event.event_type is not msgspec.UNSET:
                raise DecodeError("a Mooncake map")
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
    if isinstance(event, _Removed | _Cleared) and event.event_type is not msgspec.UNSET:
        raise DecodeError("a Mooncake map")
    if isinstance(event, _Removed | _ArrayRemoved):
        return BlockRemoved(
            normalize_hashes(event.block_hashes), parse_medium(event.medium), event.group_idx
        )
    return AllBlocksCleared()


def decode_typed_batch(payload: bytes) -> EventBatch | None:
    """The batch if it is wholly well-formed vLLM / SGLang events, all maps (vLLM >= 0.24,
    SGLang) or all arrays (vLLM <= 0.23); None: use the generic path."""
    for decoder in _decoders:
        try:
            batch = decoder.decode(payload)
            if batch.dp_rank is not None and batch.dp_rank < 0:
                return None
            events = [_event(event) for event in batch.events]
        except msgspec.ValidationError:
            continue  # the other layout, or none of them
        except (msgspec.DecodeError, DecodeError, UnicodeDecodeError):  # a str not UTF-8
            return None
        timestamp = batch.timestamp
        if isinstance(timestamp, int):  # milliseconds, as the generic path reads them
            timestamp = timestamp / 1000.0
        return EventBatch(float(timestamp), events, batch.dp_rank)
    return None
