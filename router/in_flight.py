"""The load a request puts on its prefill instance while it runs, and its prompt's life
among the prefixes in flight.

While it runs the instance carries it: the pool's ticket (one request more, its uncached
prompt tokens queued until its first token) and ``router_in_flight_requests``. Its prompt
counts as a hit there for requests sharing its prefix (``pending``), while it runs and after
it ends until the index has its blocks: until the index says it holds what the instance
published after the end (``IndexClient.indexed_until``), or for the grace period where it
cannot say; looked at every ``RECHECK_S`` while some finished prompt is held. It is
reported to the index too (``IndexClient.report_routed``), for the other router replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .decision import Choice, Routed
from .index_client import IndexClient
from .metrics import RouterMetrics
from .pending import RECHECK_S, PendingPrefixes, PendingPrompt
from .pool import InstancePool, Ticket


@dataclass(frozen=True, slots=True)
class Claim:
    """One attempt's hold on its prefill instance: its ticket, and the prefill work the
    TTFT it sees is learned against (its own uncached tokens, the tokens queued before)."""

    ticket: Ticket
    new_tokens: int
    queued_before: int


class InFlight:
    def __init__(
        self,
        pool: InstancePool,
        metrics: RouterMetrics,
        pending: PendingPrefixes | None,
        index: IndexClient,
        grace_s: float,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._pending = pending
        self._index = index
        self._grace_s = grace_s
        self._release_scheduled = False  # a look at the finished prompts held is due

    @contextlib.contextmanager
    def claim(self, routed: Routed, choice: Choice) -> Iterator[Claim]:
        """The attempt's load on ``choice.prefill`` and its prompt there, from now until
        the block ends (then the prompt is held until indexed)."""
        decision, prefill = choice.decision, choice.prefill
        self._metrics.cached_tokens.inc(decision.cached_tokens)
        new_tokens = max(routed.tokenized.count - decision.cached_tokens, 0)
        ticket = self._pool.claim(prefill, new_tokens)
        if routed.lookup.prompt is not None:
            self._index.decided(routed.lookup.prompt)
        if added := routed.lookup.in_flight_hits.get(prefill.instance_id):
            self._metrics.in_flight_hit_tokens.inc(min(added, decision.cached_tokens))
        prompt, pending = routed.lookup.prompt, None
        # the model's routing.in_flight_prefixes (the table exists when some model's is on)
        if (
            prompt is not None
            and self._pending is not None
            and routed.target.served.in_flight_prefixes
        ):
            pending = self._pending.add(
                prefill.instance_id, prompt.hashes, prompt.context.lora_name
            )
            if pending is not None:  # a complete block to share: the other replicas too
                self._index.report_routed(prompt, prefill.instance_id)
        queued_before = prefill.queue_tokens - new_tokens
        self._metrics.in_flight.labels(prefill.instance_id).inc()
        try:
            yield Claim(ticket, new_tokens, queued_before)
        finally:
            ticket.release()
            self._metrics.in_flight.labels(prefill.instance_id).dec()
            if pending is not None:
                self._held_until_indexed(pending)

    def _held_until_indexed(self, prompt: PendingPrompt) -> None:
        """A request ended: its prompt stays in flight until the index has its blocks."""
        assert self._pending is not None
        self._pending.end(prompt, time.time())
        if not self._release_scheduled:
            self._release_scheduled = True
            asyncio.get_running_loop().call_later(RECHECK_S, self._release_indexed)

    def _release_indexed(self) -> None:
        assert self._pending is not None
        self._pending.release_indexed(self._index.indexed_until, time.time(), self._grace_s)
        self._release_scheduled = self._pending.ending
        if self._release_scheduled:
            asyncio.get_running_loop().call_later(RECHECK_S, self._release_indexed)
