"""The Go-compatible conductor prefix hash.

Every chain the index stores and every query it answers goes through these functions, so
they must reproduce the Go service's XXH64 chains bit for bit.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.hashing import chain_hashes, prefix_hashes, salt_root, token_bytes

VECTORS_PATH = Path(__file__).resolve().parents[1] / "fixtures" / "conductor_hash_vectors.json"
VECTORS: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
QUERIES: list[dict[str, Any]] = VECTORS["queries"]

XXH64_EMPTY = 17241709254077376921


def go_compute_hash(parent: int, tokens: list[int]) -> int:
    """Independent re-statement of Go's ``computeHash`` (u64le parent, u32le(uint32(int32)))."""
    data = struct.pack("<Q", parent) + b"".join(struct.pack("<I", t & 0xFFFFFFFF) for t in tokens)
    return xxhash.xxh64_intdigest(data)


@pytest.mark.parametrize("vector", QUERIES, ids=[q["name"] for q in QUERIES])
def test_query_vectors(vector: dict[str, Any]) -> None:
    """The Go-verified vectors: root from the cache salt, one hash per complete block."""
    assert salt_root(vector["cache_salt"]) == vector["root"]
    got = prefix_hashes(vector["token_ids"], vector["block_size"], vector["cache_salt"])
    assert got == vector["expected"]
    assert [f"{h:016x}" for h in got] == vector["expected_hex"]


def test_query_vectors_are_all_covered() -> None:
    """Guard against a fixture edit silently dropping the vectors this module relies on."""
    assert len(QUERIES) >= 5


def test_xxh64_empty_constant() -> None:
    """The seed of every unsalted chain, as the fixture records it."""
    assert salt_root("") == XXH64_EMPTY == 0xEF46DB3751D8E999
    assert VECTORS["algorithm"]["xxh64_empty_string"] == XXH64_EMPTY


def test_prefix_hashes_default_salt_is_empty() -> None:
    """Omitting the salt is the same as the empty salt (Go's default cache_salt)."""
    tokens = list(range(1, 9))
    assert prefix_hashes(tokens, 4) == prefix_hashes(tokens, 4, "")


def test_salt_root_is_utf8() -> None:
    """Salts are hashed as UTF-8 bytes, including non-ASCII ones."""
    salt = "盐-🚀"
    assert salt_root(salt) == xxhash.xxh64_intdigest(salt.encode("utf-8"))


def test_chain_matches_independent_go_model() -> None:
    """chain_hashes == Go's computeHash chained block by block."""
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    parent = salt_root("x")
    expected = []
    for start in range(0, 8, 4):
        parent = go_compute_hash(parent, tokens[start : start + 4])
        expected.append(parent)
    assert chain_hashes(salt_root("x"), tokens, 4) == expected


@pytest.mark.parametrize("token", [0, 1, -1, 2**31 - 1, -(2**31), 151643, 65535, 65536])
def test_int32_edge_tokens(token: int) -> None:
    """Every int32 value is hashed as its 32-bit two's-complement pattern."""
    assert token_bytes([token]) == struct.pack("<i", token)
    assert chain_hashes(7, [token], 1) == [go_compute_hash(7, [token])]


@pytest.mark.parametrize(
    ("outside", "wrapped"),
    [
        (2**31, -(2**31)),
        (2**32 - 1, -1),
        (2**32, 0),
        (2**32 + 5, 5),
        (-(2**31) - 1, 2**31 - 1),
        (2**40 + 3, 3),
        (-(2**63), 0),
    ],
)
def test_tokens_outside_int32_wrap_like_go(outside: int, wrapped: int) -> None:
    """Go casts to int32: values outside the range wrap instead of raising."""
    assert token_bytes([outside]) == token_bytes([wrapped])
    tokens = [1, outside, 3, 4]
    assert prefix_hashes(tokens, 4) == prefix_hashes([1, wrapped, 3, 4], 4)
    assert prefix_hashes(tokens, 4) == [go_compute_hash(XXH64_EMPTY, tokens)]


def test_partial_tail_ignored() -> None:
    """Only complete blocks are hashed; the tail neither adds a hash nor changes one."""
    tokens = list(range(100, 140))
    full = prefix_hashes(tokens[:32], 16)
    assert prefix_hashes(tokens, 16) == full
    assert len(full) == 2
    assert prefix_hashes(tokens[:15], 16) == []
    assert prefix_hashes([], 4) == []


def test_prefix_property() -> None:
    """A longer prompt's hashes extend a shorter prompt's: that is what makes it a prefix."""
    tokens = list(range(50))
    short = prefix_hashes(tokens[:20], 4)
    assert prefix_hashes(tokens, 4)[: len(short)] == short


def test_salt_changes_every_block() -> None:
    """A different salt gives a disjoint chain (cache_salt isolation)."""
    tokens = list(range(16))
    assert set(prefix_hashes(tokens, 4, "a")).isdisjoint(prefix_hashes(tokens, 4, "b"))


@pytest.mark.parametrize("block_size", [0, -1, -16])
def test_non_positive_block_size_gives_nothing(block_size: int) -> None:
    """Go returns nil for block_size <= 0; we return [] instead of dividing by zero."""
    assert prefix_hashes([1, 2, 3, 4], block_size) == []
    assert chain_hashes(XXH64_EMPTY, [1, 2, 3, 4], block_size) == []


def test_store_scenario_first_steps_match_go() -> None:
    """Steps of the Go store scenario that have no Go bug in them chain identically."""
    steps = VECTORS["store_scenario"]["steps"]
    first, second = steps[0], steps[1]
    assert chain_hashes(XXH64_EMPTY, first["token_ids"], 4) == first["conductor_hashes"]
    parent = first["conductor_hashes"][-1]
    assert chain_hashes(parent, second["token_ids"], 4) == second["conductor_hashes"]


# -- the chain in C (conductor/native/hashing.c) against an independent model -------------

INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)


@settings(max_examples=300, deadline=None)
@given(
    parent=st.integers(min_value=0, max_value=2**64 - 1),
    block_size=st.integers(min_value=1, max_value=40),  # 12..168 bytes: every XXH64 branch
    tokens=st.lists(st.one_of(st.integers(0, 200_000), INT64), max_size=200),
)
def test_chain_matches_the_model_for_any_length_and_value(
    parent: int, block_size: int, tokens: list[int]
) -> None:
    """Every block size (each input length reaches other XXH64 stripes and tails) and any
    integer, wrapped to int32, chain as the independent model does; the int32 bytes of the
    same tokens chain the same."""
    expected, chain = [], parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        chain = go_compute_hash(chain, tokens[start : start + block_size])
        expected.append(chain)
    assert chain_hashes(parent, tokens, block_size) == expected
    assert chain_hashes(parent, tuple(tokens), block_size) == expected
    assert chain_hashes(parent, token_bytes(tokens), block_size) == expected


def test_long_blocks_hash_like_short_ones() -> None:
    """A block larger than the C buffer kept on the stack (64 tokens) is hashed whole."""
    tokens = list(range(1000, 1000 + 3 * 300))
    expected = [go_compute_hash(7, tokens[:300])]
    expected.append(go_compute_hash(expected[0], tokens[300:600]))
    expected.append(go_compute_hash(expected[1], tokens[600:]))
    assert chain_hashes(7, tokens, 300) == expected


class _Index:
    """An int-like object that is not an int (as numpy's integers are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_integer_like_tokens_count_as_their_value() -> None:
    assert chain_hashes(7, [_Index(5), _Index(2**32 + 6)], 2) == chain_hashes(7, [5, 6], 2)


@pytest.mark.parametrize("bad", [[1, 2.0], [1, "2"], [1, None], [1, b"2"]])
def test_a_token_that_is_no_integer_is_a_type_error(bad: list[Any]) -> None:
    with pytest.raises(TypeError, match="token ids must be integers"):
        chain_hashes(7, bad, 2)


@pytest.mark.parametrize("bad", [5, None, object()])
def test_tokens_that_are_no_sequence_are_a_type_error(bad: Any) -> None:
    with pytest.raises(TypeError):
        chain_hashes(7, bad, 2)
