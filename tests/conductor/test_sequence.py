"""The stream's sequence rules, without sockets: frames in, actions out."""

from __future__ import annotations

from collections.abc import Iterable

from conductor.sequence import (
    Apply,
    DropDuplicate,
    Gap,
    GapUnrepaired,
    LiveAction,
    Replay,
    Restart,
    SequenceTracker,
)


def run_live(
    tracker: SequenceTracker, seq: int, buffer: Iterable[int] = ()
) -> tuple[list[LiveAction], list[int]]:
    """Every action for a live batch; a Replay is answered from ``buffer`` (the publisher's
    buffered sequences, in order). Returns the actions and the replayed batches applied."""
    actions, replayed = [], []
    for action in tracker.live(seq):
        actions.append(action)
        if isinstance(action, Replay):
            replayed += [s for s in buffer if tracker.accept_replayed(s, action)]
    return actions, replayed


def test_batches_in_order_are_applied():
    tracker = SequenceTracker()
    for seq in range(3):
        assert run_live(tracker, seq) == ([Apply(seq)], [])
    assert tracker.last == 2 and not tracker.last_replayed


def test_a_first_batch_beyond_the_first_sequence_replays_without_counting_a_gap():
    tracker = SequenceTracker()
    actions, replayed = run_live(tracker, 3, buffer=[0, 1, 2, 3])
    assert actions == [Replay(0, 3), Apply(3)] and replayed == [0, 1, 2]


def test_a_gap_is_replayed_before_the_batch_that_revealed_it():
    tracker = SequenceTracker()
    run_live(tracker, 0)
    actions, replayed = run_live(tracker, 3, buffer=[0, 1, 2, 3, 4])
    assert actions == [Gap(1, 3), Replay(1, 3), Apply(3)] and replayed == [1, 2]
    assert tracker.last == 3 and not tracker.last_replayed


def test_a_replay_that_does_not_reach_the_batch_leaves_the_gap_unrepaired():
    tracker = SequenceTracker()
    run_live(tracker, 0)
    actions, replayed = run_live(tracker, 5, buffer=[3])  # 1, 2 and 4 fell out of the buffer
    assert actions == [Gap(1, 5), Replay(1, 5), GapUnrepaired(5), Apply(5)]
    assert replayed == [3]


def test_without_a_replay_endpoint_a_gap_is_counted_and_unrepaired():
    tracker = SequenceTracker(can_replay=False)
    run_live(tracker, 0)
    assert run_live(tracker, 2) == ([Gap(1, 2), GapUnrepaired(2), Apply(2)], [])


def test_joining_a_running_publisher_without_replay_is_no_gap():
    tracker = SequenceTracker(can_replay=False)
    assert run_live(tracker, 7) == ([Apply(7)], [])


def test_joining_with_a_failed_replay_is_an_unrepaired_gap_but_no_gap():
    tracker = SequenceTracker()
    assert run_live(tracker, 7, buffer=[]) == ([Replay(0, 7), GapUnrepaired(7), Apply(7)], [])


def test_a_sequence_going_back_live_is_a_restart():
    tracker = SequenceTracker()
    for seq in range(3):
        run_live(tracker, seq)
    assert run_live(tracker, 0) == ([Restart(0, 2), Apply(0)], [])
    assert run_live(tracker, 1) == ([Apply(1)], [])


def test_a_repeated_live_sequence_is_a_restart():
    tracker = SequenceTracker()
    run_live(tracker, 4)
    actions, _ = run_live(tracker, 4, buffer=[0, 1, 2, 3])
    assert actions == [Restart(4, 4), Replay(0, 4), Apply(4)]


def test_a_restart_counting_from_a_later_first_sequence():
    tracker = SequenceTracker(first_sequence=1)
    run_live(tracker, 1)
    run_live(tracker, 2)
    assert run_live(tracker, 1) == ([Restart(1, 2), Apply(1)], [])


def test_a_live_copy_of_a_replayed_batch_is_dropped():
    tracker = SequenceTracker()
    catch_up = tracker.catch_up()
    assert catch_up == Replay(0, None)
    assert [s for s in (0, 1, 2) if tracker.accept_replayed(s, catch_up)] == [0, 1, 2]
    assert tracker.last_replayed
    assert run_live(tracker, 1) == ([DropDuplicate(1)], [])
    assert run_live(tracker, 2) == ([DropDuplicate(2)], [])
    assert run_live(tracker, 3) == ([Apply(3)], [])
    assert run_live(tracker, 3) == ([Restart(3, 3), Replay(0, 3), GapUnrepaired(3), Apply(3)], [])


def test_a_replay_applies_only_its_window_beyond_the_last_batch():
    tracker = SequenceTracker()
    run_live(tracker, 5)
    window = Replay(3, 8)
    accepted = [s for s in (2, 3, 5, 6, 7, 8, 9) if tracker.accept_replayed(s, window)]
    assert accepted == [6, 7]
    assert tracker.last == 7 and tracker.last_replayed


def test_the_catch_up_replays_the_whole_buffer_only_when_nothing_was_applied():
    tracker = SequenceTracker(first_sequence=1)
    assert tracker.catch_up() == Replay(1, None)
    run_live(tracker, 1)
    assert tracker.catch_up() is None
    tracker.reset()  # the publisher was lost, or its instance marked down
    assert tracker.catch_up() == Replay(1, None)
    assert SequenceTracker(can_replay=False).catch_up() is None


def test_after_a_reset_the_stream_is_read_as_new():
    tracker = SequenceTracker()
    for seq in range(5):
        run_live(tracker, seq)
    tracker.reset()
    assert run_live(tracker, 0) == ([Apply(0)], [])  # no restart: nothing to clear twice
    tracker.reset()
    actions, replayed = run_live(tracker, 3, buffer=[0, 1, 2, 3])
    assert actions == [Replay(0, 3), Apply(3)] and replayed == [0, 1, 2]


def test_the_gap_check_waits_for_the_replay():
    """The generator resumes after the caller ran the replay: what it applied counts."""
    tracker = SequenceTracker()
    run_live(tracker, 0)
    actions = tracker.live(3)
    assert next(actions) == Gap(1, 3)
    replay = next(actions)
    assert replay == Replay(1, 3)
    assert tracker.accept_replayed(1, replay) and tracker.accept_replayed(2, replay)
    assert list(actions) == [Apply(3)]
