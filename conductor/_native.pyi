"""Types of the C module conductor._native (what each function stands for: its source in
conductor/native/)."""

import socket
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

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
def u64_hashes(values: list[object], /) -> list[int] | None: ...
def int32_tokens(raw: bytes | bytearray | memoryview, /) -> bytes | None: ...
def json_int32_field(body: bytes, key: str, /) -> tuple[bytes, bytes] | None: ...

class PackedBatch:
    """An event batch pack_batch read into C buffers: len() events."""

    timestamp: float
    dp_rank: int | None
    removals: int
    def __len__(self) -> int: ...

def pack_batch(payload: bytes, block_size: int, /) -> PackedBatch | None: ...

class Holdings:
    """One owner's blocks on one tier of a context (made by ContextBlocks.owner); its maps
    are read only."""

    @property
    def by_engine_hash(self) -> HashMap[EngineHash, PrefixHash]: ...
    @property
    def copies(self) -> HashMap[EngineHash, int]: ...  # physical copies beyond the first
    @property
    def extra_refs(self) -> HashMap[PrefixHash, int]: ...  # engine hashes beyond the first
    def count(self) -> int: ...
    def prefix_count(self) -> int: ...

class ContextBlocks:
    """The blocks of one context and of each of its owners; its maps are read only, and
    change through its methods."""

    @property
    def blocks(self) -> tuple[MaskMap[PrefixHash], MaskMap[PrefixHash], MaskMap[PrefixHash]]: ...
    @property
    def engine_prefix(self) -> HashMap[EngineHash, PrefixHash]: ...
    @property
    def engine_refs(self) -> HashMap[EngineHash, int]: ...  # holders beyond the first
    def __init__(self, block_size: int) -> None: ...
    def owner(self, bit: int, /) -> tuple[Holdings, Holdings, Holdings]: ...
    def hold(
        self,
        holdings: Holdings,
        engine_hashes: Sequence[EngineHash],
        prefix_hashes: Sequence[PrefixHash],
        /,
    ) -> int: ...
    def release(self, holdings: Holdings, engine_hashes: Sequence[EngineHash], /) -> int: ...
    def evict(self, holdings: Holdings, engine_hashes: Sequence[EngineHash], /) -> int: ...
    def clear(self, holdings: Holdings, /) -> int: ...
    def apply_packed(
        self,
        packed: PackedBatch,
        owner: tuple[Holdings, Holdings, Holdings],
        start: int,
        max_blocks: int,
        root: int | None,
        /,
    ) -> tuple[int, int, int, int, int]: ...
    def walk(
        self, hashes: Sequence[object], interest: int, /
    ) -> list[tuple[list[int], tuple[int, int, int, int]]]: ...
    def walk_tiers(
        self,
        hashes: Sequence[object],
        interest: int,
        pool_members: dict[int, int],
        /,
    ) -> list[tuple[list[int], tuple[int, int, int, int]]]: ...

class IngestThread:
    """A thread that applies packed batches without the GIL (conductor/native/ingest.c)."""

    def submit(
        self,
        blocks: ContextBlocks,
        packed: PackedBatch,
        owner: tuple[Holdings, Holdings, Holdings],
        start: int,
        root: int | None,
        token: object,
        /,
    ) -> None: ...
    def finished(self) -> list[tuple[Any, tuple[int, int, int, int, int] | BaseException]]: ...
    def pause(self, answering: bool, /) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...

class QueryPlan:
    """How to answer a context's plain query (conductor/native/answer.c)."""

    def __init__(
        self,
        context: ContextBlocks,
        pool_members: dict[int, int],
        instances: tuple[tuple[bytes, tuple[int, ...], tuple[bytes, ...], bytes], ...],
        opener: bytes,
        closer: bytes,
        msgpack: bool,
    ) -> None: ...
    def answer(
        self,
        tokens: bytes,
        root: int | ProfileChain,
        hits_only: bool,
        minimum: Sequence[int] | None,
        /,
    ) -> tuple[bytes, int]: ...

class QueryThread:
    """Plain queries answered on a thread of its own (conductor/native/query_thread.c)."""

    def __init__(
        self,
        reader: HeadReader,
        listeners: tuple[socket.socket, ...],
        heads: tuple[bytes, bytes],
        msgpack_type: bytes,
        token: bytes | None,
        max_body: int,
        max_tokens: int,
        keepalive_s: float,
        bounds: tuple[float, ...],
        max_connections: int,
    ) -> None: ...
    @property
    def handover_fd(self) -> int: ...
    @property
    def connections(self) -> int: ...
    @property
    def last_request(self) -> float: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def publish(
        self,
        key: tuple[str, str, str, int],
        json: QueryPlan | None,
        msgpack: QueryPlan | None,
        chain: ProfileChain | None,
        /,
    ) -> None: ...
    def hold(self, key: tuple[str, str, str, int], /) -> None: ...
    def handovers(self) -> list[tuple[int, bytes]]: ...
    def stats(self) -> tuple[int, float, tuple[int, ...], int, int]: ...
    def set_routed(self, held: bool, /) -> None: ...
    def set_loop_connections(self, count: int, /) -> None: ...

class ProfileChain(Iterator[int]):
    """A profiled context's block keys, lazily (conductor/native/profile.c)."""

    def __init__(
        self,
        kind: int,
        tokens: bytes,
        block_size: int,
        root: bytes,
        first_suffix: bytes,
        suffix: bytes,
    ) -> None: ...
    def __next__(self) -> int: ...

def sha256(data: bytes, portable: bool = False, /) -> bytes: ...

class HeadReader:
    """Reads the plain heads of ``POST <target>`` requests (conductor/native/request.c)."""

    def __init__(self, target: bytes, read: Sequence[str], declined: Sequence[str]) -> None: ...
    def read(self, head: bytes, /) -> tuple[Any, ...] | None: ...

def plain_query_fields(
    body: bytes, msgpack: bool, /
) -> tuple[str, str, str, int, str | None, bytes] | None: ...
