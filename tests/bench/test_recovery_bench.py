"""``python -m bench.recovery_bench`` at a small size, over real conductor processes, ZMQ
publishers and HTTP on 127.0.0.1: both restarts answer the sample exactly, and the result
has every figure the results file reports. Also the workload's own promises, which a
wrong one would break without failing the run."""

from __future__ import annotations

import json

import pytest

from bench.recovery_bench import (
    BUFFER_STEPS,
    LATE_BATCHES,
    SHARED_BLOCKS,
    Workload,
    main,
)


def test_the_workload_holds_its_blocks_and_samples_every_kind() -> None:
    workload = Workload(blocks=20_003, engines=4, sample=200)
    events = [list(workload.events(engine)) for engine in range(4)]
    per_engine = [sum(len(e.block_hashes) for e in made) for made in events]
    assert sum(per_engine) == 20_003 and max(per_engine) - min(per_engine) <= 1
    hashes = [h for made in events for e in made for h in e.block_hashes]
    assert len(set(hashes)) == len(hashes)  # engine hashes never repeat
    queries = workload.queries()
    assert {q.kind for q in queries} == {"whole", "prefix", "diverging", "shared", "miss"}
    for query in queries:
        assert 0 <= query.owner_matched <= len(query.tokens)
        assert query.owner_matched % 16 == 0
    shared = [q for q in queries if q.kind == "shared"]
    assert all(q.owner_matched <= SHARED_BLOCKS * 16 for q in shared)
    assert LATE_BATCHES <= BUFFER_STEPS  # the restart from the file can replay them


def test_a_small_run_recovers_exactly(tmp_path) -> None:
    out = tmp_path / "recovery.json"
    argv = ["--blocks", "20000", "--engines", "4", "--sample", "100"]
    assert main([*argv, "--snapshot-interval", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ingest"]["blocks"] == 20_000
    assert sum(result["sample"].values()) == 100
    assert result["goals"] == {"peer_within_10s": True, "own_snapshot_exact": True}
    for restart in ("peer", "own"):
        figures = result[restart]
        assert figures["all_matched"] and figures["mismatched"] == 0
        assert 0 < figures["http_s"] <= figures["answered_s"]
        assert figures["restored_blocks"] == 20_000  # the blocks came from the snapshot
        assert figures["gaps_unrepaired"] == 0
        assert figures["peak_rss_bytes"] >= figures["rss_bytes"] > 0
        assert figures["restore_s"] is not None
    own = result["own"]
    assert own["late"]["all_matched"] and own["late"]["answered_s"] >= own["http_s"]
    assert own["recovered_s"] == max(own["answered_s"], own["late"]["answered_s"])
    assert own["replayed_batches"] == own["late_batches"] == 4 * LATE_BATCHES
    assert result["snapshot"]["blocks"] == 20_000
    assert 16 <= result["snapshot"]["bytes_per_block"] < 32  # two u64 per block, and framing
    write = result["periodic_write"]
    assert write["build_s"] > 0 and write["longest_step_s"] > 0 and write["bytes"] > 0


def test_too_few_blocks_for_the_buffers_to_roll_over_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--blocks", "1000", "--engines", "4"])
    assert "roll over" in capsys.readouterr().err
