"""``bench.service_compare`` at toy sizes, our service alone (the peers need Dynamo or a C++
build and a private network namespace), plus the pieces the peers rely on: the fast vLLM
hash chain equals the reference, and the expected answers."""

from __future__ import annotations

import msgpack
import pytest

from bench.harness import BLOCK_SIZE
from bench.indexer_services import HASH_PROFILE, Ours, _instances_msgpack
from bench.service_compare import (
    BATCH_BLOCKS,
    Scale,
    build_services,
    expected_answer,
    parse_args,
    round_robin,
    run,
)

TINY = Scale("tiny", 200, 1, (1_000, 2_000), (2, 9), 20, 5, 10, (50_000,), 0.1, 2)


def test_expected_answers_follow_the_prefix_holdings() -> None:
    assert expected_answer(2) == {"1": 2048, "2": 1792}
    assert len(expected_answer(64)) == 8  # the other 56 hold nothing and are left out
    assert set(expected_answer(9, 1).values()) == {BLOCK_SIZE}
    assert round_robin(5, 4, 3, 5) == [(2, 5), (0, 6), (1, 7), (2, 8)]


def test_msgpack_answers_drop_instances_without_a_match() -> None:
    data = msgpack.packb({"instances": {"a": {"longest_matched": 32}, "b": {"longest_matched": 0}}})
    assert _instances_msgpack(data) == {"a": 32}


@pytest.mark.parametrize(
    ("profiled", "args"),
    [(False, ()), (True, ()), (True, ("--query-thread",))],
    ids=["go-hashes", "hash-profile", "query-thread"],
)
def test_every_phase_runs_against_our_service(profiled: bool, args: tuple[str, ...]) -> None:
    """Every answer is checked: with the C++ service's hash profile too, ours keys the
    events' vLLM hashes and hashes each query's blocks as vLLM does; with the query
    thread, the queries are asked on its side."""
    result = run(TINY, [Ours(profiled=profiled, args=args)])
    ours = result["services"]["ours"]
    assert ours["modes"] == ["json", "msgpack"]
    assert ours["ingest"]["streams_8"]["counters"]["blocks_stored"] == 10 * BATCH_BLOCKS
    first, second = ours["grid"]
    assert [cell["instances"] for cell in first["cells"]] == [2, 2] and not second["loaded"]
    (loaded,) = first["loaded"]
    assert loaded["json"]["requests"] > 0 and loaded["catch_up_s"] >= 0
    assert loaded["applied_blocks_per_s"] > 0 and loaded["blocks_sent"] > 0
    assert result["ratios"] == {}  # one service: nothing to compare


def test_the_services_asked_for_are_the_ones_built(capsys: pytest.CaptureFixture[str]) -> None:
    """``--services`` names every service, the C++ one too (it also needs ``--cpp``)."""
    binary = "/bin/true"  # any executable: nothing is started here
    built = build_services(parse_args(["--services", "ours", "--cpp", binary]))
    assert [s.name for s in built] == ["ours"]
    built = build_services(parse_args(["--services", "ours,cpp", "--cpp", binary, "--ours-arg=-x"]))
    assert [s.name for s in built] == ["ours", "cpp"]
    assert [s.describe() for s in built] == [
        {"cpus": None, "args": ["-x"], "env": {}, "hash_profile": None},
        {"cpus": None, "binary": binary},
    ]
    (profiled,) = build_services(parse_args(["--services", "ours", "--ours-profile"]))
    assert profiled.describe()["hash_profile"] == HASH_PROFILE
    assert build_services(parse_args(["--services", "cpp"])) == []
    assert "no --cpp PATH given" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown services: go"):
        build_services(parse_args(["--services", "ours,go"]))
