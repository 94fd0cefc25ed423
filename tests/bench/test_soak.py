"""``python -m bench.soak``, shortened: churn, queries, re-registrations and publisher restarts
together leave the conductor's index exact."""

from __future__ import annotations

from bench.soak import BLOCK_SIZE, CacheModel, main
from conductor.hashing import prefix_hashes
from conductor.wire.events import BlockRemoved, BlockStored


def test_the_cache_model_announces_copies_and_evicts_them_one_by_one() -> None:
    cache = CacheModel("e", capacity=4)
    tokens = list(range(3 * BLOCK_SIZE))
    hashes = prefix_hashes(tokens, BLOCK_SIZE)
    assert [type(e) for e in cache.admit(hashes, tokens)] == [BlockStored]
    del cache.blocks[hashes[0]]  # the first block evicted alone: the rest stays cached
    events = cache.admit(hashes, tokens)
    assert isinstance(events[-1], BlockStored) and events[-1].block_hashes == hashes
    assert cache.blocks[hashes[2]] == 2  # announced twice: two copies
    other = list(range(1000, 1000 + 3 * BLOCK_SIZE))
    events = cache.admit(prefix_hashes(other, BLOCK_SIZE), other)
    assert isinstance(events[0], BlockRemoved)
    assert events[0].block_hashes == [hashes[0], hashes[1], hashes[1], hashes[2], hashes[2]]
    assert cache.matched_tokens(hashes) == 0


def test_a_short_soak_ends_with_an_exact_index(capsys) -> None:
    main(
        [
            "--duration-s", "8", "--publishers", "3", "--documents", "6",
            "--churn-interval-s", "0.5", "--query-concurrency", "2",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert '"mismatches": 0' in out and '"conductor_exit_ok": true' in out
