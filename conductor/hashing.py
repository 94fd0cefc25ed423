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

_xxh64 = xxhash.xxh64_intdigest
_U64 = struct.Struct("<Q")
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
# the conductor's own hash of a block and its whole prefix: the same for every engine
PrefixHash = NewType("PrefixHash", int)


@lru_cache(maxsize=4096)
def salt_root(salt: str) -> PrefixHash:
    """Root of every chain under ``salt``; ``salt_root("") == 0xef46db3751d8e999``."""
    return PrefixHash(_xxh64(salt.encode("utf-8")))


def pack_int32(token_ids: Sequence[int]) -> bytes:
    """Tokens as little-endian int32; raises ``struct.error`` for non-int32 values."""
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


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
    from ``parent``."""
    if block_size <= 0:
        return []
    data = token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids)
    step = block_size * 4
    end = (len(data) // step) * step
    pack = _U64.pack
    chain: int = parent
    hashes = []
    for offset in range(0, end, step):
        chain = _xxh64(pack(chain) + data[offset : offset + step])
        hashes.append(chain)
    return cast(list[PrefixHash], hashes)  # no NewType call per block on the query path


def prefix_hashes(
    token_ids: Sequence[int] | bytes, block_size: int, salt: str = ""
) -> list[PrefixHash]:
    """The query path: one conductor hash per complete block of the prompt."""
    return chain_hashes(salt_root(salt), token_ids, block_size)
