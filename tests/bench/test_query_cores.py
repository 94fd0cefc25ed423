"""``bench.query_cores`` at toy sizes: the loop alone and with the query thread, unpinned;
every answer is checked by the run itself."""

from __future__ import annotations

from bench.query_cores import Scale, Variant, run

TINY = Scale((1, 2), 0.3, 2_000, 20_000, 2)


def test_both_ways_are_measured_and_the_thread_answers_its_share() -> None:
    loop, thread = run(
        TINY, (Variant("loop", None, ()), Variant("thread", None, ("--query-thread",)))
    )["variants"]
    for variant in (loop, thread):
        alone, two, ingesting = variant["4,096 tokens"]
        assert [alone["clients"], two["clients"], ingesting["clients"]] == [1, 2, 2]
        assert ingesting["ingesting"]["sent_blocks_per_s"] > 0
        assert all(row["requests"] > 0 for row in (*variant["4,096 tokens"], *variant["1 block"]))
    assert {row["thread_share"] for row in loop["1 block"]} == {0.0}
    alone, two = thread["1 block"]
    assert alone["thread_share"] == 1.0  # placed on the thread's side
    assert 0.0 < two["thread_share"] < 1.0  # one connection on each side
