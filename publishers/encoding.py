"""Byte-exact msgpack payloads of the producers the publisher imitates.

The input is the conductor's typed vocabulary (``conductor.wire.events``), optionally wrapped
in a ``WireEvent`` that carries the producer fields the conductor does not model, so the
engine simulator, the store tier and tests can emit exactly what a real engine would and the
captures in ``tests/fixtures/wire_fixtures.json`` can be rebuilt byte for byte.

Layouts:
- ``"vllm"``: vLLM 0.33 tagged maps, keys in declaration order, defaulted-None fields omitted;
  batch ``[ts, events, dp_rank]``.
- ``"vllm-legacy"``: vLLM 0.22–0.23 positional arrays (12-element BlockStored, 4-element
  BlockRemoved, ``["AllBlocksCleared"]``) — what the Go conductor's decoder expects.
- ``"sglang"``: SGLang 0.5.23 tagged maps with signed int64 hashes.

Media: a tier is named ``"GPU"``, ``"CPU"``, ``"DISK"`` (vLLM) and ``"GPU"``,
``"CPU_PINNED"``, ``"DISK"`` (SGLang). vLLM itself never says ``"DISK"`` (its offloading
connector says ``"STORAGE"``, its Mooncake store connector ``"cpu"``); pass
``WireEvent(..., medium=...)`` to send such a producer-specific name. Every one of these
names decodes to the same tier in the conductor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal, get_args

import msgpack

from conductor.wire.events import MASK64, AllBlocksCleared, BlockRemoved, BlockStored, Event, Tier

Layout = Literal["vllm", "vllm-legacy", "sglang"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)


class _Derived(Enum):
    DERIVED = "derived"


DERIVED = _Derived.DERIVED
"""``WireEvent.extra_keys`` default: the keys vLLM's BlockPool sends for a text request."""


@dataclass(frozen=True, slots=True)
class WireEvent:
    """A typed event plus producer fields the conductor's events do not carry.

    Fields that do not exist in a layout (or for that event type) are not sent; None means
    "not set" (omitted where the producer omits it, nil where it always sends the key).
    """

    event: Event
    medium: str | None = None  # overrides the tier's name, e.g. "cpu", "STORAGE"
    lora_id: int | None = None
    extra_keys: list[object] | None | _Derived = DERIVED  # vLLM: one entry per block
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


_VLLM_MEDIA = {Tier.GPU: "GPU", Tier.CPU: "CPU", Tier.DISK: "DISK"}
_SGLANG_MEDIA = {Tier.GPU: "GPU", Tier.CPU: "CPU_PINNED", Tier.DISK: "DISK"}
_CLEARED_MAP = msgpack.packb({"type": "AllBlocksCleared"})


def _medium(wire: WireEvent, tier: Tier | None, names: dict[Tier, str]) -> str | None:
    if wire.medium is not None:
        return wire.medium
    return None if tier is None else names[tier]


def _present(**fields: object) -> dict[str, object]:
    """The optional struct fields that are set, in order (msgspec's ``omit_defaults``)."""
    return {key: value for key, value in fields.items() if value is not None}


def _extra_keys(wire: WireEvent, stored: BlockStored) -> list[object] | None:
    """BlockPool's per-block keys, untagged as events carry them: the LoRA name on every
    block, the cache salt after it on the first (the conductor reads the salt from there)."""
    if wire.extra_keys is not DERIVED:
        return wire.extra_keys
    lora = [stored.lora_name] if stored.lora_name is not None else []
    keys: list[object] = [lora or None for _ in stored.block_hashes]
    if stored.salt is not None and keys:
        keys[0] = [*lora, stored.salt]
    return keys


def _signed(value: int) -> int:
    """SGLang's hashes are two's-complement int64."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def _map16(fields: dict[str, object]) -> bytes:
    """A map with a 16-bit length header whatever its size: msgspec sizes a struct's header
    by its declared field count, and vLLM 0.33's BlockStored declares 16 (with the tag)."""
    packed = msgpack.packb(fields)
    header = 1 if len(fields) < 16 else 3  # what msgpack chose: fixmap or map16
    return b"\xde" + len(fields).to_bytes(2, "big") + packed[header:]


def _vllm_event(wire: WireEvent) -> bytes:
    event = wire.event
    if isinstance(event, BlockStored):
        fields: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": wire.lora_id,
            "medium": _medium(wire, event.tier, _VLLM_MEDIA),
            "lora_name": event.lora_name,
        }
        fields |= _present(
            extra_keys=_extra_keys(wire, event),
            group_idx=event.group_idx,
            kv_cache_spec_kind=wire.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=wire.kv_cache_spec_sliding_window,
            locality=wire.locality,
            ownership=wire.ownership,
            session_id=wire.session_id,
            lookahead_token_ids=wire.lookahead_token_ids,
        )
        return _map16(fields)
    if isinstance(event, BlockRemoved):
        fields = {
            "type": "BlockRemoved",
            "block_hashes": event.block_hashes,
            "medium": _medium(wire, event.tier, _VLLM_MEDIA),
        }
        fields |= _present(
            group_idx=event.group_idx, locality=wire.locality, ownership=wire.ownership
        )
        return msgpack.packb(fields)
    return _CLEARED_MAP


def _vllm_legacy_event(wire: WireEvent) -> bytes:
    event = wire.event
    if isinstance(event, BlockStored):
        return msgpack.packb(
            [
                "BlockStored",
                event.block_hashes,
                event.parent_hash,
                list(event.token_ids),
                event.block_size,
                wire.lora_id,
                _medium(wire, event.tier, _VLLM_MEDIA),
                event.lora_name,
                _extra_keys(wire, event),
                event.group_idx,
                wire.kv_cache_spec_kind,
                wire.kv_cache_spec_sliding_window,
            ]
        )
    if isinstance(event, BlockRemoved):
        medium = _medium(wire, event.tier, _VLLM_MEDIA)
        return msgpack.packb(["BlockRemoved", event.block_hashes, medium, event.group_idx])
    return msgpack.packb(["AllBlocksCleared"])


def _sglang_event(wire: WireEvent) -> bytes:
    event = wire.event
    if isinstance(event, BlockStored):
        parent = None if event.parent_hash is None else _signed(event.parent_hash)
        fields: dict[str, object] = {
            "type": "BlockStored",
            "block_hashes": [_signed(h) for h in event.block_hashes],
            "parent_block_hash": parent,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": wire.lora_id,
        }
        fields |= _present(
            medium=_medium(wire, event.tier, _SGLANG_MEDIA),
            cache_salt=event.salt,
            session_id=wire.session_id,
            lora_name=event.lora_name,
        )
        return msgpack.packb(fields)
    if isinstance(event, BlockRemoved):
        fields = {"type": "BlockRemoved", "block_hashes": [_signed(h) for h in event.block_hashes]}
        fields |= _present(medium=_medium(wire, event.tier, _SGLANG_MEDIA))
        return msgpack.packb(fields)
    return _CLEARED_MAP


_EVENT_ENCODERS: dict[str, Callable[[WireEvent], bytes]] = {
    "vllm": _vllm_event,
    "vllm-legacy": _vllm_legacy_event,
    "sglang": _sglang_event,
}


def check_layout(layout: str) -> Layout:
    """Fail at configuration time, not on the first publish."""
    if layout not in _EVENT_ENCODERS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return layout  # type: ignore[return-value]


def _wire(item: Event | WireEvent) -> WireEvent:
    """Reject anything else early: the encoders treat every other event as AllBlocksCleared."""
    wire = item if isinstance(item, WireEvent) else WireEvent(item)
    if not isinstance(wire.event, BlockStored | BlockRemoved | AllBlocksCleared):
        raise TypeError(f"not a conductor event: {wire.event!r:.60}")
    return wire


_PACKER = msgpack.Packer()


def encode_batch(
    events: Iterable[Event | WireEvent],
    timestamp: float,
    dp_rank: int | None,
    layout: Layout = "vllm",
) -> bytes:
    """One batch ``[ts (float64), events, dp_rank]`` as the producer of ``layout`` sends it.

    A None ``dp_rank`` is sent as nil, as the producers' encoders do; their publishers
    replace it by their own rank first (``KVEventPublisher.publish`` does too).
    """
    encode_event = _EVENT_ENCODERS[check_layout(layout)]
    encoded = [encode_event(_wire(item)) for item in events]
    return b"".join(
        (
            b"\x93",
            msgpack.packb(float(timestamp)),
            _PACKER.pack_array_header(len(encoded)),
            *encoded,
            msgpack.packb(dp_rank),
        )
    )
