"""A registration's ``hash_profile``: which values pass, which fail, and the root digest it
implies, as upstream Mooncake's C++ conductor has them (``mooncake-conductor/src/
prefixindex/hash_strategy.cpp`` and its tests, branch ``dev/conductor``, 19ffa6e4a)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import cbor2
import pytest
from pydantic import ValidationError

from conductor.hash_profile import HashProfile, root_digest
from conductor.vllm_hash import cbor_text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256_cbor",
    "python_hash_seed": "0",
    "index_projection": "low64_be",
}


def test_the_reference_roots_of_seed_zero():
    """Upstream pins both roots of seed "0": the CBOR text string ``61 30`` hashed, and the
    pickled string (its test constant for ``sha256``)."""
    assert root_digest("sha256_cbor", "0") == (
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    )
    assert root_digest("sha256", "0") == (
        "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"
    )


def test_roots_are_vllms_none_hash():
    """The root is vLLM's NONE_HASH of the seed text: the vectors computed by vLLM 0.33.0's
    own code agree for every sha256 profile they hold."""
    vectors = json.loads((FIXTURES / "vllm_hash_vectors.json").read_text())
    checked = 0
    for profile in vectors["profiles"]:
        if profile["algorithm"] in ("sha256", "sha256_cbor"):
            seed = profile["none_hash_seed_string"]
            assert root_digest(profile["algorithm"], seed) == profile["none_hash"], profile
            checked += 1
    assert checked == 4


@pytest.mark.parametrize("text", ["", "0", "random", "x" * 23, "x" * 24, "y" * 300, "é" * 40000])
def test_cbor_text_is_canonical_cbor(text):
    assert cbor_text(text) == cbor2.dumps(text, canonical=True)


@pytest.mark.parametrize("seed", ["0", "00", "007", "random", "4294967295"])
def test_accepted_seeds_keep_their_text(seed):
    """Leading zeros are kept: vLLM hashes the text, so "0" and "00" are other roots."""
    profile = HashProfile.model_validate({**PROFILE, "python_hash_seed": seed})
    assert profile.python_hash_seed == seed
    assert profile.wire_view()["root_digest"] == root_digest("sha256_cbor", seed)


def test_both_algorithms_are_accepted():
    """Upstream's doc names sha256_cbor only; its code and tests accept sha256 too."""
    for algorithm in ("sha256", "sha256_cbor"):
        HashProfile.model_validate({**PROFILE, "algorithm": algorithm})


@pytest.mark.parametrize(
    ("change", "error_type", "where"),
    [
        ({"python_hash_seed": "-1"}, "value_error", "python_hash_seed"),
        ({"python_hash_seed": "+1"}, "value_error", "python_hash_seed"),
        ({"python_hash_seed": " 1"}, "value_error", "python_hash_seed"),
        ({"python_hash_seed": "1.0"}, "value_error", "python_hash_seed"),
        ({"python_hash_seed": "٣"}, "value_error", "python_hash_seed"),  # not ASCII
        ({"python_hash_seed": "4294967296"}, "value_error", "python_hash_seed"),
        ({"python_hash_seed": "Random"}, "value_error", "python_hash_seed"),
        ({"python_hash_seed": 0}, "string_type", "python_hash_seed"),
        ({"python_hash_seed": ""}, "string_too_short", "python_hash_seed"),
        ({"algorithm": "SHA256"}, "value_error", "algorithm"),
        ({"algorithm": "xxhash"}, "value_error", "algorithm"),
        ({"strategy": "vllm_v2"}, "value_error", "strategy"),
        ({"index_projection": "low64_le"}, "value_error", "index_projection"),
        ({"root_digest": "00" * 32}, "extra_forbidden", "root_digest"),
    ],
)
def test_refused_profiles(change, error_type, where):
    """The root digest is derived, never accepted: a client sending one is refused."""
    with pytest.raises(ValidationError) as caught:
        HashProfile.model_validate({**PROFILE, **change})
    first = caught.value.errors()[0]
    assert (first["type"], first["loc"]) == (error_type, (where,))


@pytest.mark.parametrize("key", sorted(PROFILE))
def test_every_key_is_required(key):
    body = {name: value for name, value in PROFILE.items() if name != key}
    with pytest.raises(ValidationError) as caught:
        HashProfile.model_validate(body)
    assert caught.value.errors()[0]["type"] == "missing"


# -- SGLang's chains (upstream's later revision: hash_strategy.cpp at 1b6bbb02a) ----------------
SGLANG_PROFILE = {
    "strategy": "sglang",
    "algorithm": "sha256_raw",
    "index_projection": "first64_be",
}
# SGLang 0.5.23's own hashes of tokens 1..40 in pages of 16 (its get_hash_str and the native
# bigram hash, through hash_str_to_int64: the signed int64 its events carry), complete pages
SGLANG_KEYS = [8635429971592222890, 1256577331724852459]
SGLANG_BIGRAM_KEYS = [-7316793502406646264, 6063726050728627868]


@pytest.mark.parametrize("seed", [None, "0", "7", "anything"])
def test_an_sglang_profile_needs_no_seed(seed):
    """SGLang reads no PYTHONHASHSEED: upstream resolves any seed text, or none, to "0" and
    an all-zero root, so profiles differing only there are one."""
    body = dict(SGLANG_PROFILE) if seed is None else {**SGLANG_PROFILE, "python_hash_seed": seed}
    profile = HashProfile.model_validate(body)
    assert profile.wire_view() == {
        **SGLANG_PROFILE,
        "python_hash_seed": "0",
        "root_digest": "0" * 64,
    }
    assert profile == HashProfile.model_validate(SGLANG_PROFILE)


@pytest.mark.parametrize(
    ("change", "error_type", "where"),
    [
        ({"algorithm": "sha256_cbor"}, "value_error", "algorithm"),
        ({"index_projection": "low64_be"}, "value_error", "index_projection"),
        ({"python_hash_seed": 0}, "string_type", "python_hash_seed"),
        ({"strategy": "vllm_v1", "python_hash_seed": "0"}, "value_error", "algorithm"),
    ],
)
def test_refused_sglang_profiles(change, error_type, where):
    """Each family has its own selectors: SGLang's chain is ``sha256_raw`` / ``first64_be``
    only, vLLM's never; a seed, when given, is still text."""
    with pytest.raises(ValidationError) as caught:
        HashProfile.model_validate({**SGLANG_PROFILE, **change})
    first = caught.value.errors()[0]
    assert (first["type"], first["loc"]) == (error_type, (where,))


@pytest.mark.parametrize(
    ("strategy", "keys"), [("sglang", SGLANG_KEYS), ("sglang_bigram", SGLANG_BIGRAM_KEYS)]
)
def test_sglang_keys_are_sglangs_own(strategy, keys):
    """The query keys are the 64 bits SGLang's events carry (signed there, unsigned in the
    index), for its plain and its bigram chain; the incomplete third page has none, and
    tokens packed as int32 little-endian hash alike."""
    profile = HashProfile.model_validate({**SGLANG_PROFILE, "strategy": strategy})
    tokens = list(range(1, 41))
    expected = [key & (2**64 - 1) for key in keys]
    assert list(profile.block_keys(tokens, 16)) == expected
    packed = b"".join(token.to_bytes(4, "little") for token in tokens)
    assert list(profile.block_keys(packed, 16)) == expected


def test_an_sglang_salt_roots_the_chain():
    """Upstream's ``SglangHashChain``: a salt's chain starts from ``SHA-256("sglang-cache-
    salt-v1\\0" + salt)``; an empty salt is no salt."""
    profile = HashProfile.model_validate(SGLANG_PROFILE)
    tokens = list(range(1, 17))
    page = b"".join(token.to_bytes(4, "little") for token in tokens)
    root = hashlib.sha256(b"sglang-cache-salt-v1\x00tenant-a").digest()
    salted = int.from_bytes(hashlib.sha256(root + page).digest()[:8], "big")
    assert list(profile.block_keys(tokens, 16, cache_salt="tenant-a")) == [salted]
    assert list(profile.block_keys(tokens, 16, cache_salt="")) == [SGLANG_KEYS[0]]
