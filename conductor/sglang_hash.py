"""SGLang's block hashes, as its KV events name blocks and as a profiled query must.

SGLang 0.5.23 (``sglang/srt/mem_cache/cpp_utils/hash_binding.cpp``, ``utils.py``) hashes
page by page: page ``i``'s digest is ``SHA-256(digest_{i-1} || its tokens as uint32
little-endian)``, the first page without a parent. An event carries the digest's first
eight bytes, big-endian, as a signed int64; the index keeps the same 64 bits unsigned
(upstream Mooncake's ``first64_be`` projection). With speculative decoding (EAGLE) its
radix keys are bigrams: each token is hashed with its successor, ``(t_i, t_{i+1})``, and a
prompt of n tokens has n - 1 of them.

A request's cache salt roots the chain at ``SHA-256(b"sglang-cache-salt-v1\\0" || salt)``,
in SGLang's events (``tests/fixtures/sglang_frames.json`` holds a salted request's) as in
upstream's later C++ conductor's queries (``hash_strategy.cpp``, ``SglangHashChain``); an
empty salt is none.

One place for both the conductor (a profiled context's query keys) and the engine simulator
(publishing what a real SGLang publishes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from itertools import islice

from ._native import ProfileChain
from .hashing import int32_bytes

SALT_ROOT_PREFIX = b"sglang-cache-salt-v1\x00"
TOKEN_BYTES = 4
CHAIN_PAGES, CHAIN_BIGRAM = 2, 3  # _native.ProfileChain's kinds


def first64_be(digest: bytes) -> int:
    """The index key of a digest: its first eight bytes, big-endian, unsigned."""
    return int.from_bytes(digest[:8], "big")


def signed64(key: int) -> int:
    """The key as SGLang's events carry it: two's-complement int64."""
    return key - (1 << 64) if key >= 1 << 63 else key


def salt_root(cache_salt: str) -> bytes:
    """The parent of a salted chain's first page (none without a salt)."""
    if not cache_salt:
        return b""
    return hashlib.sha256(SALT_ROOT_PREFIX + cache_salt.encode()).digest()


def _pages(packed: bytes, page_size: int, bigram: bool) -> Iterator[bytes]:
    """The bytes each complete page hashes: its tokens, or its tokens' bigrams."""
    tokens = len(packed) // TOKEN_BYTES
    if not bigram:
        width = page_size * TOKEN_BYTES
        for start in range(0, tokens // page_size * width, width):
            yield packed[start : start + width]
        return
    for first in range(0, (tokens - 1) // page_size * page_size, page_size):
        yield b"".join(
            packed[i * TOKEN_BYTES : (i + 2) * TOKEN_BYTES] for i in range(first, first + page_size)
        )


def page_digests(
    token_ids: Sequence[int] | bytes,
    page_size: int,
    cache_salt: str = "",
    bigram: bool = False,
    *,
    start: int = 0,
    parent: bytes = b"",
) -> Iterator[bytes]:
    """The 32-byte digests of a prompt's complete pages from page ``start`` on (``parent``:
    page ``start - 1``'s digest; page 0's is the salt's root), lazily: a caller that stops
    early hashes no further (an incomplete tail is no page SGLang's radix cache reuses)."""
    if start == 0:
        parent = salt_root(cache_salt)
    for page in islice(_pages(int32_bytes(token_ids), page_size, bigram), start, None):
        parent = hashlib.sha256(parent + page).digest()
        yield parent


def block_keys(
    token_ids: Sequence[int] | bytes, page_size: int, cache_salt: str = "", bigram: bool = False
) -> Iterator[int]:
    """The index keys of a prompt's complete pages (``first64_be`` of each digest), lazily,
    in C (``page_digests`` is the reference the tests hold it to, and the way for a page
    of over 2**20 tokens)."""
    kind = CHAIN_BIGRAM if bigram else CHAIN_PAGES
    tokens = int32_bytes(token_ids)
    try:
        return ProfileChain(kind, tokens, page_size, salt_root(cache_salt), b"", b"")
    except ValueError:
        digests = page_digests(tokens, page_size, cache_salt, bigram)
        return (first64_be(digest) for digest in digests)
