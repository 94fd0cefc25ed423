"""The sequence rules of one event stream, apart from its sockets (docs/architecture.md:
from a ZMQ frame to a ``/query`` answer).

A publisher numbers its batches; the conductor applies them strictly in order:

* a live batch that follows the last one applied is applied;
* a live batch beyond the next expected one reveals a gap: the publisher's buffer is
  replayed from the expected sequence up to (not including) that batch, then the batch is
  applied; what the replay could not fill is a gap left unrepaired;
* a live batch at or below the last applied one means a new publisher counting from
  scratch (PUB/SUB never redelivers): the owner's blocks are cleared and the stream is
  read as new, unless the last batch applied came from a replay, which may have delivered
  a batch before its live copy arrived: that live copy is a duplicate and is dropped;
* a replay applies only the batches of its window beyond the last one applied;
* a (re)connected stream with nothing applied yet replays the whole buffer at once (the
  catch-up), and a lost publisher, a restart or an instance marked down make the stream
  be read as new.

``SequenceTracker`` is pure (no asyncio, no sockets): frames go in, actions come out, and
``conductor.subscriber`` executes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply the live batch (the tracker has recorded it as the last one)."""

    seq: int


@dataclass(frozen=True, slots=True)
class DropDuplicate:
    """A live batch a replay already applied."""

    seq: int


@dataclass(frozen=True, slots=True)
class Restart:
    """A new publisher: clear the owner's blocks (``seq`` came after ``last``)."""

    seq: int
    last: int


@dataclass(frozen=True, slots=True)
class Gap:
    """Batches ``expected <= s < seq`` were missed on the live stream."""

    expected: int
    seq: int


@dataclass(frozen=True, slots=True)
class Replay:
    """Ask the publisher's buffer for ``start <= seq < stop`` (``stop`` None: all of it)."""

    start: int
    stop: int | None

    def covers(self, seq: int) -> bool:
        return self.start <= seq and (self.stop is None or seq < self.stop)


@dataclass(frozen=True, slots=True)
class GapUnrepaired:
    """The replay did not reach the batch before ``seq``: some batches are lost."""

    seq: int


LiveAction = Apply | DropDuplicate | Restart | Gap | Replay | GapUnrepaired


class SequenceTracker:
    """Where one stream stands: the last sequence applied and whether a replay applied it."""

    def __init__(self, first_sequence: int = 0, can_replay: bool = True) -> None:
        self.first_sequence = first_sequence  # what a new publisher numbers its first batch
        self.can_replay = can_replay  # the registration has a replay endpoint
        self.last: int | None = None
        self.last_replayed = False  # ``last`` came from a replay, not the live stream

    def live(self, seq: int) -> Iterator[LiveAction]:
        """The actions for a live batch, in order; ends with Apply or DropDuplicate.

        A generator, run by the caller step by step: after a ``Replay`` it resumes only once
        the caller has run the replay (and fed its batches to ``accept_replayed``), so the
        check for an unrepaired gap sees what the replay applied.
        """
        last = self.last
        if last is not None and seq <= last:
            if self.last_replayed:
                yield DropDuplicate(seq)
                return
            self.reset()
            yield Restart(seq, last)
            last = None
        expected = self.first_sequence if last is None else last + 1
        if seq > expected:
            if last is not None:
                yield Gap(expected, seq)
            if self.can_replay:
                yield Replay(expected, seq)
            reached = self.last
            if (reached is None or reached + 1 < seq) and (last is not None or self.can_replay):
                yield GapUnrepaired(seq)
        self._record(seq, replayed=False)
        yield Apply(seq)

    def accept_replayed(self, seq: int, replay: Replay) -> bool:
        """Whether a batch a replay delivered is to be applied (then it is recorded)."""
        if not replay.covers(seq) or (self.last is not None and seq <= self.last):
            return False
        self._record(seq, replayed=True)
        return True

    def catch_up(self) -> Replay | None:
        """The replay a (re)connected stream runs at once: all of the publisher's buffer,
        when nothing was applied since the stream was last read as new."""
        if self.last is None and self.can_replay:
            return Replay(self.first_sequence, None)
        return None

    def reset(self) -> None:
        """The publisher is gone, restarted or its instance down: read the stream as new."""
        self.last = None

    def _record(self, seq: int, replayed: bool) -> None:
        self.last = seq
        self.last_replayed = replayed
