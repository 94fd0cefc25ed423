"""A query body's shape, read without decoding it: what the limits count before the decoder
builds an object per value (conductor/body_shape.py)."""

from __future__ import annotations

import json
from array import array
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.body_shape import (
    BodyShape,
    Malformed,
    NotAnObject,
    json_shape,
    msgpack_fields,
    msgpack_shape,
)

NAMES = ("token_ids",)
OTHER_FIELDS = st.dictionaries(
    st.sampled_from(["model", "block_size", "tenant_id", "lora_name", "x"]),
    st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1), st.none()),
)
TOKENS = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300)


@settings(max_examples=200, deadline=None)
@given(OTHER_FIELDS, TOKENS, st.booleans(), st.sampled_from(["", " ", "\n "]))
def test_an_array_of_numbers_is_counted_exactly_in_either_encoding(
    fields: dict[str, Any], tokens: list[int], packed: bool, space: str
) -> None:
    body = {**fields, "token_ids": tokens}
    value = array("i", tokens).tobytes() if packed else tokens
    encoded = msgpack.packb({**fields, "token_ids": value})
    shape = msgpack_shape(msgpack_fields(encoded), NAMES, 4)
    assert shape == BodyShape(len(tokens), True, len(msgpack.packb(value)))
    text = json.dumps(body, separators=("," + space, ":" + space)).encode()
    assert json_shape(text, NAMES) == BodyShape(
        len(tokens), True, len(json.dumps(tokens, separators=("," + space, ":")))
    )


def test_an_escaped_key_is_the_field_it_spells() -> None:
    body = b'{"model": "m", "token\\u005fids": [1, 2, 3]}'
    assert json_shape(body, NAMES) == BodyShape(3, True, 9)


def test_anything_but_numbers_is_no_plain_array() -> None:
    for value in ("[[], []]", '["1", 2]', "[{}, 1]", '"1,2"', "7"):
        shape = json_shape(f'{{"token_ids": {value}}}'.encode(), NAMES)
        assert shape is not None and not shape.plain, value
    fields = msgpack_fields(msgpack.packb({"token_ids": "1,2"}))
    assert msgpack_shape(fields, NAMES, 4) == BodyShape(None, False, 4)


def test_a_field_given_under_two_aliases_counts_by_its_largest_value() -> None:
    names = ("seq_hashes", "block_hash")
    body = {"seq_hashes": [1], "block_hash": [1, 2, 3]}
    assert json_shape(json.dumps(body).encode(), names).items == 3
    assert msgpack_shape(msgpack_fields(msgpack.packb(body)), names, 8).items == 3
    assert msgpack_shape(msgpack_fields(msgpack.packb({"a": 1})), NAMES, 4) == BodyShape()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (msgpack.packb([1, 2]), NotAnObject),
        (b"\xc1", Malformed),
        (b"", Malformed),
        (msgpack.packb({"token_ids": [1, 2]})[:-1], Malformed),  # cut short
        (msgpack.packb({"token_ids": [1]}) + b"\x01", Malformed),  # trailing bytes
    ],
)
def test_msgpack_that_is_no_map_is_told_apart_from_broken_msgpack(body: bytes, error) -> None:
    with pytest.raises(error):
        msgpack_fields(body)


def test_json_that_is_no_object_or_no_json() -> None:
    with pytest.raises(NotAnObject):
        json_shape(b"[1, 2]", NAMES)
    assert json_shape(b'{"token_ids": [1,', NAMES) is None  # pydantic says where it breaks
