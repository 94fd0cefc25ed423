"""Wire formats of KV-event producers, decoded into typed events.

Every accepted format, byte by byte, with its source: docs/wire.md.
"""

from .decode import decode_any_layout, decode_batch, pack_batch
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Event,
    EventBatch,
    Tier,
    normalize_hash,
    parse_medium,
)
from .frames import END_SEQ, FrameError, Message, parse_live, parse_replay, replay_request

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "Event",
    "EventBatch",
    "FrameError",
    "Message",
    "Tier",
    "decode_any_layout",
    "decode_batch",
    "normalize_hash",
    "pack_batch",
    "parse_live",
    "parse_medium",
    "parse_replay",
    "replay_request",
]
