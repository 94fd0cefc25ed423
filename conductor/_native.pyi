"""Types of the C module conductor._native (what each function stands for: its source in
conductor/native/)."""

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar, overload

from .hashing import PrefixHash
from .wire.events import EngineHash

K = TypeVar("K", bound=int)
V = TypeVar("V", bound=int)
T = TypeVar("T")

class _Map(Generic[K, V]):
    """What HashMap and MaskMap share (no such class at run time)."""

    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __getitem__(self, key: K) -> V: ...
    def __setitem__(self, key: K, value: V) -> None: ...
    def __delitem__(self, key: K) -> None: ...
    def __iter__(self) -> Iterator[K]: ...
    @overload
    def get(self, key: K) -> V | None: ...
    @overload
    def get(self, key: K, default: T) -> V | T: ...
    @overload
    def pop(self, key: K) -> V: ...
    @overload
    def pop(self, key: K, default: T) -> V | T: ...
    def keys(self) -> Iterator[K]: ...
    def values(self) -> Iterator[V]: ...
    def items(self) -> Iterator[tuple[K, V]]: ...
    def clear(self) -> None: ...

class HashMap(_Map[K, V]): ...
class MaskMap(_Map[K, int]): ...

def chain_hashes(
    parent: int, token_ids: Sequence[int] | bytes, block_size: int, /
) -> list[int]: ...

# what hold and release_many change: one owner's blocks on one tier (by_engine_hash,
# copies, extra_refs), the context's engine_prefix and engine_refs, the tier's blocks, the
# owner's bit (PrefixContext._holder)
HolderArgs = tuple[
    HashMap[EngineHash, PrefixHash],
    dict[EngineHash, int],
    dict[PrefixHash, int],
    HashMap[EngineHash, PrefixHash],
    dict[EngineHash, int],
    MaskMap[PrefixHash],
    int,
]

def hold(
    by_engine_hash: HashMap[EngineHash, PrefixHash],
    copies: dict[EngineHash, int],
    extra_refs: dict[PrefixHash, int],
    engine_prefix: HashMap[EngineHash, PrefixHash],
    engine_refs: dict[EngineHash, int],
    blocks: MaskMap[PrefixHash],
    bit: int,
    engine_hashes: Sequence[EngineHash],
    prefix_hashes: Sequence[PrefixHash],
    /,
) -> int: ...
def release_many(
    by_engine_hash: HashMap[EngineHash, PrefixHash],
    copies: dict[EngineHash, int],
    extra_refs: dict[PrefixHash, int],
    engine_prefix: HashMap[EngineHash, PrefixHash],
    engine_refs: dict[EngineHash, int],
    blocks: MaskMap[PrefixHash],
    bit: int,
    engine_hashes: Sequence[EngineHash],
    /,
) -> int: ...
def release_all(
    by_engine_hash: HashMap[EngineHash, PrefixHash],
    engine_prefix: HashMap[EngineHash, PrefixHash],
    engine_refs: dict[EngineHash, int],
    blocks: MaskMap[PrefixHash],
    bit: int,
    /,
) -> int: ...
def u64_hashes(values: list[object], /) -> list[int] | None: ...
def int32_tokens(raw: bytes | bytearray | memoryview, /) -> bytes | None: ...
def json_int32_field(body: bytes, key: str, /) -> tuple[bytes, bytes] | None: ...

class PackedBatch:
    """An event batch pack_batch read into C buffers: len() events."""

    timestamp: float
    dp_rank: int | None
    removals: int
    def __len__(self) -> int: ...
    def apply(
        self,
        start: int,
        max_blocks: int,
        block_size: int,
        root: int,
        owner_tiers: tuple[HashMap[EngineHash, PrefixHash], ...],
        by_engine_hash: HashMap[EngineHash, PrefixHash],
        copies: dict[EngineHash, int],
        extra_refs: dict[PrefixHash, int],
        engine_prefix: HashMap[EngineHash, PrefixHash],
        engine_refs: dict[EngineHash, int],
        blocks: MaskMap[PrefixHash],
        bit: int,
        /,
    ) -> tuple[int, int, int, int, int]: ...

def pack_batch(payload: bytes, block_size: int, /) -> PackedBatch | None: ...
def walk_masks(
    blocks: MaskMap[K], hashes: Sequence[object], interest: int, /
) -> list[tuple[list[int], tuple[int, int, int, int]]]: ...
