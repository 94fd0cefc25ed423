"""vLLM 0.33 prefix-caching block hashes and SGLang 0.5.23 page hashes, bit for bit.

The simulator must publish the hashes a real vLLM 0.33 engine would publish for the same
request, so that an index fed by simulated engines behaves like one fed by real ones and the
golden vectors in ``tests/fixtures/vllm_hash_vectors.json`` hold:

- ``hash_fn`` serializes its argument with pickle (protocol 5) or canonical CBOR
  (``conductor/vllm_hash.py``, which the conductor hashes profiled queries with) and digests
  it with SHA-256 (32 bytes) or XXH3-128 (16 bytes);
- the chain root is ``NONE_HASH = hash_fn(seed)`` — the seed *string* is hashed;
- block ``i`` is ``hash_fn((parent_digest, tuple(tokens_i), extra_keys_i))`` with the root as
  the parent of block 0 and extra keys tagged as 0.31+ does (``("lora", name, path)`` on every
  block, ``("cache_salt", salt)`` on block 0), None when there are none;
- events carry ``int.from_bytes(digest, "big") & (2**64 - 1)`` and *untagged* extra keys
  (the LoRA name without its path, the bare salt).

Only what text requests need is implemented: no multimodal, prompt-embeds or lookahead keys.

SGLang (``SGLangBlockHasher``, pinned by ``tests/fixtures/sglang_frames.json``) chains pages
with plain SHA-256: page ``i``'s digest is ``SHA-256(digest_{i-1} || tokens_i as uint32
little-endian)``, with nothing before page 0's tokens, or, for a request with a cache salt,
``SHA-256("sglang-cache-salt-v1\\0" || salt)`` as page 0's parent. Events carry the digest's
*first* eight bytes read big-endian as a signed int64 (``hash_str_to_int64``); here the
unsigned form, which the ``sglang`` layout of ``publishers.encoding`` sends signed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import xxhash

from conductor import sglang_hash
from conductor.vllm_hash import cbor, low64_be, pickled

HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # sha256 variants with PYTHONHASHSEED unset, >= 0.29
HashFunction = Callable[[object], bytes]
ExtraKeys = tuple[object, ...] | None
event_hash = low64_be  # a digest as events carry it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)
Engine = Literal["vllm", "sglang"]  # whose cache, hashes and wire the simulator imitates
ENGINES: tuple[Engine, ...] = get_args(Engine)


def hash_function(algorithm: str) -> HashFunction:
    """vLLM's ``--prefix-caching-hash-algo`` as a function of any picklable/CBOR value."""
    if algorithm == "sha256":
        return lambda value: hashlib.sha256(pickled(value)).digest()
    if algorithm == "sha256_cbor":
        return lambda value: hashlib.sha256(cbor(value)).digest()
    if algorithm == "xxhash":
        return lambda value: xxhash.xxh3_128_digest(pickled(value))
    if algorithm == "xxhash_cbor":
        return lambda value: xxhash.xxh3_128_digest(cbor(value))
    raise ValueError(f"unknown hash algorithm {algorithm!r}; expected one of {HASH_ALGORITHMS}")


def none_hash_seed(algorithm: str, python_hash_seed: str | None) -> str:
    """The string vLLM hashes into NONE_HASH.

    ``python_hash_seed`` is the PYTHONHASHSEED value as the engine would see it (read the
    environment at the CLI edge and pass it here): used verbatim when set. Unset, the sha256
    variants use a fixed string and the xxhash variants a random one, so two xxhash engines
    without PYTHONHASHSEED never share hashes — exactly like vLLM.
    """
    if python_hash_seed is not None:
        return python_hash_seed
    if algorithm in ("sha256", "sha256_cbor"):
        return DEFAULT_NONE_HASH_SEED
    return os.urandom(32).hex()


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """The parts of vLLM's ``LoRARequest`` that reach hashes and events."""

    name: str
    adapter_id: int  # ``lora_int_id``: sent as the event's deprecated ``lora_id``
    path: str = ""  # hashed, never published


def hash_extra_keys(
    block_index: int, lora: LoraAdapter | None, cache_salt: str | None
) -> ExtraKeys:
    """Tagged extra keys that enter block ``block_index``'s hash (vLLM >= 0.31)."""
    keys: list[object] = []
    if lora is not None:
        keys.append(("lora", lora.name, lora.path))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(
    block_index: int, lora: LoraAdapter | None, cache_salt: str | None
) -> ExtraKeys:
    """The same keys as BlockStored publishes them: untagged, LoRA name without its path."""
    keys: list[object] = []
    if lora is not None:
        keys.append(lora.name)
    if block_index == 0 and cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


class PageHasher(Protocol):
    """What the block manager needs of an engine's hash chain."""

    def block_digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora: LoraAdapter | None = None,
        cache_salt: str | None = None,
        start: int = 0,
        parent: bytes | None = None,
    ) -> list[bytes]: ...

    def event_hash(self, digest: bytes) -> int: ...


class BlockHasher:
    """One vLLM engine's hash configuration: the algorithm and its NONE_HASH root."""

    def __init__(self, algorithm: str = "sha256", python_hash_seed: str | None = None) -> None:
        self.algorithm = algorithm
        self._hash = hash_function(algorithm)
        self.none_hash = self._hash(none_hash_seed(algorithm, python_hash_seed))

    def digest(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: ExtraKeys
    ) -> bytes:
        """One block's digest; ``parent`` None means block 0 (chained from NONE_HASH)."""
        return self._hash((parent or self.none_hash, tuple(token_ids), extra_keys))

    def event_hash(self, digest: bytes) -> int:
        return event_hash(digest)

    def block_digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora: LoraAdapter | None = None,
        cache_salt: str | None = None,
        start: int = 0,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Digests of a request's complete blocks from index ``start`` on (``parent`` is block
        ``start - 1``'s digest), as vLLM's request block hasher chains them."""
        digests: list[bytes] = []
        for index in range(start, len(token_ids) // block_size):
            tokens = token_ids[index * block_size : (index + 1) * block_size]
            parent = self.digest(parent, tokens, hash_extra_keys(index, lora, cache_salt))
            digests.append(parent)
        return digests


class SGLangBlockHasher:
    """SGLang 0.5.23's page chain (``get_hash_str`` over its native SHA-256 binding)."""

    def block_digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora: LoraAdapter | None = None,
        cache_salt: str | None = None,
        start: int = 0,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Digests of the complete pages from index ``start`` on (``parent`` is page
        ``start - 1``'s digest); a salted chain starts from the salt's root."""
        if lora is not None:
            raise ValueError("LoRA adapters are not simulated for SGLang")
        salt = cache_salt or ""
        digests = sglang_hash.page_digests(
            token_ids, block_size, salt, start=start, parent=parent or b""
        )
        return list(digests)

    def event_hash(self, digest: bytes) -> int:
        """SGLang's ``hash_str_to_int64`` of a page digest, unsigned: its first eight bytes."""
        return sglang_hash.first64_be(digest)
