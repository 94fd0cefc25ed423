"""Engines taken out of rotation and brought back, and everyone who must know at once.

An engine is taken out on a refused connection, a 5xx, no first byte in time, a failed
``/health`` probe or ``/metrics`` scrape; a probe that sees it healthy brings it back. Out
of rotation it gets no requests, its prompts in flight stop counting (it may have died and
come back with an empty cache), the requests waiting for its first byte move on at once,
and the background reporter tells the conductors (``changed``).
"""

from __future__ import annotations

import asyncio

from .metrics import RouterMetrics
from .notices import Notices
from .pending import PendingPrefixes
from .pool import InstancePool, Upstream


class Rotation:
    def __init__(
        self,
        pool: InstancePool,
        metrics: RouterMetrics,
        notices: Notices,
        pending: PendingPrefixes | None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._notices = notices
        self._pending = pending
        self.changed = asyncio.Event()  # some upstream left rotation or came back
        # per upstream, resolved when it is next taken out of rotation: wakes the requests
        # waiting for its first byte
        self._taken_out: dict[str, asyncio.Future[None]] = {}

    def start(self) -> None:
        """Every upstream starts in rotation."""
        for upstream in self._pool.all():
            self._metrics.healthy.labels(upstream.instance_id).set(1)

    def take_out(self, upstream: Upstream, reason: str) -> None:
        """Out of rotation until the prober sees it healthy again (logged once, then as a
        reminder while it stays out); the requests waiting for its first byte move on."""
        self._notices.fault(
            f"upstream {upstream.instance_id}",
            "upstream instance=%s out of rotation: %s",
            upstream.instance_id,
            reason,
        )
        self._pool.mark_failed(upstream)
        if self._pending is not None:  # a restarted engine must not be credited its prompts
            self._pending.forget(upstream.instance_id)
        self._metrics.healthy.labels(upstream.instance_id).set(0)
        self.changed.set()
        taken_out = self._taken_out.pop(upstream.instance_id, None)
        if taken_out is not None:
            taken_out.set_result(None)

    def bring_back(self, upstream: Upstream) -> None:
        self._pool.mark_healthy(upstream)
        self._metrics.healthy.labels(upstream.instance_id).set(1)
        self._notices.recovered(
            f"upstream {upstream.instance_id}", "upstream instance=%s back", upstream.instance_id
        )
        self.changed.set()

    def taken_out_signal(self, upstream: Upstream) -> asyncio.Future[None]:
        """Resolved when ``upstream`` is next taken out of rotation."""
        signal = self._taken_out.get(upstream.instance_id)
        if signal is None:
            signal = asyncio.get_running_loop().create_future()
            self._taken_out[upstream.instance_id] = signal
        return signal
