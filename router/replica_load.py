"""This router's load on each instance, shared with the other router replicas through the
conductors (``conductor.share_load``).

A router prices an instance's queue from the prefill work it sent there itself; behind a
load balancer each of N replicas would see about 1/N of the queue and send work to
instances it believes idle (bench/results/router-replay.md measured what that costs). So
every replica reports its whole load to every conductor (``POST /loads``: per instance,
the uncached prompt tokens sent and not prefilled yet and the requests not finished) as
soon as it changes (one report at a time, the next one carrying everything that changed
meanwhile) and at least every third of ``share_load_ttl_seconds`` while it carries any;
and each of its queries names it (``X-Conductor-Replica``) so that the answer carries the
other replicas' loads on the query's instances, which the pool adds to its own
(``InstancePool.set_others``) before the decision. The query also takes a decision lease
that the next report ends: other replicas' queries on the model wait for it, a few ms at
most (``conductor.loads``), so a burst reaching every replica at once is spread as one
router would spread it. A conductor that takes no report (unreachable, or without the
route: the Go service) is retried and said in ``/health``; the replica then routes on its
own load there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from typing import Any

from conductor.loads import LEASE_HEADER, MAX_INSTANCES, REPLICA_HEADER

from .pool import InstancePool
from .shared_route import Post, SharedRoute, Wording

WORDING = Wording(
    taken="load reports",
    refused="load reports",
    shared="load",
    setting="conductor.share_load",
    unseen="this one's load",
    alone="prices queues from what it sent itself",
)


class LoadSharing:
    def __init__(
        self,
        pool: InstancePool,
        urls: list[str],
        post: Post,
        ttl_s: float,
        timeout_s: float,
        route: SharedRoute,
    ) -> None:
        self.replica = uuid.uuid4().hex  # this process: a restarted one is a new replica
        self._leases = itertools.count()
        self._decided: list[int] = []  # leases whose decisions the next report carries
        # no other replica reports (as the conductor last said, in a query's answer or a
        # report's): changes wait for the renewal
        self._alone = False
        self._pool = pool
        self._urls = urls
        self._post = post
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self.route = route
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        pool.load_listener = self._changed.set

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def next_lease(self) -> int:
        return next(self._leases)

    def query_headers(self, lease: int | None) -> dict[str, str]:
        """What a query sends: this replica, and the decision lease it takes."""
        headers = {REPLICA_HEADER: self.replica}
        if lease is not None:
            headers[LEASE_HEADER] = str(lease)
        return headers

    def decided(self, lease: int) -> None:
        """The query's decision is in this router's load now: the next report says so."""
        self._decided.append(lease)
        self._changed.set()

    def retry(self, url: str) -> None:
        """``url`` accepted a registration: it may have been upgraded, report to it again."""
        self.route.retry(url)
        self._changed.set()

    def learn(self, header: str | None, others: str | None = None) -> None:
        """The other replicas' loads from a query's answer (none named: none), and how
        many other replicas report (absent: unknown, maybe some)."""
        self._alone = others == "0"
        loads: dict[str, tuple[int, int]] = {}
        try:
            parsed = json.loads(header) if header else {}
        except ValueError:
            parsed = {}
        for instance, load in parsed.items() if isinstance(parsed, dict) else ():
            if (
                isinstance(load, list)
                and len(load) == 2
                and all(type(n) is int and 0 <= n < 1 << 48 for n in load)
            ):
                loads[instance] = (load[0], load[1])
        self._pool.set_others(loads)

    async def _run(self) -> None:
        """Report whenever the load changed, and every third of the report's time anyway
        (so that the conductors count this replica while it is idle). While they say it
        is the only one, a change waits for that renewal: nobody reads it, and a router
        alone would send a report per request for nothing; each query's answer says when
        another replica has appeared (before the decision whose load it then reports)."""
        sent: dict[str, tuple[int, int]] | None = None
        keepalive_s = self._ttl_s / 3
        renew_at = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(keepalive_s):
                    await self._changed.wait()
            self._changed.clear()
            loads = self._pool.own_loads()
            changed = loads != sent or bool(self._decided)
            if not (time.monotonic() >= renew_at or (changed and not self._alone)):
                continue
            renew_at = time.monotonic() + keepalive_s
            # the latest: an older lease has expired by now if this many came after it
            decided, self._decided = self._decided[-MAX_INSTANCES:], []
            body = {
                "replica": self.replica,
                "ttl_s": self._ttl_s,
                "instances": {
                    name: {"queued_prefill_tokens": queued, "in_flight": in_flight}
                    for name, (queued, in_flight) in loads.items()
                },
                "decided": decided,
            }
            urls = self.route.urls(self._urls)
            results = await asyncio.gather(
                *(self.route.send(self._post, url, body, self._timeout_s) for url in urls)
            )
            sent = loads if all(ok for ok, _ in results) else None  # a failed one: again
            self._alone = all(ok and _replicas(answer) <= 1 for ok, answer in results)


def _replicas(answer: Any) -> int:
    """The replicas a conductor's ``/loads`` answer counts (this one among them); 2 when
    it does not say (another may be there)."""
    replicas = answer.get("replicas") if isinstance(answer, dict) else None
    return replicas if type(replicas) is int else 2
