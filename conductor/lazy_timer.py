"""A connection's timeout, moved at every request and firing rarely."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

EARLY_S = 0.001  # a timer firing this much before its deadline counts as on time


class LazyTimer:
    """Calls ``callback`` once the deadline of the last ``arm`` passes (not after ``disarm``).

    A connection moves its timeout at every request (the head's, the keep-alive's). A new
    loop timer each time (a cancel and a ``call_later``) was a few µs of a query's CPU and
    churned the loop's timer heap; here a later deadline costs no new timer: the armed one
    checks the deadline when it fires and waits out the rest. Only an earlier deadline
    replaces it.
    """

    __slots__ = ("_callback", "_deadline", "_handle", "_loop")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._deadline: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    def arm(self, seconds: float) -> None:
        deadline = self._deadline = self._loop.time() + seconds
        if self._handle is not None:
            if self._handle.when() <= deadline:
                return
            self._handle.cancel()
        self._handle = self._loop.call_at(deadline, self._fire)

    def disarm(self) -> None:
        self._deadline = None

    def close(self) -> None:
        """Disarmed for good: the loop holds nothing of it (the connection is gone)."""
        self._deadline = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        deadline = self._deadline
        if deadline is None:
            return
        if deadline - self._loop.time() > EARLY_S:  # moved since: wait out the rest
            self._handle = self._loop.call_at(deadline, self._fire)
            return
        self._deadline = None
        self._callback()
