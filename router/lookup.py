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

from .index_client import ConductorUnavailable, Hits, IndexClient, IndexContext, PromptBlocks
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
    ) -> None:
        self._index = index
        self._pending = pending
        self._metrics = metrics

    async def find(
        self,
        tokens: list[int] | None,
        context: IndexContext,
        cache_salt: str,
        in_flight: bool,
    ) -> Lookup:
        """The index's answer for the prompt in ``context`` with the prompts in flight
        counted (``in_flight``: the model's ``routing.in_flight_prefixes``), or no hits and
        why (``router_fallbacks_total``)."""
        if tokens is None:
            lookup = Lookup({}, "tokenize_failed", {}, None)
        else:
            prompt = PromptBlocks(token_bytes(tokens), context, cache_salt)
            hits = await self._ask(prompt)
            if hits is None:
                lookup = Lookup({}, "conductor_unavailable", {}, prompt)
            else:
                added = self._add_in_flight(hits, prompt) if in_flight else {}
                lookup = Lookup(hits, None, added, prompt)
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
        return reusable_hits(hits, prompt.tokens, prompt.context.block_size)

    def _add_in_flight(self, hits: Hits, prompt: PromptBlocks) -> dict[str, int]:
        """Raise each instance's GPU hit in ``hits`` to the longest prefix of the prompt
        sent there and still pending; returns the tokens this added, per instance."""
        if self._pending is None:
            return {}
        block_size = prompt.context.block_size
        added: dict[str, int] = {}
        matches = self._pending.match(prompt.hashes, prompt.context.lora_name)
        pending_hits = {name: (blocks * block_size,) * 3 for name, blocks in matches.items()}
        for name, (pending, _, _) in reusable_hits(pending_hits, prompt.tokens, block_size).items():
            gpu, cpu, disk = hits.get(name, (0, 0, 0))
            if pending > gpu:
                hits[name] = (pending, max(cpu, pending), max(disk, pending))
                added[name] = pending - gpu
        return added
