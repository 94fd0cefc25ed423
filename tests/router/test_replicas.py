"""Router replicas share what they route through the conductor they ask (``/routed``): a
burst of requests sharing a new prefix, spread over two replicas, lands on one engine
before any of its events could be indexed; without the sharing the replicas split it.
They share their load too (``/loads``): a replica prices the queue another one left on an
engine. A replica whose conductor cannot be reached routes on its own and says so."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from tests.router.inprocess import ServedRouter
from tests.router.sim_fleet import Fleet, complete
from tests.router.test_router_service import indexed_everywhere, metric
from tests.support.api import eventually, get
from tests.support.processes import ConductorProcess

ENGINES = ["a", "b", "c"]
PREFIX = " ".join(f"w{i}" for i in range(400))  # new to every engine
SLOW = 40.0  # the engines' time scale: a prefill of the prefix takes seconds


async def replicas(fleet: Fleet, serve: Any, http: aiohttp.ClientSession, **conductor: Any):
    """Two router replicas in front of slow engines, the second having routed one request
    already (so that, on their own, their first choices among equal engines differ). The
    longest prefix wins: one router alone keeps such a burst on one engine (``ttft`` may
    spread it, weighing the queue the first request left against its prefix)."""
    for name in ENGINES:
        fleet.engine(name, time_scale=SLOW)
    config = fleet.config(ENGINES, policy="max_prefix")
    config["conductor"] |= conductor
    routers = [await serve(config), await serve(config)]
    await indexed_everywhere(http, fleet, ENGINES)
    assert (await complete(http, routers[1], "hi", max_tokens=1))[0] == 200
    return routers


async def burst(http: aiohttp.ClientSession, routers: list[ServedRouter], size: int) -> list[str]:
    """The engine each request of a burst sharing ``PREFIX`` went to: the first request
    alone, then the others at once, alternately to each replica."""

    async def send(i: int) -> str:
        status, headers, _ = await complete(
            http, routers[i % 2], f"{PREFIX} question {i}", max_tokens=1
        )
        assert status == 200
        return headers["x-conductor-prefill-instance"]

    first = asyncio.create_task(send(0))
    await asyncio.sleep(0.3)  # routed and reported; its prefill takes seconds more
    rest = await asyncio.gather(*(send(i) for i in range(1, size)))
    return [await first, *rest]


async def test_a_burst_over_two_replicas_lands_on_one_engine(fleet, serve, http):
    routers = await replicas(fleet, serve, http)
    chosen = await burst(http, routers, 8)
    assert set(chosen) == {chosen[0]}, chosen
    assert await metric(http, routers[1], "router_routed_reports_total") >= 4
    assert await metric(http, fleet.conductor, "conductor_routed_raised_total") >= 4


async def test_without_sharing_the_replicas_split_the_burst(fleet, serve, http):
    routers = await replicas(fleet, serve, http, share_routed=False)
    chosen = await burst(http, routers, 8)
    assert len(set(chosen)) == 2, chosen  # each replica keeps to the engine it chose
    assert await metric(http, fleet.conductor, "conductor_routed_prompts") == 0


async def first_choices(
    fleet: Fleet, serve: Any, http: aiohttp.ClientSession, **conductor: Any
) -> tuple[str, str]:
    """Two fresh replicas (``ttft``), two idle engines: the engine of a long prompt sent
    to the first replica, and of another, as long, sent to the second while the first is
    still being prefilled. On its own each replica's first choice between equal engines
    is the same one."""
    for name in ENGINES[:2]:
        fleet.engine(name, time_scale=SLOW)
    config = fleet.config(ENGINES[:2])
    config["conductor"] |= conductor
    routers = [await serve(config), await serve(config)]
    await indexed_everywhere(http, fleet, ENGINES[:2])

    async def send(router: ServedRouter, text: str) -> str:
        status, headers, _ = await complete(http, router, text, max_tokens=1)
        assert status == 200
        return headers["x-conductor-prefill-instance"]

    first = asyncio.create_task(send(routers[0], PREFIX))
    await asyncio.sleep(0.3)  # sent and its load reported; its prefill takes seconds more
    second = await send(routers[1], PREFIX.replace("w", "v"))
    if conductor.get("share_load", True):
        assert await metric(http, routers[0], "router_load_reports_total") >= 1
    return await first, second


async def test_a_replica_prices_the_queue_another_one_left(fleet, serve, http):
    first, second = await first_choices(fleet, serve, http)
    assert first != second


async def test_without_sharing_load_a_replica_sees_only_its_own_queue(fleet, serve, http):
    first, second = await first_choices(fleet, serve, http, share_load=False)
    assert first == second


async def test_requests_reaching_both_replicas_at_once_are_spread(tmp_path, serve, http):
    """Two long prompts sent to two fresh replicas at the same instant: whichever query
    reaches the conductor second waits for the first's decision (its lease) and sees its
    queue, so they land on different engines, as one router would spread them. The wait's
    bound is raised so that a slow machine cannot make the test pass or fail by chance, and
    the routers' query timeout above it (at 0.5 s a query waiting for the other replica's
    report timed out on a loaded CI machine, and its router routed by load)."""
    fleet = Fleet(tmp_path, conductor_config={"replica_wait_s": 1.0})
    try:
        for name in ENGINES[:2]:
            fleet.engine(name, time_scale=SLOW)
        config = fleet.config(ENGINES[:2])
        config["conductor"]["query_timeout_seconds"] = 3.0
        routers = [await serve(config), await serve(config)]
        await indexed_everywhere(http, fleet, ENGINES[:2])

        async def send(router: ServedRouter, text: str) -> str:
            status, headers, _ = await complete(http, router, text, max_tokens=1)
            assert status == 200
            return headers["x-conductor-prefill-instance"]

        chosen = await asyncio.gather(
            send(routers[0], PREFIX), send(routers[1], PREFIX.replace("w", "v"))
        )
        assert chosen[0] != chosen[1], chosen  # with replica_wait_s 0: the same engine
        timeouts = "conductor_replica_decision_wait_timeouts_total"
        assert await metric(http, fleet.conductor, timeouts) == 0
    finally:
        fleet.stop()


async def test_a_router_alone_reports_its_load_only_to_stay_counted(fleet, serve, http):
    """Nobody reads a lone router's load: it renews its report (every third of its time)
    but does not send one per request; once another replica reports, the next query's
    answer says so and each change is reported again."""
    fleet.engine("a")
    config = fleet.config(["a"])
    config["conductor"]["share_load_ttl_seconds"] = 9.0  # renewals every 3 s
    served = await serve(config)
    await indexed_everywhere(http, fleet, ["a"])
    for i in range(10):
        assert (await complete(http, served, f"request {i} " * 8))[0] == 200
    sent = 'router_load_reports_total{outcome="sent"}'
    assert await metric(http, served, sent) <= 3  # the first ones, before it knew

    other = await serve(config)
    assert (await complete(http, other, "from the other one " * 8))[0] == 200
    before = await metric(http, served, sent)
    for i in range(5):
        assert (await complete(http, served, f"again {i} " * 8))[0] == 200
    assert await metric(http, served, sent) >= before + 5  # a report per request at least


async def test_a_replica_that_cannot_reach_its_conductor_routes_alone_and_says_so(
    fleet, serve, http
):
    fleet.engine("a")
    served = await serve(fleet.config(["a"]))
    await indexed_everywhere(http, fleet, ["a"])
    assert (await complete(http, served, "hi"))[0] == 200  # shorter than a block:
    assert await metric(http, served, "router_routed_reports_total") == 0  # nothing to share
    assert (await complete(http, served, "before it goes down " * 4))[0] == 200
    sharing = f'router_routed_sharing{{conductor="{fleet.conductor.url}"}}'
    assert await metric(http, served, sharing) == 1

    port = int(fleet.conductor.url.rsplit(":", 1)[1])
    fleet.conductor.stop()
    status, headers, _ = await complete(http, served, "while it is down " * 4)
    assert (status, headers["x-conductor-fallback"]) == (200, "conductor_unavailable")
    _, health = await eventually(
        lambda: get(http, f"{served.url}/health"),
        lambda answer: (
            any("does not take routed prompts" in r for r in answer[1]["reasons"])
            and any("does not take load reports" in r for r in answer[1]["reasons"])
        ),
    )
    assert health["status"] == "degraded"
    load_failed = f'router_load_reports_total{{conductor="{fleet.conductor.url}",outcome="failed"}}'
    assert await metric(http, served, load_failed) >= 1
    failed = f'router_routed_reports_total{{conductor="{fleet.conductor.url}",outcome="failed"}}'
    assert await metric(http, served, failed) >= 1
    assert await metric(http, served, sharing) == 0

    fleet.conductor = ConductorProcess(fleet.tmp_path, port=port)
    fleet.conductor.wait_ready()
    await eventually(
        lambda: get(http, f"{served.url}/health"), lambda answer: answer[1]["status"] == "ok"
    )
