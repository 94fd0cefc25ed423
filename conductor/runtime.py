"""What every command of the project starts the same way: logging, flags, the event loop,
and the guards every long-running service needs (loop-lag measurement, supervised
background tasks, and a share of the loop for bulk work)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from .log_repeats import RepeatedLineFilter
from .states import TaskState

T = TypeVar("T")
LOG_FORMAT = "%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def package_version() -> str:
    try:
        return version("mooncake-conductor-py")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


def log_level(value: str) -> str:
    """An argparse type: a level name in any case; ``WARN`` (the Go env var's spelling)."""
    level = value.upper()
    level = "WARNING" if level == "WARN" else level
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(LOG_LEVELS)} (or WARN), got {value!r}"
        )
    return level


def port_number(value: str) -> int:
    """An argparse type: a TCP port 1..65535 (a wrapped port would listen somewhere else)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port 1..65535, got {port}")
    return port


def add_common_flags(parser: argparse.ArgumentParser, log_level_env: str) -> None:
    """``--log-level`` (default from ``log_level_env``, then INFO) and ``--version``."""
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=os.environ.get(log_level_env, "INFO"),
        help=f"DEBUG, INFO, WARNING or ERROR (env {log_level_env}; default INFO)",
    )
    add_version_flag(parser)


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: every command of the project prints the installed package's version."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")


def configure_logging(level: str) -> None:
    """Structured ``key=value`` lines on stderr, a repeated line collapsed into a count.

    Like ``basicConfig``, it does nothing to a process whose root logger has handlers
    already (a test runner's, when a command's ``main`` runs in-process): the filter goes
    on its own handler only, never on someone else's."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RepeatedLineFilter())
    logging.basicConfig(level=log_level(level), handlers=[handler])


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (faster sockets), else the standard loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt until the event loop's own handlers take
    over, and the previous handlers come back after.

    Even in a command started with SIGINT ignored, as a non-interactive shell starts its
    background jobs: the loop's handlers override that later, so until then a stop asked
    for while the command starts (its port may already take connections) would be lost."""
    previous = [
        (signum, signal.signal(signum, signal.default_int_handler)) for signum in STOP_SIGNALS
    ]
    try:
        yield
    finally:
        for signum, handler in previous:
            signal.signal(signum, handler)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a command's ``main`` on a new event loop (``new_event_loop``).

    A stop signal that comes before ``main`` installs its own handlers stops the command
    quietly, as asked: SIGINT cancels ``main`` (``asyncio.Runner``'s handling), SIGTERM
    interrupts it, and either way the process exits 0 (SystemExit)."""
    try:
        with interruptible(), asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(main)
    except KeyboardInterrupt:
        raise SystemExit(0) from None


class LoopLagMonitor:
    """Measures how late the event loop wakes a sleeper: the time some callback held it.

    Every ``interval`` it sleeps and records the overshoot in ``{prefix}_event_loop_lag_seconds``;
    ``worst`` keeps the largest seen (reported by benchmarks and soak runs).
    """

    def __init__(self, registry: CollectorRegistry, prefix: str, interval: float = 0.02) -> None:
        self.histogram = Histogram(
            f"{prefix}_event_loop_lag_seconds",
            "How much later than asked the event loop woke a periodic sleeper",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.interval = interval
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._measure(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _measure(self) -> None:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval)
            lag = max(0.0, time.perf_counter() - asked - self.interval)
            self.worst = max(self.worst, lag)
            self.histogram.observe(lag)


class GcPauseMonitor:
    """Times the garbage collector's pauses: a full collection over a million long-lived
    objects holds the event loop for a noticeable while, and shows in query tails.

    Records each collection in ``{prefix}_gc_pause_seconds`` (label ``generation``) and
    logs one slower than ``warn_s``. Installed by ``start`` (a ``gc.callbacks`` hook),
    removed by ``stop``.
    """

    def __init__(self, registry: CollectorRegistry, prefix: str, warn_s: float = 0.1) -> None:
        self.histogram = Histogram(
            f"{prefix}_gc_pause_seconds",
            "How long each garbage collection paused the process",
            ["generation"],
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.warn_s = warn_s
        self._began = 0.0

    def start(self) -> None:
        gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        pause = time.perf_counter() - self._began
        self.histogram.labels(str(info["generation"])).observe(pause)
        if pause > self.warn_s:
            logging.getLogger(__name__).warning(
                "garbage collection of generation %d paused %.0f ms (%d objects collected)",
                info["generation"],
                1000 * pause,
                info["collected"],
            )


class SupervisedTask:
    """A background coroutine that never dies silently.

    ``factory`` makes the coroutine; when it raises, the failure is logged with its
    traceback, counted in ``failures`` (label ``task``) and kept in ``last_error``; the
    task is restarted after a backoff that doubles from ``min_backoff`` to ``max_backoff``
    and resets once a run lasted longer than ``max_backoff``. A coroutine that returns
    normally is done (state ``stopped``).
    """

    def __init__(
        self,
        name: str,
        factory: Callable[[], Awaitable[None]],
        failures: Counter,
        min_backoff: float = 0.1,
        max_backoff: float = 5.0,
        on_state: Callable[[TaskState], None] | None = None,
    ) -> None:
        self.name = name
        self._factory = factory
        self._failures = failures
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._on_state = on_state
        self.state = TaskState.STOPPED
        self.last_error = ""
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._set_state(TaskState.STOPPED)

    def _set_state(self, state: TaskState) -> None:
        if state != self.state:
            self.state = state
            if self._on_state is not None:
                self._on_state(state)

    async def _supervise(self) -> None:
        backoff = self._min_backoff
        while True:
            self._set_state(TaskState.RUNNING)
            started = time.monotonic()
            try:
                await self._factory()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - the point: any failure is survived
                self.last_error = f"{type(error).__name__}: {error}"[:500]
                self._failures.labels(self.name).inc()
                self.restarts += 1
                if time.monotonic() - started > self._max_backoff:
                    backoff = self._min_backoff
                logging.getLogger(__name__).error(
                    "task=%s failed, restarting in %.1fs", self.name, backoff, exc_info=True
                )
                self._set_state(TaskState.FAILED)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max_backoff)
            else:
                self._set_state(TaskState.STOPPED)
                return


class LoopShare:
    """Bulk work (applying event batches) takes turns: one step per event-loop round, and
    none while a request is being answered.

    asyncio runs every callback that was ready when a round began: with N streams each
    holding a backlog, a round would apply a batch of every stream before a query's next
    step. Here a stream queues for its ``turn``, and one queued stream goes per round, so a
    query waits about one step per round whatever the number of busy streams. Whoever takes
    a turn keeps its step to about ``step_now()`` (``ServiceManager`` applies a batch in
    steps): ``step_s``, or the shorter ``queried_step_s`` while requests keep coming.

    A request takes a few rounds from its first bytes to its answer, and each round would
    hold a step: the HTTP side reports requests (``request_began`` / ``request_ended``) and
    turns wait until none is left, so a query waits for the one step already running at
    most. A turn waits ``defer_s`` at most: then turns stop waiting until no request is
    left (a slow client's body, or queries that never pause, cannot hold ingest back).
    """

    def __init__(
        self,
        step_s: float = 0.0005,
        defer_s: float = 0.002,
        queried_step_s: float = 0.0001,
        queried_for_s: float = 0.05,
    ) -> None:
        self.step_s = step_s
        self.queried_step_s = queried_step_s
        self.queried_for_s = queried_for_s
        self._last_request = -math.inf  # when the last request began (time.monotonic)
        self.defer_s = defer_s
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._releasing = False
        self._requests = 0  # being answered
        self._yielding = True  # turns wait for requests; off once one waited defer_s
        self._deferred: asyncio.TimerHandle | None = None  # a release waiting for them
        # told True when a request begins and no other is being answered, False when none
        # is left: the ingest thread waits meanwhile (conductor.ingest_thread)
        self.on_answering: Callable[[bool], None] | None = None
        # when a request last began elsewhere (time.monotonic): the query thread's, whose
        # queries wait for the step that holds their context (conductor.query_thread)
        self.last_request_elsewhere: Callable[[], float] | None = None

    async def turn(self) -> None:
        """Return in a later round, after the streams queued before this one."""
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._waiting.append(turn)
        if not self._releasing:
            self._releasing = True
            loop.call_soon(self._release_one)
        await turn  # cancelled: the release skips it

    @property
    def requests(self) -> int:
        """Requests being answered."""
        return self._requests

    @property
    def queried(self) -> bool:
        """A request began within ``queried_for_s``, here or elsewhere: queries are coming,
        keep steps short. (Asked at every ingest step: the clock is read directly, not
        through the running loop, whose lookup costs more than the rest of this.)"""
        last = self._last_request
        if self.last_request_elsewhere is not None:
            last = max(last, self.last_request_elsewhere())
        return time.monotonic() - last < self.queried_for_s

    def step_now(self) -> float:
        """How long a step may take now: at most ``queried_step_s`` while queries come (a
        query waits for the step running when it arrives), else ``step_s`` (fewer turns)."""
        return min(self.step_s, self.queried_step_s) if self.queried else self.step_s

    def request_began(self) -> None:
        self._requests += 1
        self._last_request = time.monotonic()
        if self._requests == 1 and self.on_answering is not None:
            self.on_answering(True)

    def request_ended(self) -> None:
        self._requests -= 1
        if self._requests:
            return
        if self.on_answering is not None:
            self.on_answering(False)
        self._yielding = True
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
            asyncio.get_running_loop().call_soon(self._release_one)

    def _release_one(self, waited: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if waited:
            self._yielding = False
        elif self._requests and self._yielding:
            self._deferred = loop.call_later(self.defer_s, self._release_one, True)
            return
        self._deferred = None
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                break
        if self._waiting:
            loop.call_soon(self._release_one)
        else:
            self._releasing = False
