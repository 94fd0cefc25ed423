"""The prefill work router replicas have queued on each instance, shared through the
conductor they all ask.

A router prices an instance's queue from the requests it sent there itself (the uncached
prompt tokens not yet prefilled, the requests not yet finished). Behind a load balancer
each of N replicas sees about 1/N of the queue it adds to and sends work to instances it
believes idle. So each replica reports its own load per instance (``POST /loads``: the
whole of it, every time it changes and at least every third of ``ttl_s``), and a ``/query``
that names its replica (``REPLICA_HEADER``) is answered, in ``LOADS_HEADER``, with the sum
of the *other* replicas' loads on the query's instances, and in ``OTHERS_HEADER`` with
how many others report (none: a router alone need not report each change). A report
counts for its ``ttl_s``: a replica that stops reporting (stopped, or cut off) stops
counting.

However fast a report travels, replicas that decide at the same instant do not see each
other's decisions: a burst of requests reaching every replica at once lands on the engine
each believes idle, the same one (bench/results/trace-replay.md: any lag at all cost the
conversation trace 1.3x mean TTFT in simulation, none cost nothing). So a query that names
its replica takes a *decision lease* on its model (numbered by the replica,
``LEASE_HEADER``): until a report of that replica lists the number among its ``decided``
(the decision is in its load) or the lease expires, another replica's query on the model
waits, at most ``max_wait_s`` (the ``replica_wait_s`` setting), and then sees the
decision. A replica never waits for its own leases (it knows its own decisions).
Decisions on one model are thus taken one after another across replicas, each a round
trip apart (~1 ms on one host), and a waiting query answers at the bound anyway: under
more concurrency than that, replicas fall back to seeing each other a report late.

Memory and time are bounded: at most ``MAX_REPLICAS`` replicas and ``MAX_INSTANCES`` instances
per report (the whole load of a replica in a few kB); an answer adds each replica's
instances (a few per query), lists the most loaded first and fits in ``MAX_HEADER_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Collection, Container
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from .config import StrictModel

REPLICA_HEADER = "X-Conductor-Replica"  # a query's: the router replica asking
LEASE_HEADER = "X-Conductor-Replica-Lease"  # a query's: its decision's number at the replica
LOADS_HEADER = "X-Conductor-Replica-Loads"  # the answer's: the other replicas' loads
OTHERS_HEADER = "X-Conductor-Other-Replicas"  # the answer's: how many others report
DEFAULT_TTL_S = 3.0
MAX_TTL_S = 60.0
MAX_REPLICAS = 256
MAX_INSTANCES = 4096  # per report
MAX_REPLICA_CHARS = 256
MAX_HEADER_BYTES = 6144  # well under a client's 8 KiB header line
MAX_QUEUED_TOKENS = 1 << 40
MAX_IN_FLIGHT = 1_000_000
MAX_LEASE_NUMBER = (1 << 63) - 1
DEFAULT_WAIT_S = 0.01  # a query waits at most this long for other replicas' decisions
LEASE_S = 0.02  # a decision lease ends at its replica's report, or after this (or 2 waits)
MAX_LEASED_MODELS = 1024  # past it, expired leases are swept before a new one


class InstanceLoad(StrictModel):
    """One instance as a replica loads it: uncached prompt tokens sent and not prefilled
    yet, requests sent and not finished."""

    queued_prefill_tokens: int = Field(ge=0, le=MAX_QUEUED_TOKENS)
    in_flight: int = Field(ge=0, le=MAX_IN_FLIGHT)


class LoadReport(StrictModel):
    """``POST /loads``: a replica's whole load (instances it does not list carry none)."""

    replica: str = Field(min_length=1, max_length=MAX_REPLICA_CHARS)
    ttl_s: float = Field(default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S, allow_inf_nan=False)
    instances: dict[str, InstanceLoad] = Field(default_factory=dict, max_length=MAX_INSTANCES)
    # the leases whose decisions this load includes (their queries' LEASE_HEADER numbers)
    decided: list[Annotated[int, Field(ge=0, le=MAX_LEASE_NUMBER)]] = Field(
        default_factory=list, max_length=MAX_INSTANCES
    )


class TooManyReplicas(Exception):
    """A new replica's report while ``MAX_REPLICAS`` others still count."""


@dataclass(slots=True)
class _Held:
    loads: dict[str, tuple[int, int]]  # instance -> (queued prefill tokens, in flight)
    expires: float


@dataclass(slots=True)
class _Lease:
    """A replica between a query on a model and the report of its decision."""

    replica: str
    number: int
    until: float
    reported: asyncio.Event


class ReplicaLoads:
    """Each replica's last report, until its time is over; the decision leases."""

    def __init__(
        self,
        max_replicas: int = MAX_REPLICAS,
        max_wait_s: float = DEFAULT_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_replicas = max_replicas
        self.max_wait_s = max_wait_s
        self._lease_s = max(LEASE_S, 2 * max_wait_s)
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._leases: dict[str, list[_Lease]] = {}  # model -> leases, oldest first
        self.waits = 0  # queries that waited for another replica's decision
        self.wait_timeouts = 0  # ... and answered at max_wait_s without it
        self.wait_seconds = 0.0

    async def decide(self, replica: str, model: str, number: int | None) -> None:
        """Wait (at most ``max_wait_s``) until no other replica holds a decision lease on
        ``model``, then take lease ``number`` (None: none) until the replica reports it."""
        if self.try_decide(replica, model, number):
            return
        deadline = self._clock() + self.max_wait_s
        waited = False
        while True:
            now = self._clock()
            leases, others = self._leases_now(replica, model, now)
            if not others or now >= deadline:
                break
            if not waited:
                waited, began = True, now
                self.waits += 1
            first = others[0]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(first.until, deadline) - now):
                    await first.reported.wait()
        if waited:
            self.wait_seconds += self._clock() - began
            if others:
                self.wait_timeouts += 1
        self._take(replica, model, number, leases)

    def try_decide(self, replica: str, model: str, number: int | None) -> bool:
        """``decide`` when it need not wait (no other replica holds a lease on ``model``):
        True, the lease taken; False, nothing done."""
        if len(self._leases) > MAX_LEASED_MODELS:
            self._end_leases("", (), self._clock())  # only the expired ones go
        leases, others = self._leases_now(replica, model, self._clock())
        if others:
            return False
        self._take(replica, model, number, leases)
        return True

    def _leases_now(
        self, replica: str, model: str, now: float
    ) -> tuple[list[_Lease], list[_Lease]]:
        """The model's leases still running, and those of them other replicas hold."""
        leases = [lease for lease in self._leases.get(model, ()) if lease.until > now]
        return leases, [lease for lease in leases if lease.replica != replica]

    def _take(self, replica: str, model: str, number: int | None, leases: list[_Lease]) -> None:
        """Lease ``number`` (None: none) added to ``leases``, the model's running ones."""
        if number is not None:
            leases.append(_Lease(replica, number, self._clock() + self._lease_s, asyncio.Event()))
        if leases:
            self._leases[model] = leases
        else:
            self._leases.pop(model, None)

    def __len__(self) -> int:
        """The replicas whose report still counts."""
        self._expire(self._clock())
        return len(self._held)

    def report(self, body: LoadReport) -> None:
        """Take a replica's report in place of its last; TooManyReplicas for one more
        replica than the table holds."""
        now = self._clock()
        self._expire(now)
        if body.replica not in self._held and len(self._held) >= self.max_replicas:
            raise TooManyReplicas(
                f"{len(self._held)} router replicas report loads already (at most "
                f"{self.max_replicas}); this one's counts when one of theirs expires"
            )
        loads = {
            name: (load.queued_prefill_tokens, load.in_flight)
            for name, load in body.instances.items()
            if load.queued_prefill_tokens or load.in_flight
        }
        self._held[body.replica] = _Held(loads, now + body.ttl_s)
        self._end_leases(body.replica, body.decided, now)

    def _end_leases(self, replica: str, decided: Collection[int], now: float) -> None:
        """The leases of ``replica`` numbered in ``decided`` end (their decisions are in its
        load now), and the expired ones go."""
        decided = set(decided)
        for model, leases in list(self._leases.items()):
            kept = []
            for lease in leases:
                if lease.replica == replica and lease.number in decided:
                    lease.reported.set()
                elif lease.until > now:
                    kept.append(lease)
            if kept:
                self._leases[model] = kept
            else:
                del self._leases[model]

    def count_others(self, replica: str) -> int:
        """The replicas besides ``replica`` whose report still counts."""
        return len(self) - (replica in self._held)

    def others(self, replica: str, instances: Container[str]) -> dict[str, tuple[int, int]]:
        """Per instance of ``instances``, the loads of every replica but ``replica``."""
        self._expire(self._clock())
        total: dict[str, tuple[int, int]] = {}
        for name, held in self._held.items():
            if name == replica:
                continue
            for instance, (queued, in_flight) in held.loads.items():
                if instance in instances:
                    before = total.get(instance, (0, 0))
                    total[instance] = (before[0] + queued, before[1] + in_flight)
        return total

    def _expire(self, now: float) -> None:
        if any(held.expires <= now for held in self._held.values()):
            self._held = {name: held for name, held in self._held.items() if held.expires > now}


def loads_header(loads: dict[str, tuple[int, int]]) -> str:
    """``loads`` as the answer's header: a JSON object ``{instance: [queued prefill tokens,
    in flight]}`` (ASCII), the most queued first, cut to ``MAX_HEADER_BYTES``."""
    parts, size = [], 2
    for instance, load in sorted(loads.items(), key=lambda item: item[1], reverse=True):
        part = f"{json.dumps(instance)}:[{load[0]},{load[1]}]"
        size += len(part) + 1
        if size > MAX_HEADER_BYTES:
            break
        parts.append(part)
    return "{" + ",".join(parts) + "}"
