"""Log lines for state changes, said once: a fault that lasts is logged when it starts, then
at most once per ``reminder_s`` (with how often it recurred meanwhile), and its end once.
Without this a dead conductor or engine writes one line per request or per probe.
Failures in such lines are rendered by ``conductor.failures.describe``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

REMINDER_S = 30.0


@dataclass(slots=True)
class _Fault:
    since: float
    reminded: float
    repeats: int = 0


@dataclass
class Notices:
    """Per key (``"conductor http://…"``, ``"engine a"``), whether it is in a fault now."""

    log: logging.Logger
    reminder_s: float = REMINDER_S
    _faults: dict[str, _Fault] = field(default_factory=dict)

    def fault(self, key: str, message: str, *args: object, level: int = logging.WARNING) -> None:
        """``key`` is (still) failing: logged the first time, then as a periodic reminder."""
        now = time.monotonic()
        fault = self._faults.get(key)
        if fault is None:
            self._faults[key] = _Fault(now, now)
            self.log.log(level, message, *args)
            return
        fault.repeats += 1
        if now - fault.reminded >= self.reminder_s:
            self.log.log(
                level,
                message + " (still, for %.0fs; %d more times since the last line)",
                *args,
                now - fault.since,
                fault.repeats,
            )
            fault.reminded, fault.repeats = now, 0

    def recovered(self, key: str, message: str, *args: object) -> bool:
        """``key`` works: logged at INFO only if it was failing. True if it was."""
        fault = self._faults.pop(key, None)
        if fault is not None:
            self.log.info(message + " (after %.1fs)", *args, time.monotonic() - fault.since)
        return fault is not None

    def failing(self, key: str) -> bool:
        return key in self._faults
