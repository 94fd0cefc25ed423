"""One entry point for every producer's payload: detect the layout per event, decode it.

Detection is by each event's shape, not by registration type, so a stream that mixes
layouts (an engine plus its store connector) or a mislabelled registration still decodes;
arrays on the legacy ``mooncake`` topic are Mooncake events, as the Go service routes them. One bad
event is rejected with a reason; the rest of its batch survives.

The common layouts (a batch of well-formed vLLM / SGLang maps, or of vLLM <= 0.23 arrays)
first go through msgspec's typed decoder (``typed.py``), which takes a batch whole or not
at all. Before either, the service offers a batch to the C lane (``pack_batch``), which
reads the plainest batches (GPU blocks of the registered block size, no LoRA, salt or
group) into C buffers that the index applies without a Python object per event.
"""

from __future__ import annotations

import msgpack

from .. import _native
from . import mooncake, vllm
from .events import DecodeError, Event, EventBatch
from .typed import decode_typed_batch

LEGACY_MOONCAKE_TOPIC = b"mooncake"


def _decode_event(event: object, legacy_mooncake: bool) -> Event:
    if isinstance(event, dict):
        if "event_type" in event:
            return mooncake.decode_rfc_event(event)
        return vllm.decode_map_event(event)
    if isinstance(event, list):
        if legacy_mooncake or (event and event[0] == "BlockStoreEvent"):
            return mooncake.decode_legacy_event(event)
        return vllm.decode_array_event(event)
    raise DecodeError(f"event must be a map or an array, got {type(event).__name__}")


def pack_batch(payload: bytes, topic: bytes, block_size: int) -> _native.PackedBatch | None:
    """The batch read for the C lane (``PrefixCacheTable.apply_packed``); None: it needs
    ``decode_batch`` (another layout or topic, an event the lane does not take, an error)."""
    if topic == LEGACY_MOONCAKE_TOPIC:
        return None
    return _native.pack_batch(payload, block_size)


def decode_batch(payload: bytes, topic: bytes = b"") -> EventBatch:
    """Decode one msgpack batch ``[ts, events(, dp_rank)]``; raise DecodeError if unusable."""
    if topic != LEGACY_MOONCAKE_TOPIC:
        batch = decode_typed_batch(payload)
        if batch is not None:
            return batch
    return decode_any_layout(payload, topic)


def decode_any_layout(payload: bytes, topic: bytes = b"") -> EventBatch:
    """``decode_batch`` without the fast path: every layout, one event rejected at a time."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as error:  # msgpack raises many types for corrupt input
        raise DecodeError(f"not msgpack: {error}") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise DecodeError("batch must be an array [ts, events(, dp_rank)]")
    timestamp, events = batch[0], batch[1]
    dp_rank = batch[2] if len(batch) == 3 else None
    if not isinstance(events, list):
        raise DecodeError("batch events must be an array")
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise DecodeError(f"batch timestamp must be a number, got {timestamp!r:.40}")
    if isinstance(timestamp, int):  # the Mooncake master sends milliseconds
        timestamp = timestamp / 1000.0
    if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
        raise DecodeError(f"batch dp_rank must be a non-negative int, got {dp_rank!r:.40}")
    legacy = topic == LEGACY_MOONCAKE_TOPIC
    decoded: list[Event] = []
    rejected: list[str] = []
    for index, event in enumerate(events):
        try:
            decoded.append(_decode_event(event, legacy))
        except DecodeError as error:
            rejected.append(f"event {index}: {error}")
    return EventBatch(float(timestamp), decoded, dp_rank, rejected)
