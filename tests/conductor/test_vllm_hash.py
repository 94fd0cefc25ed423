"""The query-side vLLM block-hash chain a profiled context matches with
(``conductor/vllm_hash.py``), against the keys vLLM 0.33.0's own code computed
(``tests/fixtures/vllm_hash_vectors.json``) and against upstream Mooncake's C++ conductor's
chain (``mooncake-conductor/src/prefixindex/hash_strategy.cpp``, branch ``dev/conductor``,
19ffa6e4a: LoRA name on every block, cache salt on block 0, untagged)."""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import cbor2
import pytest

from conductor.hash_profile import HashProfile
from conductor.vllm_hash import block_keys, cbor, none_hash, query_extras

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VECTORS = json.loads((FIXTURES / "vllm_hash_vectors.json").read_text())["profiles"]
SHA256_PROFILES = [p for p in VECTORS if p["algorithm"] in ("sha256", "sha256_cbor")]
CASES = [(profile, case) for profile in SHA256_PROFILES for case in profile["cases"]]
PLAIN = [(p, c) for p, c in CASES if c["lora_request"] is None and c["cache_salt"] is None]
EXTRAS = [(p, c) for p, c in CASES if (p, c) not in PLAIN]


def case_id(pair: tuple[dict[str, Any], dict[str, Any]]) -> str:
    profile, case = pair
    return f"{profile['algorithm']}-seed={profile['PYTHONHASHSEED']}-{case['name']}"


def lora_name(case: dict[str, Any]) -> str:
    return (case["lora_request"] or {}).get("lora_name", "")


def keys_of(profile: dict[str, Any], case: dict[str, Any], tokens: Any = None) -> list[int]:
    chain = block_keys(
        profile["algorithm"],
        profile["none_hash_seed_string"],
        case["token_ids"] if tokens is None else tokens,
        case["block_size"],
        lora_name(case),
        case["cache_salt"] or "",
    )
    return list(chain)


@pytest.mark.parametrize("pair", PLAIN, ids=map(case_id, PLAIN))
def test_keys_are_vllms_event_hashes(pair):
    """Without LoRA or salt the chain is vLLM 0.33's: every key is the hash its events
    carry, whether the tokens come as ints or packed int32 (an incomplete tail is no block)."""
    profile, case = pair
    assert keys_of(profile, case) == case["event_block_hashes"]
    packed = struct.pack(f"<{len(case['token_ids'])}i", *case["token_ids"])
    assert keys_of(profile, case, packed) == case["event_block_hashes"]


@pytest.mark.parametrize("pair", EXTRAS, ids=map(case_id, EXTRAS))
def test_lora_and_salt_follow_upstreams_untagged_extras(pair):
    """With a LoRA or a salt the chain is upstream C++'s: each block digests
    ``(parent, tokens, extras)`` with the extras untagged (checked here with the reference
    encoders, pickle and cbor2). vLLM 0.31+ tags them and hashes the adapter's path, which
    no query carries, so its keys differ: such prompts match nothing in a profiled context,
    as with upstream's service."""
    profile, case = pair
    algorithm, size = profile["algorithm"], case["block_size"]
    serialize = {"sha256": lambda v: pickle.dumps(v, protocol=5), "sha256_cbor": cbor2.dumps}
    parent, expected = none_hash(algorithm, profile["none_hash_seed_string"]), []
    for index in range(len(case["token_ids"]) // size):
        tokens = tuple(case["token_ids"][index * size : (index + 1) * size])
        extras = query_extras(index, lora_name(case), case["cache_salt"] or "")
        parent = hashlib.sha256(serialize[algorithm]((parent, tokens, extras))).digest()
        expected.append(int.from_bytes(parent[-8:], "big"))
    assert keys_of(profile, case) == expected
    assert expected != case["event_block_hashes"]


def test_extras_are_lora_on_every_block_then_salt_on_the_first():
    assert query_extras(0, "", "") is None
    assert query_extras(0, "adapter-A", "tenant-salt") == ("adapter-A", "tenant-salt")
    assert query_extras(1, "adapter-A", "tenant-salt") == ("adapter-A",)
    assert query_extras(0, "", "tenant-salt") == ("tenant-salt",)
    assert query_extras(1, "", "tenant-salt") is None


def test_upstreams_reference_digests():
    """Upstream's notes pin seed "0", sha256_cbor: blocks [1, 2, 3, 4] then [5, 6, 7, 8]
    chain to digests ending ``8ef071cb`` and ``154ab2d6``."""
    keys = list(block_keys("sha256_cbor", "0", [1, 2, 3, 4, 5, 6, 7, 8], 4))
    assert [f"{key:016x}"[-8:] for key in keys] == ["8ef071cb", "154ab2d6"]


def test_the_profile_hashes_with_its_own_algorithm_and_seed():
    profile = HashProfile.model_validate(
        {
            "strategy": "vllm_v1",
            "algorithm": "sha256",
            "python_hash_seed": "0",
            "index_projection": "low64_be",
        }
    )
    tokens = list(range(8))
    assert list(profile.block_keys(tokens, 4)) == list(block_keys("sha256", "0", tokens, 4))
    assert list(profile.block_keys(tokens, 4)) != list(block_keys("sha256", "00", tokens, 4))


def test_hashing_is_lazy():
    """A caller that stops after the first block has hashed one block, not the prompt."""
    chain = block_keys("sha256_cbor", "0", list(range(4 * 10_000)), 4)
    assert isinstance(next(chain), int)


VALUES = [None, 0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, -1, -24, -25, -(2**63)]
VALUES += ["", "é" * 40, "x" * 300, b"", b"\x00" * 32, (1, (2, "a"), None), [1, 2]]


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_cbor_is_canonical_cbor(value):
    assert cbor(value) == cbor2.dumps(value, canonical=True)


def test_cbor_refuses_what_vllm_never_hashes():
    with pytest.raises(TypeError):
        cbor(1.5)
