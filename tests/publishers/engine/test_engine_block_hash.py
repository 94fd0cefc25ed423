"""vLLM 0.33 block hashing against the golden vectors vLLM's own code produced.

A simulated engine is only a faithful stand-in if a consumer cannot tell its hashes from a
real engine's, so every vector is checked: roots, digests, event hashes and extra keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from publishers.engine.block_hash import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    LoraAdapter,
    event_extra_keys,
    event_hash,
    hash_function,
    none_hash_seed,
)

VECTORS_PATH = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_hash_vectors.json"
PROFILES: list[dict[str, Any]] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))["profiles"]
CASES = [(profile, case) for profile in PROFILES for case in profile["cases"]]


def profile_id(profile: dict[str, Any]) -> str:
    return f"{profile['algorithm']}-seed={profile['PYTHONHASHSEED']}"


def lora_of(case: dict[str, Any]) -> LoraAdapter | None:
    request = case["lora_request"]
    if request is None:
        return None
    return LoraAdapter(request["lora_name"], request["lora_int_id"], request["lora_path"])


def as_lists(value: object) -> object:
    """JSON's view of nested tuples, to compare with the vectors."""
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("profile", PROFILES, ids=profile_id)
def test_none_hash(profile: dict[str, Any]) -> None:
    seed = none_hash_seed(profile["algorithm"], profile["PYTHONHASHSEED"])
    assert seed == profile["none_hash_seed_string"]
    hasher = BlockHasher(profile["algorithm"], profile["PYTHONHASHSEED"])
    assert hasher.none_hash.hex() == profile["none_hash"]


@pytest.mark.parametrize(
    ("profile", "case"), CASES, ids=[f"{profile_id(p)}-{c['name']}" for p, c in CASES]
)
def test_vector(profile: dict[str, Any], case: dict[str, Any]) -> None:
    """Digests, their event form and the published (untagged) extra keys."""
    hasher = BlockHasher(profile["algorithm"], profile["PYTHONHASHSEED"])
    lora, salt = lora_of(case), case["cache_salt"]
    digests = hasher.block_digests(
        case["token_ids"], case["block_size"], lora=lora, cache_salt=salt
    )
    assert [digest.hex() for digest in digests] == case["block_digests_hex"]
    assert [event_hash(digest) for digest in digests] == case["event_block_hashes"]
    extra_keys = [event_extra_keys(index, lora, salt) for index in range(len(digests))]
    assert as_lists(extra_keys) == case["event_extra_keys"]


def test_wire_example() -> None:
    """A worked example: sha256, PYTHONHASHSEED=0, bs 4, tokens 1..8."""
    digests = BlockHasher("sha256", "0").block_digests(list(range(1, 9)), 4)
    assert [event_hash(d) for d in digests] == [10362225831949560093, 12472515041799373675]


def test_event_hash_is_low_64_bits_big_endian() -> None:
    digest = bytes(range(32))
    assert event_hash(digest) == int.from_bytes(digest[-8:], "big")


def test_only_complete_blocks_are_hashed() -> None:
    hasher = BlockHasher()
    assert hasher.block_digests([1, 2, 3], 4) == []
    assert len(hasher.block_digests(list(range(11)), 4)) == 2


def test_seed_rules() -> None:
    """PYTHONHASHSEED verbatim when set; unset: fixed for sha256, random for xxhash."""
    assert none_hash_seed("sha256", None) == DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert none_hash_seed("xxhash", "42") == "42"
    first, second = none_hash_seed("xxhash", None), none_hash_seed("xxhash", None)
    assert first != second and len(first) == 64
    assert BlockHasher("xxhash").none_hash != BlockHasher("xxhash").none_hash


def test_salt_and_lora_change_the_chain() -> None:
    """Tenants with different salts or adapters never share blocks; the salt only keys
    block 0, yet every later block differs through the chain."""
    hasher = BlockHasher("sha256", "0")
    tokens = list(range(8))
    plain = hasher.block_digests(tokens, 4)
    salted = hasher.block_digests(tokens, 4, cache_salt="tenant")
    other_path = hasher.block_digests(tokens, 4, lora=LoraAdapter("a", 1, "/other"))
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert other_path != hasher.block_digests(tokens, 4, lora=LoraAdapter("a", 1, "/loras/a"))
    assert hasher.block_digests(tokens, 4, cache_salt="") == plain


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        hash_function("md5")
