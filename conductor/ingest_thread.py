"""The C lane's batches applied on a thread of their own, beside the event loop.

The event loop keeps everything Python does per batch (HTTP, sequence numbers, reading
and packing the next batches); ``_native.IngestThread`` applies packed batches without
the GIL, in the order given, each under its context's mutex a few dozen blocks at a time
(conductor/native/ingest.c, sync.h). So ingest takes a second core, and a query waits for
a step of the thread at most, not for the loop to finish a batch.

A stream does not wait for its batch to be applied before it reads the next one: the two
overlap, and the thread keeps a stream's batches in order. The loop hears of a finished
batch through a pipe it watches and runs the batch's callback then. At most
``max_backlog`` batches wait for the thread; a stream that would give it more waits
(``room``). While the service answers a request the thread waits between two steps
(``pause``), as the loop's own steps wait (``runtime.LoopShare``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from ._native import ContextBlocks, Holdings, IngestThread, PackedBatch

log = logging.getLogger("conductor")

# apply_packed's answer: (the first event not applied, blocks stored, blocks removed,
# events orphaned, events whose token count does not fit their hashes)
Applied = tuple[int, int, int, int, int]
OnApplied = Callable[[Applied | BaseException], None]
MAX_BACKLOG = 32  # batches given to the thread and not applied yet: ~10k blocks, ~5 ms


class IngestLane:
    """Packed batches applied on an ``IngestThread``, each answered through its callback."""

    def __init__(self, max_backlog: int = MAX_BACKLOG) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = IngestThread()
        self._loop.add_reader(self._thread.fileno(), self._collect)
        self.max_backlog = max_backlog
        self.backlog = 0  # batches given and not answered yet
        self._waiting: deque[asyncio.Future[None]] = deque()  # streams waiting for room

    def apply(
        self,
        blocks: ContextBlocks,
        owner: tuple[Holdings, Holdings, Holdings],
        packed: PackedBatch,
        root: int | None,
        on_applied: OnApplied,
    ) -> None:
        """``blocks.apply_packed(packed, owner, 0, <all>, root)`` on the thread, after the
        batches given before; ``on_applied`` gets its answer, or the exception it raised."""
        self._thread.submit(blocks, packed, owner, 0, root, on_applied)
        self.backlog += 1

    @property
    def full(self) -> bool:
        return self.backlog >= self.max_backlog

    def room(self) -> asyncio.Future[None]:
        """Done once the backlog is under ``max_backlog`` again."""
        waiter = self._loop.create_future()
        self._waiting.append(waiter)
        return waiter

    def _collect(self) -> None:
        for on_applied, answer in self._thread.finished():
            self.backlog -= 1
            try:
                on_applied(answer)
            except Exception:  # a bug costs the batch's bookkeeping, never the lane
                log.exception("an applied batch's callback failed")
        while self._waiting and not self.full:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def pause(self, answering: bool) -> None:
        """Requests are being answered (True; 2 ms at most each time) or none is (False):
        on a machine of few cores a query then has a core without the thread's work."""
        self._thread.pause(answering)

    def close(self) -> None:
        """Stop the thread once the batches given are applied, and answer them."""
        self._loop.remove_reader(self._thread.fileno())
        self._thread.close()
        self._collect()
