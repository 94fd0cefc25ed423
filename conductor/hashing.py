"""The Go conductor's prefix hash, so indexes and queries agree with it.

``h_i = XXH64(u64le(h_{i-1}) || u32le(token)...)`` over complete blocks only, with the
root ``h_{-1} = XXH64(utf8(salt))``. Tokens are hashed as their int32 bit pattern.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import NewType, cast

import xxhash

from ._native import chain_hashes as _chain_hashes

_xxh64 = xxhash.xxh64_intdigest
# the conductor's own hash of a block and its whole prefix: the same for every engine
PrefixHash = NewType("PrefixHash", int)


@lru_cache(maxsize=4096)
def salt_root(salt: str) -> PrefixHash:
    """Root of every chain under ``salt``; ``salt_root("") == 0xef46db3751d8e999``."""
    return PrefixHash(_xxh64(salt.encode("utf-8")))


def pack_int32(token_ids: Sequence[int]) -> bytes:
    """Tokens as little-endian int32; raises ``struct.error`` for non-int32 values."""
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def int32_bytes(token_ids: Sequence[int] | bytes) -> bytes:
    """Tokens as little-endian int32, as a query holds them already; raises ``struct.error``
    for non-int32 values."""
    return token_ids if isinstance(token_ids, bytes) else pack_int32(token_ids)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Tokens as little-endian int32, wrapping values outside int32 like Go's cast.

    Raises TypeError when a token is not an integer.
    """
    try:
        return pack_int32(token_ids)
    except struct.error:
        if not all(isinstance(t, int) for t in token_ids):
            raise TypeError("token ids must be integers") from None
        return pack_int32([((t + 2**31) & 0xFFFFFFFF) - 2**31 for t in token_ids])


def chain_hashes(
    parent: PrefixHash, token_ids: Sequence[int] | bytes, block_size: int
) -> list[PrefixHash]:
    """Hashes of the complete blocks of ``token_ids`` (or their int32 bytes), chained
    from ``parent``; tokens outside int32 wrap as in ``token_bytes``. Raises TypeError when
    a token is not an integer. In C (conductor/native/hashing.c): it is the ingest path's
    inner loop (bench.conductor_bench measures ingest)."""
    return cast(list[PrefixHash], _chain_hashes(parent, token_ids, block_size))


def prefix_hashes(
    token_ids: Sequence[int] | bytes, block_size: int, salt: str = ""
) -> list[PrefixHash]:
    """The query path: one conductor hash per complete block of the prompt."""
    return chain_hashes(salt_root(salt), token_ids, block_size)
