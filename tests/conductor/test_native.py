"""The C module itself: built from its current source, and refusing what it cannot take.

What its functions compute is pinned where they are used: the chain in test_hashing.py, the
index's loops by every index test and the randomized model check in test_index.py.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conductor import _native
from conductor.config import QueryRequest
from conductor.hashing import chain_hashes, token_bytes
from conductor.wire.events import MASK64


def test_the_module_is_built_from_the_current_source() -> None:
    """An edited file of conductor/native/ needs ``pip install -e .`` again to take effect."""
    sources = sorted(Path(_native.__file__).with_name("native").glob("*.[ch]"))
    if not sources:
        pytest.skip("an installed wheel: no source beside the module")
    built = Path(_native.__file__).stat().st_mtime
    changed = [source.name for source in sources if source.stat().st_mtime > built]
    assert not changed, f"{changed} changed after the module was built: pip install -e ."


def test_the_blocks_take_only_holdings_of_their_own_context() -> None:
    state, other = _native.ContextBlocks(16), _native.ContextBlocks(16)
    theirs = other.owner(1)
    with pytest.raises(TypeError, match="holdings must be a Holdings of this ContextBlocks"):
        state.hold(theirs[0], [1], [2])
    with pytest.raises(TypeError, match="holdings must be a Holdings of this ContextBlocks"):
        state.release({}, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="owner must be a tuple this ContextBlocks made"):
        state.apply_packed(_packed(), theirs, 0, 1, 0)
    with pytest.raises(TypeError, match=r"hold takes 3 arguments \(1 given\)"):
        state.hold(state.owner(1)[0])  # type: ignore[call-arg]
    for bit in (0, -2, 1.0, 3, (1 << 70) | 1):
        with pytest.raises(ValueError, match="bit must be a power of two"):
            state.owner(bit)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.Holdings()  # type: ignore[call-arg]


def _packed() -> _native.PackedBatch:
    packed = _native.pack_batch(msgpack.packb([0.0, []]), 16)
    assert packed is not None
    return packed


def test_hold_stops_at_the_shorter_sequence_and_release_skips_what_is_not_held() -> None:
    state = _native.ContextBlocks(16)
    mine = state.owner(2)[0]
    assert state.hold(mine, [10, 11], [7]) == 1
    assert dict(mine.by_engine_hash.items()) == dict(state.engine_prefix.items()) == {10: 7}
    assert dict(state.blocks[0].items()) == {7: 2}
    assert state.release(mine, [99, 10, 10]) == 1
    assert len(mine.by_engine_hash) == len(state.engine_prefix) == len(state.blocks[0]) == 0


def test_release_takes_copies_and_extra_references_first() -> None:
    """A block held twice loses a copy first; a prefix the owner holds under two engine
    hashes keeps its bit until the last of them goes."""
    state = _native.ContextBlocks(16)
    mine = state.owner(4)[0]
    assert state.hold(mine, [10, 10, 11], [70, 70, 70]) == 3
    assert mine.copies == {10: 1} and mine.extra_refs == {70: 1} and state.blocks[0] == {70: 4}
    assert (mine.count(), mine.prefix_count()) == (3, 1)
    assert state.release(mine, [10]) == 1  # the copy
    assert mine.copies == {} and mine.by_engine_hash == {10: 70, 11: 70}
    assert state.release(mine, [11]) == 1  # the extra reference
    assert mine.extra_refs == {} and state.blocks[0] == {70: 4} and state.engine_prefix == {10: 70}
    assert state.release(mine, [10, 10]) == 1  # the last one: the bit goes
    assert len(mine.by_engine_hash) == len(state.engine_prefix) == len(state.blocks[0]) == 0


def test_evict_forgets_every_copy_at_once() -> None:
    state = _native.ContextBlocks(16)
    mine = state.owner(1)[1]
    assert state.hold(mine, [10, 10, 10, 11], [70, 70, 70, 71]) == 4
    assert state.evict(mine, [10, 12]) == 1
    assert mine.by_engine_hash == {11: 71} and mine.copies == {} and state.blocks[1] == {71: 1}


def test_a_hash_that_is_no_uint64_raises_and_leaves_earlier_blocks_recorded() -> None:
    state = _native.ContextBlocks(16)
    mine = state.owner(1)[0]
    with pytest.raises(TypeError, match="keys are unsigned 64-bit ints"):
        state.hold(mine, [5, -6], [50, 60])
    assert dict(mine.by_engine_hash.items()) == {5: 50} and dict(state.blocks[0].items()) == {50: 1}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=-(2**80), max_value=2**80)))
def test_u64_hashes_is_every_int_masked_to_64_bits(values: list[int]) -> None:
    assert _native.u64_hashes(values) == [value & MASK64 for value in values]


def test_u64_hashes_keeps_the_ints_in_range_and_refuses_other_types() -> None:
    kept = [0, 2**63 - 1, 2**63, MASK64]
    assert all(a is b for a, b in zip(_native.u64_hashes(kept) or [], kept, strict=True))
    for other in ([1, True], [b"\x01"], [1, 2.0], [None]):
        assert _native.u64_hashes(other) is None
    with pytest.raises(TypeError, match="takes a list"):
        _native.u64_hashes((1, 2))  # type: ignore[arg-type]


# -- HashMap and MaskMap behave as dicts do ---------------------------------------------------

KEYS = st.one_of(
    st.integers(0, 40),  # few keys: collisions, long probe runs, backward shifts on delete
    st.sampled_from([0, 2**63, MASK64, MASK64 - 1]),
    st.integers(0, MASK64),
)
OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["set", "del", "pop", "get", "in", "clear"]),
        KEYS,
        st.integers(-(2**63), MASK64),
    ),
    max_size=400,
)


@pytest.mark.parametrize("kind", [_native.HashMap, _native.MaskMap])
@settings(max_examples=200, deadline=None)
@given(operations=OPERATIONS)
def test_a_map_answers_as_a_dict_after_any_operations(kind: type, operations: list) -> None:
    mapping, reference = kind(), {}
    for operation, key, value in operations:
        value &= MASK64  # a HashMap holds unsigned 64-bit values
        if operation == "set":
            mapping[key] = reference[key] = value
        elif operation == "del":
            if key in reference:
                del mapping[key], reference[key]
            else:
                with pytest.raises(KeyError):
                    del mapping[key]
        elif operation == "pop":
            assert mapping.pop(key, None) == reference.pop(key, None)
        elif operation == "get":
            assert mapping.get(key) == reference.get(key)
            assert mapping.get(key, -1) == reference.get(key, -1)
        elif operation == "in":
            assert (key in mapping) == (key in reference)
        else:
            mapping.clear()
            reference.clear()
        assert len(mapping) == len(reference)
    assert dict(mapping.items()) == reference
    assert sorted(mapping) == sorted(reference) == sorted(mapping.keys())
    assert sorted(mapping.values()) == sorted(reference.values())
    assert bool(mapping) == bool(reference)


@pytest.mark.parametrize("mask", [1 << 62, 1 << 63, (1 << 200) | 5, 2**64 - 1, 0])
def test_a_mask_map_keeps_masks_of_any_width(mask: int) -> None:
    """Bits 0-62 are kept in the entry itself, a mask with a bit from 63 on beside it."""
    masks = _native.MaskMap()
    masks[5] = mask
    assert masks[5] == masks.get(5) == list(masks.values())[0] == mask
    assert masks.pop(5) == mask
    assert repr(masks) == "conductor._native.MaskMap({})"
    with pytest.raises(OverflowError):
        masks[5] = -1


@pytest.mark.parametrize("kind", [_native.HashMap, _native.MaskMap])
def test_a_key_that_is_no_uint64_is_never_present_and_cannot_be_stored(kind: type) -> None:
    mapping = kind()
    for absent in (-1, 2**64, "5", 5.0, None):
        assert absent not in mapping and mapping.get(absent, "no") == "no"
        assert mapping.pop(absent, "no") == "no"
        with pytest.raises(KeyError):
            mapping[absent]
        with pytest.raises((TypeError, OverflowError)):
            mapping[absent] = 1
    with pytest.raises(TypeError, match="values are ints"):
        mapping[1] = "one"
    if kind is _native.HashMap:
        with pytest.raises(OverflowError):
            mapping[1] = -1
    assert len(mapping) == 0


def test_iterating_a_map_that_changes_size_is_an_error() -> None:
    mapping = _native.HashMap()
    mapping[1], mapping[2] = 10, 20
    keys = iter(mapping)
    next(keys)
    mapping[3] = 30
    with pytest.raises(RuntimeError, match="changed size during iteration"):
        next(keys)
    values = mapping.values()
    mapping[3] = 31  # a value replaced: the same keys, the iteration goes on
    assert sorted(values) == [10, 20, 31]


@pytest.mark.parametrize("kind", [_native.HashMap, _native.MaskMap])
def test_a_map_split_into_shards_answers_as_a_dict(kind: type) -> None:
    """Past 65,536 keys a map deals its keys to 256 tables that grow one at a time; keys
    sharing their low bits, the key 0, deletions, iteration, clearing and growing again
    must all answer as a dict does."""
    mapping, expected = kind(), {}
    for key in [0, *range(1, 300_000, 2)]:
        mapping[key << 40] = expected[key << 40] = key + 1
    assert len(mapping) == len(expected) == 150_001
    assert mapping == expected and all(mapping[key] == value for key, value in expected.items())
    for key in range(0, 300_000, 3):
        mapping.pop(key << 40, None)
        expected.pop(key << 40, None)
    assert mapping == expected and (1 << 40) in mapping and (3 << 40) not in mapping
    assert sorted(mapping.values()) == sorted(expected.values())
    mapping.clear()
    assert len(mapping) == 0 and list(mapping.items()) == []
    for key in range(70_000):
        mapping[key] = key + 1
    assert len(mapping) == 70_000 and mapping.get(69_999) == 70_000


def test_masks_widen_and_narrow_as_owners_past_bit_62_come_and_go() -> None:
    """Owners 0-62 share a mask kept in the entry; one from 63 on makes it wide, and its
    going makes it inline again: the masks read back the same either way."""
    state = _native.ContextBlocks(16)
    bits = [0, 62, 63, 64, 130]
    owners = {bit: state.owner(1 << bit)[0] for bit in bits}
    for bit, owner in owners.items():
        state.hold(owner, [1000 + bit, 2000 + bit], [7, 8 + bit])
    assert state.blocks[0][7] == sum(1 << bit for bit in bits)
    assert state.walk([7], 1 << 130 | 1 << 63 | 1) == [([0, 63, 130], (1, 1, 1, 1))]
    state.release(owners[130], [1130])
    state.evict(owners[64], [1064])
    assert state.blocks[0][7] == 1 << 63 | 1 << 62 | 1
    state.clear(owners[63])
    assert state.blocks[0][7] == 1 << 62 | 1
    assert state.walk([7, 8], 1 << 62 | 1) == [([62], (1, 1, 1, 1)), ([0], (2, 2, 2, 2))]
    for bit in (0, 62):
        state.clear(owners[bit])
    assert dict(state.blocks[0].items()) == {8 + 64: 1 << 64, 8 + 130: 1 << 130}


def test_clear_empties_a_split_map() -> None:
    state = _native.ContextBlocks(16)
    mine = state.owner(1)[0]
    hashes = list(range(1, 100_001))
    assert state.hold(mine, hashes, [h + 7 for h in hashes]) == 100_000
    assert state.clear(mine) == 100_000
    assert len(mine.by_engine_hash) == len(state.engine_prefix) == len(state.blocks[0]) == 0


# -- token ids read in place from msgpack -------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**63), MASK64), max_size=700))
def test_int32_tokens_reads_any_msgpack_int_array_as_go_casts_it(tokens: list[int]) -> None:
    """Every msgpack int width, either sign, any array header (fix, 16, 32 bits)."""
    assert _native.int32_tokens(msgpack.packb(tokens)) == token_bytes(tokens)


def test_int32_tokens_takes_a_long_array_and_nil() -> None:
    many = [7] * 70_000  # more than 65,535 items: a 32-bit array header
    assert _native.int32_tokens(msgpack.packb(many)) == token_bytes(many)
    assert _native.int32_tokens(msgpack.packb(None)) == b""


@pytest.mark.parametrize(
    "raw",
    [
        msgpack.packb([1, 2.0]),
        msgpack.packb([1, "2"]),
        msgpack.packb([1, True]),
        msgpack.packb([1, None]),
        msgpack.packb([[1]]),
        msgpack.packb({"a": 1}),
        msgpack.packb(5),
        msgpack.packb([1, 2, 3])[:-1],  # truncated
        msgpack.packb([1, 2]) + b"\x01",  # trailing bytes
        b"\xdd\xff\xff\xff\xff",  # a count far past the bytes given
        b"",
    ],
)
def test_int32_tokens_refuses_anything_else(raw: bytes) -> None:
    assert _native.int32_tokens(raw) is None


def test_chain_hashes_reads_an_int32_array_in_place() -> None:
    tokens = list(range(100, 164))
    assert chain_hashes(7, array("i", tokens), 16) == chain_hashes(7, tokens, 16)
    assert chain_hashes(7, array("q", tokens), 16) == chain_hashes(7, tokens, 16)  # one by one


def test_clear_forgets_every_block_of_an_owner_and_keeps_the_others() -> None:
    """Two engine hashes of one owner on one prefix (an extra reference), a copy, and a
    prefix another owner holds too: that one keeps the other owner's bit."""
    state = _native.ContextBlocks(16)
    mine, other = state.owner(1)[0], state.owner(2)[0]
    assert state.hold(mine, [10, 11, 12, 12], [70, 70, 71, 71]) == 4
    assert state.hold(other, [12, 0], [71, 72]) == 2
    assert state.engine_refs == {12: 1} and state.blocks[0] == {70: 1, 71: 3, 72: 2}
    assert state.clear(mine) == 4
    assert len(mine.by_engine_hash) == len(mine.copies) == len(mine.extra_refs) == 0
    assert state.engine_refs == {} and state.engine_prefix == {12: 71, 0: 72}
    assert state.blocks[0] == {71: 2, 72: 2}
    assert state.clear(other) == 2
    assert len(state.engine_prefix) == len(state.blocks[0]) == 0


# -- a JSON prompt's token ids read in place ---------------------------------------------------
JSON_TOKEN = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["1", None, True, [1], {"a": 1}]),
)
JSON_VALUE = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.floats())


@st.composite
def query_bodies(draw: st.DrawFn) -> bytes:
    """/query bodies, mostly valid, spelt with any spacing; the token array sometimes odd."""
    fields: dict[str, Any] = {"model": draw(st.sampled_from(["m", "m", 'q"uote\\', "", 5]))}
    fields["block_size"] = draw(st.sampled_from([16, 16, 16, 0, "16", 1.5]))
    tokens = st.integers(-(2**31), 2**31 - 1)
    fields["token_ids"] = draw(st.lists(st.one_of(tokens, tokens, JSON_TOKEN), max_size=6))
    for name in draw(st.lists(st.sampled_from(["instance_id", "cache_salt", "tenant_id", "x"]))):
        fields[name] = draw(st.one_of(st.text(max_size=5), JSON_VALUE))
    order = draw(st.permutations(list(fields)))
    space = draw(st.sampled_from(["", " ", "\n\t ", "  "]))
    text = (
        "{"
        + space
        + f",{space}".join(
            f"{json.dumps(k)}{space}:{space}{json.dumps(fields[k], separators=(',' + space, ':'))}"
            for k in order
        )
        + space
        + "}"
    )
    if draw(st.integers(0, 9)) == 0:
        text = text.replace('"token_ids"', '"token_ids": [1], "token_ids"', 1)
    if draw(st.integers(0, 9)) == 0:
        text = text[: draw(st.integers(0, len(text)))]
    return text.encode()


def _outcome(parse: Any, body: bytes) -> Any:
    """The request parsed, as a dict; its errors; None when the parser declined it."""
    try:
        parsed = parse(body)
        return None if parsed is None else parsed.model_dump()
    except ValidationError as error:
        return [(e["type"], e["loc"], e["msg"]) for e in error.errors()]


@settings(max_examples=500, deadline=None)
@given(query_bodies())
def test_query_json_reads_tokens_in_place_with_pydantic_s_answer(body: bytes) -> None:
    """The same request, or the same errors, as pydantic parsing the whole body."""
    in_place = _outcome(QueryRequest.from_plain_json, body)
    assert in_place is None or in_place == _outcome(QueryRequest.model_validate_json, body)


def test_json_int32_field_reads_only_a_flat_object_with_one_int32_array() -> None:
    read = _native.json_int32_field
    assert read(b' {"a": "x\\"y", "t" : [1, -2 ,0, 2147483647, -2147483648] } ', "t") == (
        b' {"a": "x\\"y", "t" : [] } ',
        array("i", [1, -2, 0, 2**31 - 1, -(2**31)]).tobytes(),
    )
    assert read(b'{"t": []}', "t") == (b'{"t": []}', b"")
    for declined in (
        b'{"t": [2147483648]}',  # beyond int32
        b'{"t": [1.0]}',
        b'{"t": [1e3]}',
        b'{"t": [01]}',
        b'{"t": [-]}',
        b'{"t": [1,]}',
        b'{"t": [1], "t": [2]}',
        b'{"\\u0074": [1]}',  # an escaped name may be the key
        b'{"n": {"t": [1]}, "t": [1]}',  # nested values are the general parser's
        b'{"t": [1]} x',
        b'{"t": [1]',
        b"[1]",
        b'{"u": [1]}',
    ):
        assert read(declined, "t") is None, declined


def walk_in_python(blocks: dict[int, int], hashes: list[Any], interest: int) -> list[Any]:
    """What ContextBlocks.walk computes, one big-int operation per block."""
    stops, alive = [], interest
    for position, prefix_hash in enumerate(hashes):
        still = alive & blocks.get(prefix_hash, 0)
        if still != alive:
            stops.append((bit_indices(alive ^ still), (position,) * 4))
            alive = still
            if not alive:
                return stops
    return [*stops, (bit_indices(alive), (len(hashes),) * 4)]


def bit_indices(mask: int) -> list[int]:
    return [index for index in range(mask.bit_length()) if mask >> index & 1]


WIDE_MASKS = st.integers(min_value=1, max_value=2**300)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.integers(0, 40), WIDE_MASKS, max_size=40),
    st.lists(st.one_of(st.integers(0, 45), st.integers(-5, -1), st.just(2**64)), max_size=50),
    st.one_of(st.just(0), st.integers(1, 2**64), st.integers(1, 2**200)),
)
def test_walk_stops_each_owner_where_python_s_walk_does(
    blocks: dict[int, int], hashes: list[int], interest: int
) -> None:
    """Masks narrower and wider than the interest, keys absent or no uint64 (held by
    nobody), an empty walk, an empty interest."""
    state = _native.ContextBlocks(16)
    for key, mask in blocks.items():
        state.blocks[0][key] = mask  # masks as no owner's holdings could set them
    assert state.walk(hashes, interest) == walk_in_python(blocks, hashes, interest)


def test_walk_refuses_what_it_cannot_walk() -> None:
    state = _native.ContextBlocks(16)
    with pytest.raises(TypeError, match="interest must be an int"):
        state.walk([1], 1.0)  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        state.walk([1], -1)
    with pytest.raises(TypeError, match="hashes must be a sequence"):
        state.walk(5, 1)  # type: ignore[arg-type]
    assert state.walk((1, 2), 0b101) == [([0, 2], (0, 0, 0, 0))]
