"""Starting, watching and stopping the fleet's processes.

asyncio's subprocess API starts them, psutil stops them: vLLM forks an engine-core process
(and torch its workers), so stopping only the process we started would orphan its children.
Each child gets its own session (a Ctrl-C in the terminal reaches the fleet, which then stops
everything in order) and, on Linux, a parent-death signal (SIGTERM: vLLM's API server then
stops its engine core, which a SIGKILL would orphan). The fleet's watchdog (``watchdog.py``)
covers what that signal cannot: a child that is stopped when the fleet is SIGKILLed, and
grandchildren whose parent is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import psutil

from .service import ServicePlan

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 15.0  # vLLM's graceful shutdown can take several seconds on a busy machine
HEALTH_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _before_exec(cpus: tuple[int, ...]) -> Callable[[], None]:
    """What the child does before exec: die with the fleet, keep to its CPUs (which its
    own children and their OpenMP thread pools inherit)."""

    def prepare() -> None:  # pragma: no cover - runs in the child before exec
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return prepare


def child_environment(overrides: dict[str, str | None]) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class ChildProcess:
    """One service of the fleet; its output goes to ``<log_dir>/<name>.log``."""

    def __init__(self, plan: ServicePlan, log_dir: Path) -> None:
        self.plan = plan
        self.log_path = log_dir / f"{plan.name}.log"
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0

    @property
    def name(self) -> str:
        return self.plan.name

    async def start(self) -> None:
        if self.plan.tmp_dir is not None:
            self.plan.tmp_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.process = await asyncio.create_subprocess_exec(
                *self.plan.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=child_environment(self.plan.env),
                start_new_session=True,
                preexec_fn=_before_exec(self.plan.cpus),
            )
        self.started_at = time.monotonic()

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.returncode

    async def healthy(self, http: aiohttp.ClientSession) -> bool:
        ready_when = self.plan.ready_when
        try:
            url = self.plan.health_endpoint
            async with http.get(url, timeout=HEALTH_TIMEOUT) as response:
                if response.status != 200:
                    return False
                return ready_when is None or ready_when(await response.text())
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return False

    def _descendants(self) -> list[psutil.Process]:
        if self.process is None:
            return []
        try:
            children: list[psutil.Process] = psutil.Process(self.process.pid).children(
                recursive=True
            )
            return children
        except psutil.NoSuchProcess:
            return []

    def _tree(self) -> list[psutil.Process]:
        """The running process and every descendant; empty once it has exited."""
        if self.process is None or self.process.returncode is not None:
            return []
        try:
            return [psutil.Process(self.process.pid), *self._descendants()]
        except psutil.Error:
            return []

    def rss_bytes(self) -> int:
        """Resident memory of the process and every descendant (vLLM's engine core)."""
        total = 0
        for process in self._tree():
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
        return total

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the whole tree (or, with ``stop_main_only``, to the main process while
        it runs), SIGKILL to what is left after ``timeout``; then the plan's files in
        /dev/shm that the tree held are removed.

        asyncio reaps the process it started (psutil must not: asyncio would then wait
        forever for an exit it never sees); psutil waits for the descendants."""
        if self.process is None:
            return
        descendants = self._descendants()
        shm_files: set[Path] = set()
        if self.plan.shm_prefixes:
            shm_files = await asyncio.to_thread(
                held_shm_files, self._tree(), self.plan.shm_prefixes
            )
        main_only = self.plan.stop_main_only and self.process.returncode is None
        if self.process.returncode is None:
            self.process.terminate()
        for process in [] if main_only else descendants:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        _, alive = await asyncio.to_thread(psutil.wait_procs, descendants, timeout)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        await asyncio.to_thread(psutil.wait_procs, alive, 5.0)
        for path in shm_files:
            path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def last_log_line(self) -> str:
        tail = self.log_tail(1).strip()
        return tail[:120]


def held_shm_files(tree: list[psutil.Process], prefixes: tuple[str, ...]) -> set[Path]:
    """The files in /dev/shm with these prefixes that ``tree`` holds open or mapped: what it
    will leave there, whatever other processes keep there."""
    held: set[Path] = set()
    for process in tree:
        with contextlib.suppress(psutil.Error):
            paths = [f.path for f in process.open_files()]
            paths += [m.path for m in process.memory_maps()]
            held |= {Path(path) for path in paths if path.startswith(prefixes)}
    return held


async def wait_until_healthy(
    children: list[ChildProcess],
    http: aiohttp.ClientSession,
    deadline: float,
    report: Callable[[str], None],
    crashed: Callable[[ChildProcess], None],
    progress_every_s: float = 5.0,
) -> bool:
    """Polls ``/health`` of every child; False if one exits first (``crashed`` is told)."""
    pending = list(children)
    next_report = time.monotonic() + progress_every_s
    while pending:
        for child in list(pending):
            if child.exit_code is not None:
                crashed(child)
                return False
            if await child.healthy(http):
                pending.remove(child)
                report(f"{child.name} ready at {child.plan.url}")
        if not pending:
            break
        now = time.monotonic()
        if now > deadline:
            names = ", ".join(child.name for child in pending)
            raise TimeoutError(f"not healthy in time: {names}")
        if now >= next_report:
            next_report = now + progress_every_s
            for child in pending:
                report(f"waiting for {child.name} ({child.plan.kind}): {child.last_log_line()}")
        await asyncio.sleep(0.25)
    return True
