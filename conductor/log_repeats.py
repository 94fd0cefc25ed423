"""Repeated log lines, collapsed: a fault that recurs every 100 ms must not write a million
lines a day, yet the operator must still learn that it went on, and how often.

``RepeatedLineFilter`` sits on the handler every command logs through. A line passes the
first time; the same line again within ``window_s`` is counted and dropped; the first one
after the window passes with ``(N more in the last 60 s)``. "The same line" means the same
logger, level and message template with the same text arguments: numbers (sequence numbers,
durations) may differ, the subject (a stream, an instance, a URL) may not, so one stream's
fault never hides another's. DEBUG lines are never collapsed: whoever asks for them wants
every decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

WINDOW_S = 60.0
MAX_KEYS = 4096  # distinct lines remembered; the oldest is forgotten first

LineKey = tuple[str, int, str, tuple[str, ...]]


@dataclass(slots=True)
class _Seen:
    passed_at: float
    dropped: int = 0


class RepeatedLineFilter(logging.Filter):
    def __init__(
        self,
        window_s: float = WINDOW_S,
        max_keys: int = MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.window_s = window_s
        self.max_keys = max_keys
        self._clock = clock
        self._seen: dict[LineKey, _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or not isinstance(record.msg, str):
            return True
        key = _line_key(record)
        now = self._clock()
        seen = self._seen.pop(key, None)  # popped and put back: the newest goes last
        if seen is not None and now - seen.passed_at < self.window_s:
            seen.dropped += 1
            self._seen[key] = seen
            return False
        if seen is not None and seen.dropped:
            record.msg = (
                f"{record.msg} ({seen.dropped} more in the last {now - seen.passed_at:.0f} s)"
            )
        self._seen[key] = _Seen(now)
        if len(self._seen) > self.max_keys:
            del self._seen[next(iter(self._seen))]
        return True


def _line_key(record: logging.LogRecord) -> LineKey:
    args = record.args if isinstance(record.args, tuple) else ()
    subjects = tuple(arg for arg in args if isinstance(arg, str))
    return (record.name, record.levelno, str(record.msg), subjects)
