"""Log lines for state changes, said once: a fault that lasts is logged when it starts, then
at most once per ``reminder_s`` (with how often it recurred meanwhile), and its end once.
Without this a dead conductor or engine writes one line per request or per probe.

``describe`` renders an expected failure (refused, reset, timed out, cut) for such a line:
its type and a short reason, never its repr (aiohttp's carry a connection key and nested
errors, ~400 characters of noise).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import aiohttp

REMINDER_S = 30.0
MAX_REASON_CHARS = 200


def describe(error: BaseException) -> str:
    """``Type: reason`` for a log line or an error message (``Type`` alone without one)."""
    if isinstance(error, aiohttp.ClientConnectorError):
        reason = f"cannot connect to {error.host}:{error.port}: {os_reason(error.os_error)}"
    elif isinstance(error, OSError) and error.errno:
        reason = os_reason(error)
    elif isinstance(error, aiohttp.ClientResponseError):
        reason = f"{error.status} {error.message}"
    else:
        reason = str(error)
    # the first line, before any nested object's repr (ClientPayloadError appends its cause's)
    reason = reason.split("\n", 1)[0].split(" <", 1)[0].rstrip(": ")
    name = type(error).__name__
    return f"{name}: {reason[:MAX_REASON_CHARS]}" if reason else name


def os_reason(error: OSError) -> str:
    """The system's words for ``error``: its errno's (asyncio's and socket's own texts repeat
    the address as a tuple), else the resolver's (a failed name lookup's errno is negative)."""
    if error.errno is not None and error.errno > 0:
        return os.strerror(error.errno).lower()
    return (error.strerror or str(error)).lower()


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
