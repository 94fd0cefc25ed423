"""Admission (router/admission.py): token buckets, priority gates, per-key and per-model
limits, 429s with Retry-After, and the fairness the limits exist for. Real time, small
bounds: every wait here is well under a second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from router.admission import Admission, PriorityGate, RateLimited, TokenBucket
from router.keys import ClientKey, KeyLimits

MODEL = "m1"


class ManualClock:
    """A clock the test moves: the bucket's arithmetic without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key(key_id: str, **limits: Any) -> ClientKey:
    return ClientKey(id=key_id, limits=KeyLimits(**limits))


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def admission(registry: CollectorRegistry) -> Admission:
    return Admission(registry)


async def refusal(attempt: Awaitable[object]) -> RateLimited:
    with pytest.raises(RateLimited) as refused:
        await asyncio.wait_for(attempt, 2.0)
    return refused.value


async def admit_once(admission: Admission, client: ClientKey, priority: int = 1) -> None:
    async with admission.admit(client, MODEL, priority):
        pass


class Holder:
    """Admitted requests held open until the test lets them go."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._go = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def hold(self, client: ClientKey, count: int = 1) -> None:
        """Starts ``count`` requests and returns once they are admitted."""
        admitted = [asyncio.Event() for _ in range(count)]
        self.tasks += [asyncio.create_task(self._held(client, e)) for e in admitted]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in admitted)), 2.0)

    async def _held(self, client: ClientKey, admitted: asyncio.Event) -> None:
        async with self._admission.admit(client, MODEL, 1):
            admitted.set()
            await self._go.wait()

    async def let_go(self) -> None:
        self._go.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 2.0)


# -- the token bucket ----------------------------------------------------------------------
def test_bucket_starts_full_and_refills_at_its_rate() -> None:
    clock = ManualClock()
    bucket = TokenBucket(rate=10, burst=20, clock=clock)
    assert bucket.wait_for(20) == 0
    bucket.take(20)
    assert bucket.wait_for(1) == pytest.approx(0.1)
    assert bucket.wait_for(15) == pytest.approx(1.5)
    clock.now += 0.5
    assert bucket.level() == pytest.approx(5)
    clock.now += 60  # saves up no more than its burst
    assert bucket.level() == 20


def test_bucket_take_past_the_level_is_a_debt_repaid_at_the_rate() -> None:
    clock = ManualClock()
    bucket = TokenBucket(rate=10, burst=20, clock=clock)
    assert bucket.wait_for(50) == 0  # larger than the burst: a full bucket is enough
    bucket.take(50)
    assert bucket.level() == -30
    assert bucket.wait_for(1) == pytest.approx(3.1)
    bucket.take(1)  # a reservation: the next one waits behind it
    assert bucket.wait_for(1) == pytest.approx(3.2)
    bucket.give_back(1)
    assert bucket.wait_for(1) == pytest.approx(3.1)
    clock.now += 3.1
    assert bucket.wait_for(1) == pytest.approx(0)


# -- the priority gate ---------------------------------------------------------------------
async def test_gate_serves_by_priority_then_arrival(admission: Admission) -> None:
    client = key("a", max_concurrent=1, max_queued=10)
    holder = Holder(admission)
    await holder.hold(client)
    served: list[str] = []

    async def wait(name: str, priority: int) -> None:
        async with admission.admit(client, MODEL, priority):
            served.append(name)

    waiters = []
    for name, priority in (("batch", 2), ("first", 0), ("standard", 1), ("second", 0)):
        waiters.append(asyncio.create_task(wait(name, priority)))
        await asyncio.sleep(0)  # queued in this order
    await holder.let_go()
    await asyncio.wait_for(asyncio.gather(*waiters), 2.0)
    assert served == ["first", "second", "standard", "batch"]


async def test_gate_waiter_handed_a_slot_then_cancelled_passes_it_on() -> None:
    gate = PriorityGate(1)
    assert gate.try_take()
    first = asyncio.create_task(gate.wait(0, 2.0))
    second = asyncio.create_task(gate.wait(0, 2.0))
    await asyncio.sleep(0)
    gate.release()  # goes to ``first``, which is cancelled before it runs
    first.cancel()
    assert await asyncio.wait_for(second, 2.0) is True
    assert gate.in_use == 1
    gate.release()
    assert gate.in_use == 0
    assert gate.try_take()


async def test_cancelled_waiters_leak_nothing(
    admission: Admission, registry: CollectorRegistry
) -> None:
    client = key("a", max_concurrent=1, max_queued=3)
    holder = Holder(admission)
    await holder.hold(client)
    waiters = [asyncio.create_task(admit_once(admission, client)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert sample(registry, "router_admission_queued", model="unregistered") == 3
    for waiter in waiters[:2]:
        waiter.cancel()
    await asyncio.gather(*waiters[:2], return_exceptions=True)
    await holder.let_go()
    await asyncio.wait_for(waiters[2], 2.0)
    assert sample(registry, "router_admission_queued", model="unregistered") == 0
    # the room and the slot are whole again: one held, three wait, the fifth is refused
    holder = Holder(admission)
    await holder.hold(client)
    waiters = [asyncio.create_task(admit_once(admission, client)) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert (await refusal(admit_once(admission, client))).reason == "queue_full"
    await holder.let_go()
    await asyncio.wait_for(asyncio.gather(*waiters), 2.0)


# -- the key's limits ----------------------------------------------------------------------
async def test_concurrency_without_waiting_room_is_refused_at_once(admission: Admission) -> None:
    client = key("acme-prod", max_concurrent=1)
    holder = Holder(admission)
    await holder.hold(client)
    refused = await refusal(admit_once(admission, client))
    assert (refused.status, refused.reason, refused.scope) == (429, "concurrency", "key")
    assert refused.message == (
        "Too many concurrent requests for key `acme-prod` (limit 1): try again in 1 s."
    )
    assert refused.headers == {"Retry-After": "1"}
    await holder.let_go()
    await admit_once(admission, client)


async def test_full_waiting_room_is_refused(admission: Admission) -> None:
    client = key("a", max_concurrent=1, max_queued=1)
    holder = Holder(admission)
    await holder.hold(client)
    waiter = asyncio.create_task(admit_once(admission, client))
    await asyncio.sleep(0.01)
    refused = await refusal(admit_once(admission, client))
    assert refused.reason == "queue_full"
    assert "and 1 requests wait already" in refused.message
    await holder.let_go()
    await asyncio.wait_for(waiter, 2.0)


async def test_a_wait_past_max_queue_seconds_is_refused(admission: Admission) -> None:
    client = key("a", max_concurrent=1, max_queued=4, max_queue_seconds=0.2)
    holder = Holder(admission)
    await holder.hold(client)
    started = time.monotonic()
    refused = await refusal(admit_once(admission, client))
    assert 0.15 < time.monotonic() - started < 1.0
    assert (refused.reason, refused.headers["Retry-After"]) == ("queue_timeout", "1")
    await holder.let_go()


@pytest.mark.parametrize(("rate", "retry_after"), [(2.0, "1"), (0.25, "4")])
async def test_request_rate_retry_after_is_the_wait_rounded_up(
    admission: Admission, rate: float, retry_after: str
) -> None:
    client = key("a", requests_per_second=rate, request_burst=1)
    await admit_once(admission, client)
    refused = await refusal(admit_once(admission, client))
    assert (refused.reason, refused.headers["Retry-After"]) == ("request_rate", retry_after)
    assert refused.retry_after_s == pytest.approx(1 / rate, rel=0.05)


async def test_request_rate_waits_within_the_budget(admission: Admission) -> None:
    client = key("a", requests_per_second=10, request_burst=1, max_queued=2)
    await admit_once(admission, client)
    async with admission.admit(client, MODEL, 1) as ticket:  # due in 0.1 s: waits
        assert 0.05 < ticket.queued_seconds < 0.5


async def test_refused_requests_take_nothing_from_the_rate(admission: Admission) -> None:
    client = key("a", max_concurrent=1, requests_per_second=1, request_burst=2)
    holder = Holder(admission)
    await holder.hold(client)
    for _ in range(3):
        assert (await refusal(admit_once(admission, client))).reason == "concurrency"
    await holder.let_go()
    await admit_once(admission, client)  # the burst's second request is still there


async def test_prompt_tokens_wait_within_the_budget_or_are_refused(
    admission: Admission,
) -> None:
    client = key("a", tokens_per_second=100, token_burst=100, max_queued=1, max_queue_seconds=0.5)
    async with admission.admit(client, MODEL, 1) as ticket:
        await ticket.charge_tokens(100)
        await ticket.charge_tokens(30)  # due in 0.3 s, within the budget
        assert 0.25 < ticket.queued_seconds < 0.8
        refused = await refusal(ticket.charge_tokens(1000))  # a full bucket: 1 s away
    assert (refused.reason, refused.headers["Retry-After"]) == ("token_rate", "1")
    assert refused.message.startswith(
        "Rate limit reached for key `a` on prompt tokens per second (100)"
    )


# -- the model's limits --------------------------------------------------------------------
async def test_model_gate_refuses_past_its_waiting_room(
    admission: Admission, registry: CollectorRegistry
) -> None:
    admission.register_model(MODEL, max_concurrent_requests=1, max_queued_requests=1)
    holder = Holder(admission)
    await holder.hold(key("a"))
    waiter = asyncio.create_task(admit_once(admission, key("b")))
    await asyncio.sleep(0.01)
    assert sample(registry, "router_admission_queued", model=MODEL) == 1
    refused = await refusal(admit_once(admission, key("c")))
    assert (refused.reason, refused.scope) == ("model_queue_full", "model")
    assert refused.message == (
        "Too many concurrent requests for model `m1` (limit 1), and 1 requests wait already: "
        "try again in 1 s."
    )
    await holder.let_go()
    await asyncio.wait_for(waiter, 2.0)


async def test_a_refusal_answers_like_openai_over_http(
    admission: Admission, http: aiohttp.ClientSession
) -> None:
    """A refusal as a client receives it: the router's handlers answer ``error.response()``
    for every ``ApiError`` (router/app.py)."""
    client = key("a", requests_per_second=0.4, request_burst=1)

    async def completions(request: web.Request) -> web.Response:
        try:
            async with admission.admit(client, MODEL, 1):
                return web.json_response({"ok": True})
        except RateLimited as refused:
            return refused.response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("/v1/completions"))
        async with http.post(url) as answer:
            assert answer.status == 200
        async with http.post(url) as answer:
            assert (answer.status, answer.headers["Retry-After"]) == (429, "3")
            assert await answer.json() == {
                "error": {
                    "message": "Rate limit reached for key `a` on requests per second (0.4): "
                    "try again in 3 s.",
                    "type": "RateLimitError",
                    "param": None,
                    "code": 429,
                }
            }


# -- fairness ------------------------------------------------------------------------------
async def burst_beside_probes(
    admission: Admission, burster: ClientKey
) -> tuple[list[RateLimited | None], list[float]]:
    """Twenty requests of ``burster`` at once, each held 0.2 s, while another key sends five
    one after another: the burst's outcomes and the other key's admission times."""
    admission.register_model(MODEL, max_concurrent_requests=4, max_queued_requests=64)

    async def burst_request() -> RateLimited | None:
        try:
            async with admission.admit(burster, MODEL, 1):
                await asyncio.sleep(0.2)
        except RateLimited as refused:
            return refused
        return None

    burst = [asyncio.create_task(burst_request()) for _ in range(20)]
    await asyncio.sleep(0.01)
    latencies = []
    for _ in range(5):
        started = time.monotonic()
        async with admission.admit(key("quiet"), MODEL, 1):
            latencies.append(time.monotonic() - started)
            await asyncio.sleep(0.01)
    return await asyncio.wait_for(asyncio.gather(*burst), 3.0), latencies


async def test_a_bursting_key_is_refused_while_another_is_served_at_once(
    admission: Admission, registry: CollectorRegistry
) -> None:
    burster = key("loud", max_concurrent=2, max_queued=2, max_queue_seconds=1.0)
    outcomes, latencies = await burst_beside_probes(admission, burster)
    refusals = [outcome for outcome in outcomes if outcome is not None]
    assert len(refusals) == 16
    assert {r.reason for r in refusals} == {"queue_full"}
    assert all(r.headers["Retry-After"] == "1" for r in refusals)
    assert max(latencies) < 0.05
    requests = "router_admission_requests_total"
    assert sample(registry, requests, key="loud", model=MODEL, outcome="admitted") == 4
    assert sample(registry, requests, key="loud", model=MODEL, outcome="rejected") == 16
    rejections = "router_admission_rejections_total"
    assert sample(registry, rejections, reason="queue_full", scope="key") == 16
    assert sample(registry, "router_admission_queue_seconds_count", key="loud", model=MODEL) == 4


async def test_without_key_limits_a_burst_holds_the_model_up(admission: Admission) -> None:
    """The control: the same burst from a key without limits takes the model's slots."""
    outcomes, latencies = await burst_beside_probes(admission, key("loud"))
    assert outcomes == [None] * 20
    assert latencies[0] > 0.15


async def test_a_thousand_keys_admit_quickly(admission: Admission) -> None:
    admission.register_model(MODEL, max_concurrent_requests=64)
    # a burst of 2 each: the rates are looked at, never binding, however fast this runs
    clients = [
        key(f"k{i}", max_concurrent=2, requests_per_second=100, request_burst=2)
        for i in range(1000)
    ]
    started = time.monotonic()
    for client in clients * 2:
        await admit_once(admission, client)
    assert time.monotonic() - started < 2.0


async def test_new_limits_count_from_the_keys_next_request(admission: Admission) -> None:
    holder = Holder(admission)
    await holder.hold(key("a", max_concurrent=1))
    assert (await refusal(admit_once(admission, key("a", max_concurrent=1)))).reason
    await admit_once(admission, key("a", max_concurrent=2))  # the reloaded key's limits
    await holder.let_go()
