"""A publisher endpoint that accepts connections and closes them at once (a crash-looping
engine, a port taken by another program): ZMQ resets its reconnect interval after every
connection it makes, so the conductor reconnected every 100 ms and logged a warning each
time. Now such connections are one fault: reconnects back off, one line is logged."""

from __future__ import annotations

import asyncio
import time

from conductor.subscriber import ConnectionFaults
from tests.support.api import eventually, get, matched, metric, post
from tests.support.wire_publisher import stored

LOST_LINE = "lost its publisher"


def test_short_connections_are_one_fault_told_once_with_a_doubling_wait() -> None:
    faults = ConnectionFaults(stable_s=2.0, min_delay_s=0.1, max_delay_s=1.0, summary_s=10.0)
    now = 0.0
    losses = []
    for _ in range(8):  # each connection closed 10 ms after it was made
        faults.connected(now)
        now += 0.01
        losses.append(faults.lost(now))
        now += losses[-1].delay_s
    assert [loss.first for loss in losses] == [True] + [False] * 7
    assert [loss.delay_s for loss in losses] == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert all(loss.untold == 0 for loss in losses)  # within summary_s: nothing more told
    faults.connected(now)
    summary = faults.lost(now + 10.0)  # ten seconds later: a summary of the fault so far
    assert (summary.first, summary.untold, summary.delay_s) == (False, 8, 0.0)
    assert faults.held() == 0  # a connection held: the fault is over, all of it told


def test_a_connection_that_held_ends_the_fault() -> None:
    faults = ConnectionFaults(stable_s=2.0, min_delay_s=0.1, max_delay_s=1.0, summary_s=60.0)
    faults.connected(0.0)
    assert faults.lost(0.01).first
    faults.connected(0.3)
    assert not faults.lost(0.31).first
    assert faults.held() == 1  # the one loss after the first was not told
    faults.connected(5.0)
    loss = faults.lost(10.0)  # a long connection ends: a new fault, ZMQ reconnects at once
    assert loss.first and loss.delay_s == 0.0


async def test_a_publisher_closing_every_connection_is_retried_with_backoff_and_logged_once(
    conductor, http, publisher_factory
):
    """... and once a real publisher takes the port, the stream connects and indexes."""
    accepted: list[float] = []

    async def accept_and_close(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(time.monotonic())
        writer.close()

    server = await asyncio.start_server(accept_and_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    body = {
        "endpoint": f"tcp://127.0.0.1:{port}",
        "type": "vLLM",
        "modelname": "m",
        "instance_id": "flapping",
        "block_size": 4,
    }
    try:
        status, answer = await post(http, f"{conductor.url}/register", body)
        assert status == 200, answer
        await asyncio.sleep(4.5)
    finally:
        server.close()
        await server.wait_closed()
    # ZMQ alone: a connection every 100 ms, ~45 of them, and as many warnings
    assert 3 <= len(accepted) <= 8, accepted
    gaps = [later - earlier for earlier, later in zip(accepted, accepted[1:], strict=False)]
    assert gaps[-1] > 2 * gaps[0] and gaps[-1] >= 0.7, gaps
    lost_lines = [line for line in conductor.log().splitlines() if LOST_LINE in line]
    assert 1 <= len(lost_lines) <= 2, lost_lines
    disconnects = await metric(http, conductor.url, "conductor_publisher_disconnects_total")
    assert len(accepted) - 1 <= disconnects <= len(accepted)  # every loss is counted

    publisher = publisher_factory(port, with_replay=False)
    await eventually(lambda: state_of(http, conductor.url), lambda s: s == "connected", 8)
    await asyncio.sleep(0.1)  # the subscription travels after the TCP connect
    await publisher.publish([stored([1], [1, 2, 3, 4])])
    await eventually(lambda: matched(http, conductor.url, [1, 2, 3, 4], "flapping"), bool)
    await eventually(lambda: held_line(conductor), bool, timeout=4)


async def state_of(http, base: str) -> str:
    _, services = await get(http, f"{base}/services")
    return services["services"][0]["State"]


async def held_line(conductor) -> bool:
    return "connection to its publisher holds again" in conductor.log()
