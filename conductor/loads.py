"""The prefill work router replicas have queued on each instance, shared through the
conductor they all ask.

A router prices an instance's queue from the requests it sent there itself (the uncached
prompt tokens not yet prefilled, the requests not yet finished). Behind a load balancer
each of N replicas sees about 1/N of the queue it adds to and sends work to instances it
believes idle. So each replica reports its own load per instance (``POST /loads``: the
whole of it, every time it changes and at least every third of ``ttl_s``), and a ``/query``
that names its replica (``REPLICA_HEADER``) is answered, in ``LOADS_HEADER``, with the sum
of the *other* replicas' loads on the query's instances. A report counts for its
``ttl_s``: a replica that stops reporting (stopped, or cut off) stops counting.

Memory and time are bounded: at most ``MAX_REPLICAS`` replicas and ``MAX_INSTANCES`` instances
per report (the whole load of a replica in a few kB); an answer adds each replica's
instances (a few per query), lists the most loaded first and fits in ``MAX_HEADER_BYTES``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from pydantic import Field

from .config import StrictModel

REPLICA_HEADER = "X-Conductor-Replica"  # a query's: the router replica asking
LOADS_HEADER = "X-Conductor-Replica-Loads"  # the answer's: the other replicas' loads
DEFAULT_TTL_S = 3.0
MAX_TTL_S = 60.0
MAX_REPLICAS = 256
MAX_INSTANCES = 4096  # per report
MAX_REPLICA_CHARS = 256
MAX_HEADER_BYTES = 6144  # well under a client's 8 KiB header line
MAX_QUEUED_TOKENS = 1 << 40
MAX_IN_FLIGHT = 1_000_000


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


class TooManyReplicas(Exception):
    """A new replica's report while ``MAX_REPLICAS`` others still count."""


@dataclass(slots=True)
class _Held:
    loads: dict[str, tuple[int, int]]  # instance -> (queued prefill tokens, in flight)
    expires: float


class ReplicaLoads:
    """Each replica's last report, until its time is over."""

    def __init__(
        self, max_replicas: int = MAX_REPLICAS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_replicas = max_replicas
        self._clock = clock
        self._held: dict[str, _Held] = {}

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
