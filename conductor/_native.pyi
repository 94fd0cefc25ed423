"""Types of the C module conductor/_native.c (what each function stands for: its source)."""

from collections.abc import Sequence

from .hashing import PrefixHash
from .wire.events import EngineHash

def chain_hashes(
    parent: int, token_ids: Sequence[int] | bytes, block_size: int, /
) -> list[int]: ...
def hold(
    by_engine_hash: dict[EngineHash, PrefixHash],
    copies: dict[EngineHash, int],
    extra_refs: dict[PrefixHash, int],
    engine_prefix: dict[EngineHash, PrefixHash],
    engine_refs: dict[EngineHash, int],
    blocks: dict[PrefixHash, int],
    bit: int,
    engine_hashes: Sequence[EngineHash],
    prefix_hashes: Sequence[PrefixHash],
    /,
) -> int: ...
def release_many(
    by_engine_hash: dict[EngineHash, PrefixHash],
    engine_prefix: dict[EngineHash, PrefixHash],
    engine_refs: dict[EngineHash, int],
    blocks: dict[PrefixHash, int],
    bit: int,
    engine_hashes: Sequence[EngineHash],
    /,
) -> int: ...
def u64_hashes(values: list[object], /) -> list[int] | None: ...
