"""The C module itself: built from its current source, and refusing what it cannot take.

What its functions compute is pinned where they are used: the chain in test_hashing.py, the
index's loops by every index test and the randomized model check in test_index.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor import _native
from conductor.wire.events import MASK64


def test_the_module_is_built_from_the_current_source() -> None:
    """An edited conductor/_native.c needs ``pip install -e .`` again to take effect."""
    source = Path(_native.__file__).with_name("_native.c")
    if not source.exists():
        pytest.skip("an installed wheel: no source beside the module")
    assert Path(_native.__file__).stat().st_mtime >= source.stat().st_mtime, (
        "conductor/_native.c changed after the module was built: pip install -e ."
    )


def test_hold_and_release_many_refuse_what_is_not_a_dict() -> None:
    args: list[Any] = [{}, {}, {}, {}, {}, [], 1, [1], [2]]
    with pytest.raises(TypeError, match="argument 6 must be a dict"):
        _native.hold(*args)
    with pytest.raises(TypeError, match="argument 4 must be a dict"):
        _native.release_many({}, {}, {}, [], 1, [1])
    with pytest.raises(TypeError, match="9 arguments"):
        _native.hold({}, {})  # type: ignore[call-arg]


def test_hold_stops_at_the_shorter_sequence_and_release_skips_what_is_not_held() -> None:
    by_engine, copies, extra, engine_prefix, refs, blocks = {}, {}, {}, {}, {}, {}
    added = _native.hold(by_engine, copies, extra, engine_prefix, refs, blocks, 2, [10, 11], [7])
    assert added == 1
    assert by_engine == engine_prefix == {10: 7} and blocks == {7: 2}
    assert _native.release_many(by_engine, engine_prefix, refs, blocks, 2, [99, 10, 10]) == 1
    assert by_engine == engine_prefix == blocks == {}


def test_an_unhashable_engine_hash_raises_and_leaves_earlier_blocks_recorded() -> None:
    by_engine: dict[Any, Any] = {}
    blocks: dict[Any, Any] = {}
    with pytest.raises(TypeError, match="unhashable"):
        _native.hold(by_engine, {}, {}, {}, {}, blocks, 1, [5, [6]], [50, 60])
    assert by_engine == {5: 50} and blocks == {50: 1}


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
