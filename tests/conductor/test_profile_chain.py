"""The profiled chains in C (``conductor/native/profile.c``, ``sha256.c``): SHA-256 as
hashlib's, and every profile's block keys as the reference serializers and hashlib make
them, over random prompts with the edges of each encoding (CBOR's and pickle's integer
widths, long and non-ASCII LoRA names and salts, block sizes around pickle's small-tuple
opcodes). Against the engines: vLLM's keys in test_vllm_hash.py (vLLM's own vectors);
SGLang's reference, ``page_digests``, is the engine simulator's, held to real SGLang's
frames in tests/publishers/engine/test_engine_sglang.py."""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import struct

import cbor2
import pytest

from conductor import _native, sglang_hash, vllm_hash
from conductor.vllm_hash import none_hash, query_extras

EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, -1, -24, -25, -256, -257, -(2**31)]
NAMES = ["", "a", "adapter-A", "ádàptér", "x" * 300]
SALTS = ["", "s", "tenant-salt", "sålt", "y" * 70_000]
SERIALIZE = {
    "sha256": lambda value: pickle.dumps(value, protocol=5),
    "sha256_cbor": lambda value: cbor2.dumps(value, canonical=True),
}


def random_tokens(rng: random.Random, count: int, signed: bool = True) -> list[int]:
    low = -(2**31) if signed else 0
    return [
        rng.choice(EDGES if signed else [e for e in EDGES if e >= 0])
        if rng.random() < 0.3
        else rng.randrange(low, 2**31)
        for _ in range(count)
    ]


def reference_vllm_keys(
    algorithm: str, seed: str, tokens: list[int], size: int, lora: str, salt: str
) -> list[int]:
    parent, keys = none_hash(algorithm, seed), []
    for index in range(len(tokens) // size):
        block = tuple(tokens[index * size : (index + 1) * size])
        extras = query_extras(index, lora, salt)
        parent = hashlib.sha256(SERIALIZE[algorithm]((parent, block, extras))).digest()
        keys.append(int.from_bytes(parent[-8:], "big"))
    return keys


@pytest.mark.parametrize("portable", [False, True], ids=["accelerated", "portable"])
def test_sha256_is_hashlibs(portable: bool) -> None:
    """Every length around the 64-byte blocks and their padding's two cases, and long ones."""
    rng = random.Random(7)
    for length in [*range(0, 200), 1000, 4096, 100_003]:
        data = rng.randbytes(length)
        assert _native.sha256(data, portable) == hashlib.sha256(data).digest(), length


@pytest.mark.parametrize("algorithm", sorted(SERIALIZE))
def test_vllm_chains_are_the_reference_serializers(algorithm: str) -> None:
    rng = random.Random(algorithm)
    for _ in range(300):
        size = rng.choice([1, 2, 3, 4, 5, 16, 17])
        tokens = random_tokens(rng, rng.randrange(0, 6 * size + 3))
        lora, salt, seed = rng.choice(NAMES), rng.choice(SALTS), rng.choice(["0", "42"])
        expected = reference_vllm_keys(algorithm, seed, tokens, size, lora, salt)
        assert list(vllm_hash.block_keys(algorithm, seed, tokens, size, lora, salt)) == expected
        packed = struct.pack(f"<{len(tokens)}i", *tokens)
        assert list(vllm_hash.block_keys(algorithm, seed, packed, size, lora, salt)) == expected


def test_a_pickled_block_past_one_frame_takes_the_general_serializer() -> None:
    """C writes a pickle of one frame (64 KiB); a larger block, ~13,000 tokens or more, is
    framed in parts by pickle, and its keys come from the general serializer, the same."""
    rng = random.Random(3)
    size = 14_000
    tokens = random_tokens(rng, 2 * size + 5)
    expected = reference_vllm_keys("sha256", "0", tokens, size, "a", "s")
    assert list(vllm_hash.block_keys("sha256", "0", tokens, size, "a", "s")) == expected
    assert len(expected) == 2


@pytest.mark.parametrize("bigram", [False, True], ids=["pages", "bigrams"])
def test_sglang_chains_are_the_reference_pages(bigram: bool) -> None:
    rng = random.Random(int(bigram))
    for _ in range(300):
        size = rng.choice([1, 2, 3, 16])
        tokens = random_tokens(rng, rng.randrange(0, 5 * size + 3), signed=False)
        salt = rng.choice(SALTS)
        digests = sglang_hash.page_digests(tokens, size, salt, bigram)
        expected = [sglang_hash.first64_be(digest) for digest in digests]
        assert list(sglang_hash.block_keys(tokens, size, salt, bigram)) == expected


def test_a_chain_is_a_lazy_iterator() -> None:
    """The index's walk stops at the first block no owner holds; the chain hashes one block
    a step, and stops after the last complete one."""
    tokens = struct.pack("<9i", *range(9))
    chain = vllm_hash.block_keys("sha256_cbor", "0", tokens, 4)
    assert iter(chain) is chain
    first = next(chain)
    assert [first, *chain] == reference_vllm_keys("sha256_cbor", "0", list(range(9)), 4, "", "")
    assert next(chain, None) is None


@pytest.mark.parametrize(
    "args",
    [
        (4, b"", 4, bytes(32), b"", b""),  # no such kind
        (0, b"", 0, bytes(32), b"", b""),  # no block size
        (0, b"", 4, bytes(31), b"", b""),  # a root is a whole digest
        (0, b"", 4, b"", b"", b""),  # only an unsalted SGLang chain has none
    ],
)
def test_a_chain_refuses_what_it_cannot_hash(args: tuple) -> None:
    with pytest.raises(ValueError):
        _native.ProfileChain(*args)


def test_random_bytes_digest_alike_through_the_chain_and_hashlib() -> None:
    """An SGLang chain's first page is SHA-256 of the page's bytes as they are."""
    data = os.urandom(64)
    (key,) = _native.ProfileChain(2, data, 16, b"", b"", b"")
    assert key == int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
