"""conductor.lazy_timer: a deadline moved at every request, on the real event loop."""

from __future__ import annotations

import asyncio

from conductor.lazy_timer import LazyTimer


async def test_it_fires_once_at_the_last_deadline_without_a_new_timer_for_a_later_one():
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    timer = LazyTimer(lambda: fired.append(loop.time()))
    start = loop.time()
    timer.arm(0.5)
    first = timer._handle
    for _ in range(5):  # requests, each moving the deadline later, before it passed
        await asyncio.sleep(0.005)
        timer.arm(0.5)
        assert timer._handle is first  # no new loop timer
    moved = loop.time()
    await asyncio.sleep(0.8)
    assert len(fired) == 1
    assert fired[0] - start >= moved - start + 0.5 - 0.002  # the last deadline, not the first


async def test_an_earlier_deadline_replaces_the_timer_and_disarm_stops_it():
    loop = asyncio.get_running_loop()
    fired: list[str] = []
    timer = LazyTimer(lambda: fired.append("fired"))
    timer.arm(10)
    timer.arm(0.01)  # a body's timeout, shorter than the keep-alive's
    await asyncio.sleep(0.05)
    assert fired == ["fired"] and not timer.armed
    timer.arm(0.01)
    timer.disarm()
    await asyncio.sleep(0.05)
    assert fired == ["fired"]
    timer.arm(10)
    timer.close()
    assert timer._handle is None and loop.is_running()
