"""``python -m bench.conductor_bench`` at toy sizes: our service alone, and the ``--peer``
plumbing driven against a second instance of our own service standing in for the Go one
(started the way the Go binary is: a port in ``CONDUCTOR_CONFIG_PATH``'s file)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from bench.conductor_bench import Scale, bench_ingest, main, run
from bench.conductor_peer import PeerError, PeerSpec, parse_env

TINY = Scale(
    "tiny",
    ingest_events=200,
    index_sizes=(600, 1_200),
    instance_counts=(2, 9),
    requests=20,
    warmup=5,
    floor_requests=10,
    ingest_runs=1,
)
OURS_AS_PEER = PeerSpec((sys.executable, "-m", "conductor"), {"CONDUCTOR_HOST": "127.0.0.1"})


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def children() -> set[int]:
    """Processes whose parent is this test process (a peer left running would be one)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # it exited while we looked
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


def test_without_a_peer_only_our_service_is_measured(context: zmq.Context) -> None:
    result = run(TINY, context, None)
    assert "peer" not in result and "comparison" not in result and "ingest_legacy" not in result
    ingest = result["ingest"]
    assert (ingest["target"], ingest["layout"]) == ("ours", "vllm")
    assert ingest["counters"]["blocks_stored"] == TINY.ingest_events * 16
    for query in result["query"]:
        for cell in query["cells"]:
            assert cell["target"] == "ours" and cell["msgpack_int32"]["requests"] == 20
            assert cell["server"]["count"] == 20  # the service timed every timed request
    assert result["summary"]["query_8"]["requests"] == 20


def test_the_peer_path_measures_a_second_service_side_by_side(
    context: zmq.Context, capsys: pytest.CaptureFixture[str]
) -> None:
    before = children()
    result = run(TINY, context, OURS_AS_PEER)
    assert children() == before  # every peer was stopped and reaped

    peer = result["peer"]
    assert peer["command"] == list(OURS_AS_PEER.command)
    assert (peer["ingest"]["target"], peer["ingest"]["layout"]) == ("peer", "vllm-legacy")
    assert peer["ingest"]["counters"] == {"batches_checked": TINY.ingest_events // 20}
    assert result["ingest_legacy"]["layout"] == "vllm-legacy"
    assert result["ingest_legacy"]["counters"]["events_applied"] == TINY.ingest_events
    for query, instances in zip(peer["query"], TINY.instance_counts, strict=True):
        assert query["instances"] == instances and len(query["cells"]) == 2
        for cell in query["cells"]:  # JSON only: nothing read from our /metrics
            assert cell["target"] == "peer" and "server" not in cell
            assert "msgpack_int32" not in cell

    comparison = result["comparison"]
    ingest = comparison["ingest_blocks_per_s"]
    assert ingest["ratio"] == pytest.approx(ingest["ours"] / ingest["peer"])
    assert len(comparison["query"]) == 4
    for cell in comparison["query"]:
        assert cell["peer_blocks"] == cell["blocks"] + cell["instances"]  # a probe per stream
        for key in ("p50_ms", "p99_ms", "msgpack_p50_ms", "bytes_per_block_total"):
            assert math.isfinite(cell[key]["ratio"]) and cell[key]["ratio"] > 0
    out = capsys.readouterr().out
    assert "== side by side with the peer" in out and "== ingest: peer" in out


def test_a_peer_that_cannot_start_is_a_clear_error(context: zmq.Context, tmp_path: Path) -> None:
    missing = PeerSpec((str(tmp_path / "no-such-conductor"),), {})
    with pytest.raises(PeerError, match="cannot start the peer"):
        bench_ingest(TINY, context, missing, "vllm-legacy")
    crashing = PeerSpec((sys.executable, "-c", "print('bad config'); raise SystemExit(3)"), {})
    with pytest.raises(PeerError, match=r"exited with 3:\nbad config"):
        bench_ingest(TINY, context, crashing, "vllm-legacy")


def test_the_command_line_rejects_a_bad_peer_before_measuring(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, message in (
        (["--peer-env", "A=1"], "--peer-env needs --peer"),
        (["--peer", ""], "--peer needs a command"),
        (["--peer", "x", "--peer-env", "NOEQUALS"], "KEY=VALUE"),
        (["--peer", "'unclosed"], "quotation"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert parse_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
