"""The fleet's watchdog: when the fleet dies, however it dies, its processes die too.

A parent-death signal alone is not enough: a process that is stopped (SIGSTOP, a debugger)
when the fleet is SIGKILLed keeps the signal pending and lives on with its ports, and
vLLM's engine core (a child of the API server) outlives an API server that is SIGKILLed.
So the fleet starts this small process first, in a session of its own, and tells it
through a pipe the process group of every child it starts (each child leads a group that
its own children, such as vLLM's engine core, inherit) and of every child it has stopped.
When the pipe ends (the fleet exited, or was killed) the groups still listed get SIGTERM
and SIGCONT (a stopped process wakes up to its SIGTERM and shuts down gracefully), and
SIGKILL for whatever is left after the grace period.

``python -m fleet.watchdog FD GRACE_S``: FD is the pipe's read end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import psutil

POLL_S = 0.1


class Watchdog:
    """The fleet's side: starts the watchdog and keeps it told which groups to stop."""

    def __init__(self, log_path: Path, grace_s: float) -> None:
        self.log_path = log_path
        self.grace_s = grace_s
        self.process: asyncio.subprocess.Process | None = None
        self._pipe: int | None = None  # the write end; only the fleet holds it

    async def start(self) -> None:
        read_end, self._pipe = os.pipe()  # neither end is inherited by the fleet's children
        try:
            with self.log_path.open("ab") as log:
                self.process = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-m", "fleet.watchdog", str(read_end), str(self.grace_s)),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    pass_fds=(read_end,),
                    start_new_session=True,  # a Ctrl-C in the terminal does not reach it
                )
        finally:
            os.close(read_end)

    def watch(self, pid: int) -> None:
        """``pid`` leads a process group to stop if the fleet dies."""
        self._tell(f"+{pid}\n")

    def forget(self, pid: int) -> None:
        """The fleet stopped ``pid``'s group itself."""
        self._tell(f"-{pid}\n")

    def _tell(self, line: str) -> None:
        if self._pipe is None:
            return
        try:
            os.write(self._pipe, line.encode())  # a few bytes: a pipe takes them at once
        except BrokenPipeError:  # the watchdog is gone; the parent-death signal remains
            os.close(self._pipe)
            self._pipe = None

    async def close(self, timeout: float = 5.0) -> None:
        """Ends the pipe; with every group forgotten, the watchdog exits at once."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self.process is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), timeout)


def read_groups(pipe: int) -> set[int]:
    """The groups still listed when the pipe ends (blocks until then)."""
    groups: set[int] = set()
    with os.fdopen(pipe, "r") as lines:
        for line in lines:
            pid = int(line[1:])
            if line.startswith("+"):
                groups.add(pid)
            else:
                groups.discard(pid)
    return groups


def members(groups: set[int]) -> list[psutil.Process]:
    """The live (not zombie) processes of ``groups``."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) in groups and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def signal_groups(groups: set[int], signum: signal.Signals) -> None:
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signum)


def stop_groups(groups: set[int], grace_s: float) -> None:
    """SIGTERM and SIGCONT, then SIGKILL to whatever outlives ``grace_s``."""
    print(f"the fleet is gone; stopping process groups {sorted(groups)}", flush=True)
    signal_groups(groups, signal.SIGTERM)
    signal_groups(groups, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while (left := members(groups)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if left:
        print(f"killing {len(left)} processes still running after {grace_s:g} s", flush=True)
        signal_groups(groups, signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    pipe, grace_s = (argv or sys.argv[1:])[:2]
    if groups := read_groups(int(pipe)):
        stop_groups(groups, float(grace_s))


if __name__ == "__main__":
    main()
