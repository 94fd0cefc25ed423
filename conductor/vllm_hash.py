"""vLLM's prefix-caching block hashes: the bytes it digests, its chain and its event keys.

One place for what both the conductor (hashing a query's tokens as a profiled engine does)
and the engine simulator (publishing a real engine's hashes) need:

- a value is serialized with pickle protocol 5 (``sha256``) or canonical CBOR
  (``sha256_cbor``) and digested with SHA-256;
- the chain's root is ``NONE_HASH = sha256(serialize(seed text))``, the literal
  ``PYTHONHASHSEED`` text;
- block ``i`` is ``sha256(serialize((parent_digest, tuple(tokens_i), extras_i)))``, the full
  32-byte digest chained;
- events and the index carry a digest's last eight bytes, big-endian (``low64_be``).

The extras of the query chain are upstream Mooncake's C++ conductor's (dev/conductor
19ffa6e4a, ``hash_strategy.cpp``): the LoRA name on every block, then the cache salt on
block 0, untagged, None when neither; vLLM before 0.31 hashed them so. vLLM 0.31+ tags them
and hashes the adapter's path too, which no query carries; the simulator builds those
itself (``publishers/engine/block_hash.py``) over the same serializers.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any

from ._native import ProfileChain
from .hashing import int32_bytes

PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL of every Python vLLM supports
Serializer = Callable[[object], bytes]
Extras = tuple[str, ...] | None

_UINT, _NEGATIVE, _BYTES, _TEXT, _ARRAY = 0x00, 0x20, 0x40, 0x60, 0x80  # CBOR major types
_NULL = b"\xf6"


def _head(major: int, value: int) -> bytes:
    """A CBOR item's head: major type and argument in the shortest form (RFC 8949 §4.2.1)."""
    if value < 24:
        return bytes((major | value,))
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes((major | info,)) + value.to_bytes(width, "big")
    raise ValueError("CBOR argument beyond 64 bits")


@lru_cache(maxsize=16384)  # a prompt's tokens repeat; the cache is ~2 MB at most
def _cbor_int(value: int) -> bytes:
    return _head(_UINT, value) if value >= 0 else _head(_NEGATIVE, -1 - value)


def cbor_text(text: str) -> bytes:
    """``text`` as a CBOR text string (RFC 8949 §3.1, the shortest length form)."""
    data = text.encode("utf-8")
    return _head(_TEXT, len(data)) + data


def _cbor_bytes(data: bytes) -> bytes:
    return _head(_BYTES, len(data)) + data


def _cbor_array(items: tuple[object, ...] | list[object]) -> bytes:
    return _head(_ARRAY, len(items)) + b"".join(map(cbor, items))


def _cbor_null(_: None) -> bytes:
    return _NULL


_CBOR_OF_TYPE: dict[type, Callable[[Any], bytes]] = {
    type(None): _cbor_null,
    int: _cbor_int,
    str: cbor_text,
    bytes: _cbor_bytes,
    tuple: _cbor_array,
    list: _cbor_array,
}


def cbor(value: object) -> bytes:
    """Canonical CBOR of what vLLM hashes for text requests: None, int (64-bit), str, bytes
    and tuples or lists of them (arrays), as ``cbor2.dumps(value, canonical=True)``."""
    encode = _CBOR_OF_TYPE.get(type(value))
    if encode is None:
        raise TypeError(f"vLLM's block hash does not encode {type(value).__name__}")
    return encode(value)


def pickled(value: object) -> bytes:
    """What vLLM's ``sha256`` digests: the value pickled with protocol 5."""
    return pickle.dumps(value, protocol=PICKLE_PROTOCOL)


SERIALIZERS: dict[str, Serializer] = {"sha256": pickled, "sha256_cbor": cbor}
CHAIN_KINDS = {"sha256_cbor": 0, "sha256": 1}  # _native.ProfileChain's kinds
_DIGEST_HEAD = 2 + 9 + 2 + 32 + 1  # pickle: PROTO, FRAME, the parent's bytes, MEMOIZE


def low64_be(digest: bytes) -> int:
    """A digest as events and the index carry it: its last eight bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


@lru_cache(maxsize=64)
def none_hash(algorithm: str, seed: str) -> bytes:
    """vLLM's ``NONE_HASH``: the root every chain of ``algorithm`` starts from."""
    return hashlib.sha256(SERIALIZERS[algorithm](seed)).digest()


def query_extras(block_index: int, lora_name: str, cache_salt: str) -> Extras:
    """The extras a query's block enters the hash with: the LoRA name on every block, the
    cache salt on block 0 (upstream C++'s ``VllmV1HashChain``)."""
    keys = [lora_name] if lora_name else []
    if block_index == 0 and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) or None


@lru_cache(maxsize=256)
def block_suffixes(
    algorithm: str, block_size: int, lora_name: str, cache_salt: str
) -> tuple[bytes, bytes]:
    """What block 0's serialization ends with after its tokens, and every later block's:
    the extras (and, in a pickle, the triple's closing opcodes). C writes the rest
    (``_native.ProfileChain``)."""
    suffixes = []
    for index in (0, 1):
        extras = query_extras(index, lora_name, cache_salt)
        if algorithm == "sha256_cbor":
            suffixes.append(cbor(extras))
            continue
        dummy = pickled((bytes(32), (0,) * block_size, extras))
        # each 0 a BININT1 (2 bytes); the tuple's opcode, its MEMOIZE and, past 3, a MARK
        tokens = 2 * block_size + 2 + (block_size > 3)
        suffixes.append(dummy[_DIGEST_HEAD + tokens :])
    return suffixes[0], suffixes[1]


def block_keys(
    algorithm: str,
    seed: str,
    token_ids: Sequence[int] | bytes,
    block_size: int,
    lora_name: str = "",
    cache_salt: str = "",
) -> Iterator[int]:
    """The index keys of a prompt's complete blocks (``token_ids`` as int32 ints or packed
    int32 little-endian), lazily: a caller that stops early hashes no further. In C: a
    block's serialization and SHA-256 cost ~4.6 µs in Python."""
    first, later = block_suffixes(algorithm, block_size, lora_name, cache_salt)
    tokens, root = int32_bytes(token_ids), none_hash(algorithm, seed)
    try:
        return ProfileChain(CHAIN_KINDS[algorithm], tokens, block_size, root, first, later)
    except ValueError:  # a pickled block past one frame (~13,000 tokens): C writes none
        return _general_keys(algorithm, root, tokens, block_size, lora_name, cache_salt)


def _general_keys(
    algorithm: str, root: bytes, tokens: bytes, block_size: int, lora_name: str, cache_salt: str
) -> Iterator[int]:
    """The same keys through the general serializers."""
    serialize, parent = SERIALIZERS[algorithm], root
    whole = len(tokens) // (4 * block_size) * 4 * block_size
    for index, values in enumerate(struct.iter_unpack(f"<{block_size}i", tokens[:whole])):
        extras = query_extras(index, lora_name, cache_salt)
        parent = hashlib.sha256(serialize((parent, values, extras))).digest()
        yield low64_be(parent)
