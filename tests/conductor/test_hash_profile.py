"""A registration's ``hash_profile``: which values pass, which fail, and the root digest it
implies, as upstream Mooncake's C++ conductor has them (``mooncake-conductor/src/
prefixindex/hash_strategy.cpp`` and its tests, branch ``dev/conductor``, 19ffa6e4a)."""

from __future__ import annotations

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
