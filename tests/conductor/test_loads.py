"""``POST /loads``: what each router replica has queued on each instance; a ``/query``
naming its replica is answered with the other replicas' loads on the query's instances."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from conductor.loads import (
    DEFAULT_WAIT_S,
    LEASE_HEADER,
    LOADS_HEADER,
    MAX_HEADER_BYTES,
    OTHERS_HEADER,
    REPLICA_HEADER,
    LoadReport,
    ReplicaLoads,
    TooManyReplicas,
    loads_header,
)
from tests.support.api import metric, post, register_and_connect

ALL = {"a", "b", "c"}


def report(
    replica: str, ttl_s: float = 3.0, decided: tuple[int, ...] = (), **instances: tuple[int, int]
) -> LoadReport:
    return LoadReport.model_validate(
        {
            "replica": replica,
            "ttl_s": ttl_s,
            "decided": list(decided),
            "instances": {
                name: {"queued_prefill_tokens": queued, "in_flight": in_flight}
                for name, (queued, in_flight) in instances.items()
            },
        }
    )


def test_a_replica_sees_the_sum_of_the_others_and_never_its_own() -> None:
    loads = ReplicaLoads()
    loads.report(report("r1", a=(100, 1), b=(0, 2)))
    loads.report(report("r2", a=(50, 1)))
    loads.report(report("r3", c=(7, 1)))
    assert loads.others("r1", ALL) == {"a": (50, 1), "c": (7, 1)}
    assert loads.others("r2", ALL) == {"a": (100, 1), "b": (0, 2), "c": (7, 1)}
    assert loads.others("r9", {"a"}) == {"a": (150, 2)}  # only the query's instances
    loads.report(report("r1", b=(10, 1)))  # a report replaces the replica's last one
    assert loads.others("r2", ALL) == {"b": (10, 1), "c": (7, 1)}
    loads.report(report("r1"))  # idle: nothing of it counts
    assert loads.others("r2", ALL) == {"c": (7, 1)}


def test_a_report_counts_for_its_time_only() -> None:
    now = [0.0]
    loads = ReplicaLoads(clock=lambda: now[0])
    loads.report(report("r1", ttl_s=1.0, a=(100, 1)))
    loads.report(report("r2", ttl_s=5.0, a=(1, 1)))
    now[0] = 2.0
    assert loads.others("x", ALL) == {"a": (1, 1)}
    assert len(loads) == 1


def test_past_the_cap_a_new_replica_is_refused_until_one_expires() -> None:
    now = [0.0]
    loads = ReplicaLoads(max_replicas=2, clock=lambda: now[0])
    loads.report(report("r1", ttl_s=1.0))
    loads.report(report("r2", ttl_s=9.0))
    with pytest.raises(TooManyReplicas, match="2 router replicas report loads already"):
        loads.report(report("r3"))
    loads.report(report("r2", a=(1, 1)))  # a known one still reports
    now[0] = 1.5
    loads.report(report("r3"))


def test_the_header_lists_the_most_queued_first_within_its_size() -> None:
    assert json.loads(loads_header({"a": (1, 1), "b": (5, 0)})) == {"a": [1, 1], "b": [5, 0]}
    assert list(json.loads(loads_header({"a": (1, 1), "b": (5, 0)}))) == ["b", "a"]
    many = {f"instance-{'x' * 200}-{i}": (i, 1) for i in range(100)}
    header = loads_header(many)
    assert len(header) <= MAX_HEADER_BYTES
    listed = json.loads(header)
    assert 0 < len(listed) < 100 and f"instance-{'x' * 200}-99" in listed
    assert loads_header({"é\n": (1, 1)}).isascii()


async def test_a_query_waits_for_another_replicas_decision_on_its_model() -> None:
    """A's query took lease 7 on model m: B's query on m waits until A reports lease 7
    decided, then sees A's decision; A's own next query and B's on another model do not."""
    loads = ReplicaLoads()
    loop = asyncio.get_running_loop()
    await loads.decide("a", "m", 7)
    await asyncio.wait_for(loads.decide("a", "m", 8), DEFAULT_WAIT_S / 2)  # its own: no wait
    await asyncio.wait_for(loads.decide("b", "other", 1), DEFAULT_WAIT_S / 2)
    waiting = asyncio.create_task(loads.decide("b", "m", 1))
    await asyncio.sleep(0)
    loads.report(report("a", decided=(1,), x=(10, 1)))  # another lease: still waiting
    await asyncio.sleep(0)
    assert not waiting.done()
    loads.report(report("a", decided=(7, 8), x=(20, 2)))
    await asyncio.wait_for(waiting, DEFAULT_WAIT_S / 2)
    assert loads.others("b", {"x"}) == {"x": (20, 2)}
    assert (loads.waits, loads.wait_timeouts) == (1, 0)

    started = loop.time()  # b's lease 1 is unreported: a waits for it, at most DEFAULT_WAIT_S
    await loads.decide("a", "m", 9)
    assert DEFAULT_WAIT_S * 0.9 <= loop.time() - started < DEFAULT_WAIT_S * 5
    assert (loads.waits, loads.wait_timeouts) == (2, 1)


async def test_a_query_without_a_lease_number_takes_none() -> None:
    loads = ReplicaLoads()
    await loads.decide("a", "m", None)
    await asyncio.wait_for(loads.decide("b", "m", None), DEFAULT_WAIT_S / 2)
    assert loads.waits == 0


def load_body(replica: Any, **instances: Any) -> dict[str, Any]:
    return {"replica": replica, "instances": instances}


async def query_loads(
    http: aiohttp.ClientSession, base: str, replica: str | None
) -> dict[str, Any] | None:
    headers = {} if replica is None else {REPLICA_HEADER: replica}
    body = {"model": "m", "block_size": 4, "token_ids": list(range(8))}
    async with http.post(f"{base}/query", json=body, headers=headers) as response:
        assert response.status == 200
        header = response.headers.get(LOADS_HEADER)
        return None if header is None else json.loads(header)


async def test_queries_naming_a_replica_carry_the_others_loads(served, http, publisher_factory):
    base = served.url
    for name in ("a", "b"):
        await register_and_connect(http, base, publisher_factory(), name)
    one = {"queued_prefill_tokens": 300, "in_flight": 2}
    status, answer = await post(http, f"{base}/loads", load_body("r1", a=one, ghost=one))
    assert (status, answer) == (200, {"status": "recorded", "replicas": 1})
    two = {"queued_prefill_tokens": 20, "in_flight": 1}
    assert (await post(http, f"{base}/loads", load_body("r2", a=two, b=two)))[0] == 200

    assert await query_loads(http, base, None) is None  # not asked: not answered
    assert await query_loads(http, base, "r1") == {"a": [20, 1], "b": [20, 1]}
    # an instance not of the query's context ("ghost") is left out
    assert await query_loads(http, base, "r2") == {"a": [300, 2]}
    assert await query_loads(http, base, "r3") == {"a": [320, 3], "b": [20, 1]}
    assert await metric(http, base, "conductor_router_replicas") == 2
    others = {}
    for replica in ("r1", "r2", "r3"):
        headers = {REPLICA_HEADER: replica}
        body = {"model": "m", "block_size": 4, "token_ids": list(range(8))}
        async with http.post(f"{base}/query", json=body, headers=headers) as response:
            others[replica] = response.headers[OTHERS_HEADER]
    assert others == {"r1": "1", "r2": "1", "r3": "2"}  # r3 has not reported

    body = {"model": "m", "block_size": 4, "token_ids": list(range(8))}
    for bad in ("-1", "x", "1.5", "٣", str(1 << 63)):
        headers = {REPLICA_HEADER: "r1", LEASE_HEADER: bad}
        async with http.post(f"{base}/query", json=body, headers=headers) as response:
            assert response.status == 400, bad
            assert LEASE_HEADER in (await response.json())["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (load_body(""), "replica"),
        (load_body(7), "replica"),
        (load_body("r", a={"queued_prefill_tokens": -1, "in_flight": 0}), "queued_prefill_tokens"),
        (load_body("r", a={"queued_prefill_tokens": "9", "in_flight": 0}), "queued_prefill_tokens"),
        (load_body("r", a={"queued_prefill_tokens": 1}), "in_flight"),
        (load_body("r", a=[1, 2]), "instances"),
        ({"replica": "r", "ttl_s": 0}, "ttl_s"),
        ({"replica": "r", "ttl_s": 61}, "ttl_s"),
    ],
)
async def test_a_malformed_report_is_a_400_naming_its_field(served, http, body, field):
    status, answer = await post(http, f"{served.url}/loads", body)
    assert status == 400, answer
    assert field in json.dumps(answer)
    assert await metric(http, served.url, "conductor_router_replicas") == 0
