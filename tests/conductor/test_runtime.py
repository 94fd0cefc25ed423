"""The shared runtime guards: loop-lag measurement, supervised tasks, common flags, the
stop signals of a command that is starting."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import time

import pytest
from prometheus_client import CollectorRegistry, Counter

from conductor.runtime import (
    STOP_SIGNALS,
    GcPauseMonitor,
    LoopLagMonitor,
    LoopShare,
    SupervisedTask,
    add_common_flags,
    log_level,
    run,
)


async def test_loop_lag_sees_a_blocking_callback() -> None:
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, "test", interval=0.01)
    monitor.start()
    await asyncio.sleep(0.05)
    time.sleep(0.2)  # holds the loop
    await asyncio.sleep(0.05)
    await monitor.stop()
    assert 0.15 < monitor.worst < 1.0
    assert registry.get_sample_value("test_event_loop_lag_seconds_count") >= 3


async def test_a_failing_task_is_logged_counted_and_restarted(caplog) -> None:
    registry = CollectorRegistry()
    failures = Counter("failures", "x", ["task"], registry=registry)
    runs = []
    states = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError(f"boom {len(runs)}")
        await asyncio.sleep(3600)

    task = SupervisedTask("flaky", flaky, failures, min_backoff=0.01, on_state=states.append)
    task.start()
    for _ in range(200):
        if len(runs) == 3:
            break
        await asyncio.sleep(0.01)
    assert len(runs) == 3 and task.state == "running"
    assert registry.get_sample_value("failures_total", {"task": "flaky"}) == 2
    assert task.last_error == "RuntimeError: boom 2"
    assert "task=flaky failed" in caplog.text
    await task.stop()
    assert states == ["running", "failed", "running", "failed", "running", "stopped"]


def test_log_levels_and_version() -> None:
    assert log_level("warn") == "WARNING" and log_level("debug") == "DEBUG"
    with pytest.raises(argparse.ArgumentTypeError, match="verbose"):
        log_level("verbose")
    parser = argparse.ArgumentParser(prog="x")
    add_common_flags(parser, "NO_SUCH_ENV_VAR_FOR_TEST")
    assert parser.parse_args([]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "verbose"])


async def test_loop_share_lets_one_step_go_per_round_in_turn():
    """Busy streams take turns, one step per event-loop round, so work that became ready
    meanwhile (a query's next step) runs after at most one of their steps."""
    share = LoopShare()
    order: list[str] = []

    async def stream(name: str) -> None:
        for step in range(3):
            await share.turn()
            order.append(f"{name}{step}")

    async def query() -> None:
        for step in range(3):
            order.append(f"q{step}")
            await asyncio.sleep(0)  # one round per step, as an HTTP request's steps take

    await asyncio.wait_for(asyncio.gather(stream("a"), stream("b"), stream("c"), query()), 5)
    streams = [step for step in order if not step.startswith("q")]
    assert streams == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]  # round robin
    for q in ("q1", "q2"):  # one stream step at most between two steps of the query
        before = order[order.index(q) - 2 : order.index(q)]
        assert sum(not step.startswith("q") for step in before) <= 1, order


async def test_loop_share_survives_a_cancelled_waiter():
    share = LoopShare()
    waiters = [asyncio.create_task(share.turn()) for _ in range(3)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    done, pending = await asyncio.wait(waiters[1:], timeout=1)
    assert not pending and all(task.exception() is None for task in done)


def test_gc_pauses_are_timed_per_generation_and_a_slow_one_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    monitor = GcPauseMonitor(registry, "test", warn_s=0.0)
    monitor.start()
    try:
        with caplog.at_level(logging.WARNING, "conductor.runtime"):
            gc.collect(2)
    finally:
        monitor.stop()
    assert monitor._callback not in gc.callbacks
    count = registry.get_sample_value("test_gc_pause_seconds_count", {"generation": "2"})
    paused = registry.get_sample_value("test_gc_pause_seconds_sum", {"generation": "2"})
    assert count == 1 and paused is not None and paused > 0
    assert "garbage collection of generation 2 paused" in caplog.text
    gc.collect(2)  # stopped: not counted
    assert registry.get_sample_value("test_gc_pause_seconds_count", {"generation": "2"}) == 1


async def rounds(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_loop_share_turns_wait_while_a_request_is_answered():
    """A query's rounds run without ingest steps between them: a turn asked for while a
    request is being answered is given once no request is left."""
    share = LoopShare(defer_s=10)
    share.request_began()
    share.request_began()
    turn = asyncio.create_task(share.turn())
    await rounds(20)
    share.request_ended()
    await rounds(20)
    assert not turn.done() and share.requests == 1
    share.request_ended()
    await asyncio.wait_for(turn, 1)
    assert share.requests == 0


async def test_loop_share_waits_for_requests_defer_s_at_most_then_until_none_is_left():
    """A request that never ends (a slow client's body) holds ingest back once, for defer_s;
    then turns stop waiting until no request is left, and wait again after that."""
    share = LoopShare(defer_s=0.05)
    share.request_began()
    began = time.monotonic()
    await asyncio.wait_for(share.turn(), 1)
    assert time.monotonic() - began >= 0.05
    began = time.monotonic()
    for _ in range(5):  # no longer waiting for the request still open
        await asyncio.wait_for(share.turn(), 1)
    assert time.monotonic() - began < 0.05
    share.request_ended()
    share.request_began()
    turn = asyncio.create_task(share.turn())
    await rounds(20)
    assert not turn.done()  # a new request: turns wait again
    share.request_ended()
    await asyncio.wait_for(turn, 1)


async def test_loop_share_keeps_steps_short_while_queries_come():
    """A query waits for the step running when it arrives: while requests keep coming,
    steps are ``queried_step_s`` long; a while after the last one, ``step_s`` again."""
    share = LoopShare(step_s=0.0005, queried_step_s=0.0001, queried_for_s=0.05)
    assert not share.queried and share.step_now() == 0.0005
    share.request_began()
    share.request_ended()
    assert share.queried and share.step_now() == 0.0001
    await asyncio.sleep(0.06)
    assert not share.queried and share.step_now() == 0.0005


def test_loop_share_keeps_steps_short_while_queries_come_elsewhere():
    """The query thread's queries wait for the step that holds their context too."""
    share = LoopShare(step_s=0.0005, queried_step_s=0.0001, queried_for_s=0.05)
    last = [0.0]
    share.last_request_elsewhere = lambda: last[0]
    assert not share.queried
    last[0] = time.monotonic()
    assert share.queried and share.step_now() == 0.0001
    last[0] -= 0.06
    assert not share.queried


@pytest.mark.parametrize("signum", STOP_SIGNALS, ids=lambda signum: signum.name)
def test_a_stop_signal_before_a_commands_own_handlers_stops_it(signum) -> None:
    """Started with SIGINT ignored (as a shell starts a background job), a command whose
    port is open but whose loop handlers are not yet in place still stops when told,
    with exit code 0, and the previous handlers are back after."""

    async def starting() -> str:
        os.kill(os.getpid(), signum)
        await asyncio.sleep(5)
        return "the signal was lost"

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(SystemExit) as stopped:
            run(starting())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped.value.code == 0
