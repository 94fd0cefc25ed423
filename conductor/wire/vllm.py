"""vLLM (and SGLang) event layouts.

vLLM >= 0.24 and SGLang 0.5.23 send tagged maps with the same field names; SGLang adds
``cache_salt`` and uses signed int64 hashes (normalized here). vLLM <= 0.23 sends every
field positionally, 6 to 12 elements depending on the release.
"""

from __future__ import annotations

from array import array
from typing import Any

from ..hashing import token_bytes
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Event,
    int32_tokens,
    normalize_hash,
    normalize_hashes,
    parse_medium,
)


def _optional_int(value: object, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise DecodeError(f"{name} must be an int or nil, got {value!r:.40}")


def _optional_str(value: object, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DecodeError(f"{name} must be a string or nil, got {value!r:.40}")


def _token_ids(value: object) -> array[int]:
    if value is None:
        return int32_tokens(b"")
    if not isinstance(value, list):
        raise DecodeError(f"token_ids must be an array, got {type(value).__name__}")
    try:
        return int32_tokens(token_bytes(value))
    except TypeError:
        raise DecodeError("token_ids must be an array of integers") from None


def salt_from_extra_keys(extra_keys: object, lora_name: str | None) -> str | None:
    """The per-request cache salt hidden in block 0's untagged extra keys.

    Block 0's entry lists, in order, the LoRA name, multimodal ``[id, offset]`` pairs,
    the salt string and a prompt-embeds digest (bytes): the salt is the string that is
    not the LoRA name.
    """
    if not isinstance(extra_keys, list) or not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, list):
        return None
    strings = [key for key in first if isinstance(key, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


def _stored(
    hashes: object,
    parent: object,
    tokens: object,
    block_size: object,
    medium: object,
    lora_name: object,
    salt: str | None,
    group_idx: object,
) -> BlockStored:
    lora = _optional_str(lora_name, "lora_name")
    return BlockStored(
        block_hashes=normalize_hashes(hashes),
        parent_hash=None if parent is None else normalize_hash(parent),
        token_ids=_token_ids(tokens),
        block_size=_optional_int(block_size, "block_size"),
        tier=parse_medium(medium),
        lora_name=lora,
        salt=_optional_str(salt, "cache_salt"),
        group_idx=_optional_int(group_idx, "group_idx"),
    )


def decode_map_event(event: dict[str, Any]) -> Event:
    """A vLLM >= 0.24 or SGLang tagged-map event."""
    kind = event.get("type")
    try:
        if kind == "BlockStored":
            lora = event.get("lora_name")
            salt = event.get("cache_salt")  # SGLang
            if salt is None:
                salt = salt_from_extra_keys(event.get("extra_keys"), lora)
            return _stored(
                event["block_hashes"],
                event.get("parent_block_hash"),
                event.get("token_ids"),
                event.get("block_size"),
                event.get("medium"),
                lora,
                salt,
                event.get("group_idx"),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                normalize_hashes(event["block_hashes"]),
                parse_medium(event.get("medium")),
                _optional_int(event.get("group_idx"), "group_idx"),
            )
    except KeyError as missing:
        raise DecodeError(f"{kind} without {missing.args[0]}") from None
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise DecodeError(f"unknown event type {kind!r:.40}")


def _slot(event: list[Any], index: int) -> object:
    return event[index] if len(event) > index else None


def decode_array_event(event: list[Any]) -> Event:
    """A vLLM <= 0.23 positional event (``array_like=True``)."""
    kind = event[0] if event else None
    if kind == "BlockStored":
        if len(event) < 6:
            raise DecodeError(f"BlockStored array needs >= 6 elements, got {len(event)}")
        lora = _slot(event, 7)
        return _stored(
            event[1],
            event[2],
            event[3],
            event[4],
            _slot(event, 6),
            lora,
            salt_from_extra_keys(_slot(event, 8), lora if isinstance(lora, str) else None),
            _slot(event, 9),
        )
    if kind == "BlockRemoved":
        if len(event) < 2:
            raise DecodeError("BlockRemoved array without block_hashes")
        return BlockRemoved(
            normalize_hashes(event[1]),
            parse_medium(_slot(event, 2)),
            _optional_int(_slot(event, 3), "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise DecodeError(f"unknown event type {kind!r:.40}")
