"""The ingest thread (``_native.IngestThread``, ``conductor.ingest_thread.IngestLane``).

Batches applied on the thread, without the GIL, must end exactly as applied on the event
loop; whatever the loop does meanwhile must see the maps whole: a lookup or a walk between
two of the thread's steps, anything that changes or iterates the maps only once the
context's batches are applied. Checked with owners past bit 62 (wide masks) too.
"""

from __future__ import annotations

import asyncio
import random
import select
import time
from typing import Any

import msgpack
import pytest

from conductor import _native
from conductor.hashing import PrefixHash
from conductor.ingest_thread import IngestLane

BS = 4
Owner = tuple[_native.Holdings, _native.Holdings, _native.Holdings]


def random_batches(seed: int, owners: int, count: int) -> list[tuple[int, bytes]]:
    """(owner, payload) pairs: chains of stored blocks from shared roots (so owners share
    prefixes) and removals of blocks stored earlier."""
    rng = random.Random(seed)
    stored: list[list[int]] = [[] for _ in range(owners)]
    batches = []
    for n in range(count):
        owner = rng.randrange(owners)
        events: list[Any] = []
        for _ in range(rng.randint(1, 4)):
            if stored[owner] and rng.random() < 0.3:
                gone = rng.sample(stored[owner], min(len(stored[owner]), rng.randint(1, 3)))
                events.append(["BlockRemoved", gone, None])
                continue
            blocks = rng.randint(1, 6)
            hashes = [rng.getrandbits(64) for _ in range(blocks)]
            tokens = [rng.randrange(3) for _ in range(blocks * BS)]  # few values: shared prefixes
            events.append(["BlockStored", hashes, None, tokens, BS, None, None])
            stored[owner] += hashes
        batches.append((owner, msgpack.packb([float(n), events])))
    return batches


def contents(state: _native.ContextBlocks, owners: list[Owner]) -> Any:
    """Everything the context holds, as plain values."""
    held = [
        [
            (dict(h.by_engine_hash.items()), dict(h.copies.items()), dict(h.extra_refs.items()))
            for h in owner
        ]
        for owner in owners
    ]
    blocks = [dict(tier.items()) for tier in state.blocks]
    return blocks, dict(state.engine_prefix.items()), dict(state.engine_refs.items()), held


def pack(payload: bytes) -> _native.PackedBatch:
    packed = _native.pack_batch(payload, BS)
    assert packed is not None
    return packed


def new_context(bits: list[int]) -> tuple[_native.ContextBlocks, list[Owner]]:
    state = _native.ContextBlocks(BS)
    return state, [state.owner(1 << bit) for bit in bits]


def wait_for(thread: _native.IngestThread, count: int) -> list[tuple[Any, Any]]:
    """The next ``count`` answers (10 s at most)."""
    answers: list[tuple[Any, Any]] = []
    deadline = time.monotonic() + 10
    while len(answers) < count and time.monotonic() < deadline:
        select.select([thread.fileno()], [], [], 0.1)
        answers += thread.finished()
    assert len(answers) == count
    return answers


@pytest.mark.parametrize("bits", [[0, 1, 2], [0, 61, 62, 63, 64, 130]])
def test_batches_applied_on_the_thread_end_as_applied_in_the_loop(bits: list[int]) -> None:
    batches = random_batches(len(bits), len(bits), 300)
    threaded, threaded_owners = new_context(bits)
    looped, looped_owners = new_context(bits)
    thread = _native.IngestThread()
    for n, (owner, payload) in enumerate(batches):
        packed = pack(payload)
        thread.submit(threaded, packed, threaded_owners[owner], 0, 7, n)
    answers = wait_for(thread, len(batches))
    for n, (owner, payload) in enumerate(batches):
        packed = pack(payload)
        assert answers[n] == (n, looped.apply_packed(packed, looped_owners[owner], 0, 10**9, 7))
    assert contents(threaded, threaded_owners) == contents(looped, looped_owners)
    assert any(mask >= 1 << 63 for mask in looped.blocks[0].values()) == (bits[-1] >= 63)
    thread.close()


def test_walks_and_lookups_meanwhile_see_the_blocks_grow() -> None:
    """Only stores: while the thread applies, every walk reaches at least as far as the one
    before it and never past what the batches hold, and lookups answer whole masks."""
    state, owners = new_context([0, 100])
    hashes = list(range(1, 4001))
    tokens = [1] * (len(hashes) * BS)  # one chain: the walk's depth is the blocks applied
    thread, batches = _native.IngestThread(), []
    for bit, owner in enumerate(owners):
        events = [
            [
                "BlockStored",
                [h + bit * 10_000 for h in hashes[first : first + 8]],
                hashes[first - 1] + bit * 10_000 if first else None,
                tokens[first * BS : (first + 8) * BS],
                BS,
                None,
                None,
            ]
            for first in range(0, len(hashes), 8)
        ]
        for at in range(0, len(events), 50):  # 400 blocks a batch, a step of 8 at a time
            batches.append((owner, pack(msgpack.packb([0.0, events[at : at + 50]]))))
    query = _chain(len(hashes))
    reached, finished, walks = 0, 0, 0
    # two batches given at a time, walked until the thread says both are applied: every
    # batch is walked during its apply or after it, however the threads are scheduled
    for given in range(2, len(batches) + 1, 2):
        for owner, packed in batches[given - 2 : given]:
            thread.submit(state, packed, owner, 0, 0, None)
        while finished < given:
            stops = state.walk(query, 1 | 1 << 100)
            deepest = max((position for _, (position, *_) in stops), default=0)
            assert reached <= deepest <= len(hashes)
            reached, walks = deepest, walks + 1
            mask = state.blocks[0].get(PrefixHash(query[0]), 0)
            assert mask in (0, 1, 1 << 100, 1 | 1 << 100)
            finished += len(thread.finished())
    assert state.walk(query, 1 | 1 << 100) == [([0, 100], (4000, 4000, 4000, 4000))]
    assert walks >= len(batches) // 2
    thread.close()


def _chain(count: int) -> list[int]:
    """The prefix hashes of ``count`` blocks of token 1, chained from the root 0."""
    return _native.chain_hashes(0, [1] * (count * BS), BS)


def test_what_changes_or_iterates_the_maps_waits_for_the_context_s_batches() -> None:
    state, (owner,) = new_context([3])
    thread = _native.IngestThread()
    payload = msgpack.packb(
        [0.0, [["BlockStored", list(range(1, 20_001)), None, [2] * (20_000 * BS), BS, None, None]]]
    )
    thread.submit(state, pack(payload), owner, 0, 0, "stored")
    assert len(list(state.blocks[0].keys())) == 20_000  # iterating waited for the batch
    thread.submit(state, pack(payload), owner, 0, 0, "again")
    assert state.clear(owner[0]) == 40_000  # every copy of both batches: it waited too
    assert len(state.engine_prefix) == len(state.blocks[0]) == 0
    assert [token for token, _ in wait_for(thread, 2)] == ["stored", "again"]
    thread.close()


def test_a_request_being_answered_holds_the_thread_back_2_ms_at_most() -> None:
    """``pause(True)`` (LoopShare's first request): the thread waits between steps, for at
    most 2 ms a pause, so queries that never stop cannot stop ingest."""
    state, (owner,) = new_context([0])
    thread = _native.IngestThread()
    payload = msgpack.packb([0.0, [["BlockStored", [1], None, [0] * BS, BS, None, None]]])
    for _ in range(2):
        thread.pause(True)  # never resumed: the 2 ms pass
        began = time.monotonic()
        thread.submit(state, pack(payload), owner, 0, 0, None)
        wait_for(thread, 1)
        assert time.monotonic() - began >= 0.0015
        thread.pause(False)
    thread.pause(True)
    thread.pause(False)  # resumed at once: nothing to wait for
    thread.submit(state, pack(payload), owner, 0, 0, None)
    wait_for(thread, 1)
    thread.close()


def test_close_applies_what_was_given_and_refuses_more() -> None:
    state, (owner,) = new_context([0])
    thread = _native.IngestThread()
    batches = random_batches(1, 1, 50)
    for n, (_, payload) in enumerate(batches):
        thread.submit(state, pack(payload), owner, 0, 0, n)
    thread.close()
    assert [token for token, _ in thread.finished()] == list(range(50))
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(state, pack(batches[0][1]), owner, 0, 0, 0)


def test_submit_refuses_what_apply_packed_refuses() -> None:
    state, (owner,) = new_context([0])
    other, (theirs,) = new_context([0])
    packed = pack(msgpack.packb([0.0, []]))
    thread = _native.IngestThread()
    with pytest.raises(TypeError, match="blocks must be a ContextBlocks"):
        thread.submit(object(), packed, owner, 0, 0, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="owner must be a tuple this ContextBlocks made"):
        thread.submit(state, packed, theirs, 0, 0, None)
    with pytest.raises(TypeError, match="packed must be a PackedBatch"):
        thread.submit(state, b"", owner, 0, 0, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad start"):
        thread.submit(state, packed, owner, 1, 0, None)
    with pytest.raises(TypeError, match="6 arguments"):
        thread.submit(state, packed)  # type: ignore[call-arg]
    thread.close()


async def test_the_lane_answers_each_batch_through_its_callback_in_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Answers come in the order given, a failing callback is logged and costs no other
    batch, and a stream waits for room while the backlog is full."""
    state, owners = new_context([0, 1])
    lane = IngestLane(max_backlog=4)
    answers: list[tuple[int, Any]] = []
    batches = random_batches(5, 2, 20)
    for n, (owner, payload) in enumerate(batches):
        if lane.full:
            await asyncio.wait_for(lane.room(), 10)
        assert lane.backlog < 4

        def on_applied(answer: Any, n: int = n) -> None:
            answers.append((n, answer))
            if n == 3:
                raise RuntimeError("a bug in a callback")

        lane.apply(state, owners[owner], pack(payload), 0, on_applied)
    async with asyncio.timeout(10):
        while len(answers) < len(batches):
            await asyncio.sleep(0.001)
    assert [n for n, _ in answers] == list(range(len(batches)))
    assert all(
        answer[0] == len(pack(p)) for (_, answer), (_, p) in zip(answers, batches, strict=True)
    )
    assert "an applied batch's callback failed" in caplog.text
    lane.close()
    assert lane.backlog == 0
