"""Stage 3 of a request: what each instance holds of the prompt.

The index (``index_client.IndexClient``: a conductor service, or the index in the router)
gives each instance's cached prefix; without its answer in time, or without the prompt's
ids, there is none and the decision is by load (the fallback's reason is kept). The prompts
in flight (``pending``) then raise an instance's GPU hit to the prefix a prompt sent there
and not indexed yet shares with this one.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from conductor.hashing import token_bytes

from .index_client import ConductorUnavailable, Hits, IndexClient, PromptBlocks
from .metrics import RouterMetrics
from .pending import PendingPrefixes
from .policy import reusable_hits


@dataclass(frozen=True, slots=True)
class Lookup:
    """A prompt's hits per instance, as the engines will use them, and why the index's
    answer is missing, if it is."""

    hits: Hits
    fallback: str | None  # conductor_unavailable or tokenize_failed
    in_flight_hits: dict[str, int]  # per instance, tokens a prompt in flight there added
    prompt: PromptBlocks | None  # None: the prompt's ids are unknown


class IndexLookup:
    def __init__(
        self,
        index: IndexClient,
        pending: PendingPrefixes | None,
        metrics: RouterMetrics,
        block_size: int,
    ) -> None:
        self._index = index
        self._pending = pending
        self._metrics = metrics
        self._block_size = block_size

    def blocks(self, tokens: list[int], cache_salt: str) -> PromptBlocks:
        """The prompt as the index and the prompts in flight read it."""
        return PromptBlocks(token_bytes(tokens), self._block_size, cache_salt)

    async def find(self, tokens: list[int] | None, cache_salt: str) -> Lookup:
        """The index's answer for the prompt with the prompts in flight counted, or no hits
        and why (``router_fallbacks_total``)."""
        if tokens is None:
            lookup = Lookup({}, "tokenize_failed", {}, None)
        else:
            prompt = self.blocks(tokens, cache_salt)
            hits = await self._ask(prompt)
            if hits is None:
                lookup = Lookup({}, "conductor_unavailable", {}, prompt)
            else:
                lookup = Lookup(hits, None, self._add_in_flight(hits, prompt), prompt)
        if lookup.fallback:
            self._metrics.fallbacks.labels(lookup.fallback).inc()
        return lookup

    async def _ask(self, prompt: PromptBlocks) -> Hits | None:
        """The index's hits as the engine will use them; None without an answer (a
        conductor's failure is logged once by its client, not per request)."""
        pending = self._pending
        progress_of: Collection[str] = () if pending is None else pending.awaiting_index()
        asked = time.perf_counter()
        try:
            hits = await self._index.hits(prompt, progress_of)
        except ConductorUnavailable:
            return None
        finally:
            self._metrics.conductor_query_seconds.observe(time.perf_counter() - asked)
        return reusable_hits(hits, prompt.tokens, self._block_size)

    def _add_in_flight(self, hits: Hits, prompt: PromptBlocks) -> dict[str, int]:
        """Raise each instance's GPU hit in ``hits`` to the longest prefix of the prompt
        sent there and still pending; returns the tokens this added, per instance."""
        if self._pending is None:
            return {}
        block_size = self._block_size
        added: dict[str, int] = {}
        pending_hits = {
            name: (blocks * block_size,) * 3
            for name, blocks in self._pending.match(prompt.hashes).items()
        }
        for name, (pending, _, _) in reusable_hits(pending_hits, prompt.tokens, block_size).items():
            gpu, cpu, disk = hits.get(name, (0, 0, 0))
            if pending > gpu:
                hits[name] = (pending, max(cpu, pending), max(disk, pending))
                added[name] = pending - gpu
        return added
