"""Prompts routers have just sent to an instance, before the instance's events say so.

A router remembers the prompts it sent while their blocks are not indexed yet (its
``pending`` prefixes), but only its own: replicas behind one load balancer that split a
burst of requests sharing a new prefix would each send it to a different instance until
the events reach the index. So each router reports what it routed (``POST /routed``) to the
conductor the replicas all ask, and ``/query`` counts, per instance, the longest prefix of
the query a prompt routed there shares as a GPU hit (the larger of that and the index's),
for the report's ``ttl_s`` (capped at ``MAX_TTL_S``): the few seconds the engine takes to
compute it and the conductor to apply its events, after which the index says the same.

Prompts are compared by the conductor's chained block hashes (``prefix_hashes``, salted
with the request's ``cache_salt``) within their context, one list per report: a query
hashes its first block, looks at the reports sharing it (the ``MAX_PER_FIRST_BLOCK`` most
recent) and only then hashes the rest; each comparison is a binary search. Memory is
bounded: at most ``max_entries`` reports holding ``max_hashes`` block hashes in all, 8 bytes
each (the oldest go first, counted): a report may carry a whole maximum-size prompt.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

from pydantic import Field, model_validator

from .config import QueryRequest
from .hashing import PrefixHash, prefix_hashes
from .index import ContextKey, InstanceMatch

DEFAULT_TTL_S = 5.0
MAX_TTL_S = 60.0
MAX_ENTRIES = 65_536
MAX_HASHES = 1 << 24  # block hashes held over all reports: 128 MiB
MAX_PER_FIRST_BLOCK = 64  # reports compared per first block: the most recent ones


class RoutedRequest(QueryRequest):
    """``POST /routed``: the prompt of ``/query`` and the instance it was sent to."""

    ttl_s: float = Field(default=DEFAULT_TTL_S, gt=0, le=MAX_TTL_S, allow_inf_nan=False)

    @classmethod
    def from_plain_json(cls, body: bytes) -> RoutedRequest | None:
        """``/query``'s fast JSON reader (it builds ``cls``), typed for this model."""
        return cast("RoutedRequest | None", super().from_plain_json(body))

    @model_validator(mode="after")
    def _names_an_instance(self) -> RoutedRequest:
        if self.instance_id is None:
            raise ValueError("instance_id: the instance the prompt was sent to is required")
        return self


class _Routed:
    """One report: where the prompt went, its block hashes, until when it counts."""

    __slots__ = ("instance_id", "hashes", "first", "expires", "held")

    def __init__(self, instance_id: str, hashes: array[int], first: _First, expires: float) -> None:
        self.instance_id = instance_id
        self.hashes = hashes
        self.first = first
        self.expires = expires
        self.held = True  # False once out of its first block's list


_First = tuple[ContextKey, PrefixHash]


class RoutedPrompts:
    """The reports still counting, by context and first block, and in arrival order."""

    def __init__(
        self,
        max_entries: int = MAX_ENTRIES,
        max_hashes: int = MAX_HASHES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_hashes = max_hashes
        self._hashes = 0  # block hashes of the reports in _order
        self._clock = clock
        self._by_first: dict[_First, list[_Routed]] = {}
        self._order: deque[_Routed] = deque()
        self.dropped = 0  # reports pushed out by the cap before their time
        # told whether a report is held, when that may have changed (conductor.query_thread)
        self.listener: Callable[[bool], None] | None = None

    def __len__(self) -> int:
        return sum(len(reports) for reports in self._by_first.values())

    def holds_any(self) -> bool:
        """Whether a report is held: ``match`` finds none while none is."""
        return bool(self._by_first)

    def add(self, request: RoutedRequest) -> bool:
        """Record a report; False when its prompt has no complete block (nothing to share)."""
        key = request.context_key()
        hashes = prefix_hashes(request.token_ids, key.block_size, request.cache_salt or "")
        if not hashes or request.instance_id is None:
            return False
        now = self._clock()
        self._expire(now)
        first = (key, hashes[0])
        report = _Routed(request.instance_id, array("Q", hashes), first, now + request.ttl_s)
        reports = self._by_first.setdefault(report.first, [])
        reports.append(report)
        if len(reports) > MAX_PER_FIRST_BLOCK:
            reports.pop(0).held = False
        self._order.append(report)
        self._hashes += len(hashes)
        while len(self._order) > self.max_entries or self._hashes > self.max_hashes:
            oldest = self._pop_oldest()
            if oldest.held and oldest.expires > now:
                self.dropped += 1
            self._unhold(oldest)
        if self.listener is not None:
            self.listener(True)
        return True

    def expire(self) -> None:
        """Forget the reports whose time is over now (``add`` and ``match`` do as they go)."""
        self._expire(self._clock())

    def _expire(self, now: float) -> None:
        """Forget the oldest reports whose time is over (a report with a longer time ahead
        of them holds the later ones back: each is checked when compared anyway)."""
        while self._order and self._order[0].expires <= now:
            self._unhold(self._pop_oldest())

    def _pop_oldest(self) -> _Routed:
        oldest = self._order.popleft()
        self._hashes -= len(oldest.hashes)
        return oldest

    def _unhold(self, report: _Routed) -> None:
        if not report.held:
            return
        report.held = False
        reports = self._by_first.get(report.first, [])
        for position, held in enumerate(reports):
            if held is report:
                del reports[position]
                break
        if not reports:
            self._by_first.pop(report.first, None)
            if not self._by_first and self.listener is not None:
                self.listener(False)

    def forget(self, instance_id: str) -> None:
        """The instance is down (its cache may be gone): none of its reports counts."""
        for report in self._order:
            if report.instance_id == instance_id:
                self._unhold(report)

    def match(self, key: ContextKey, token_ids: bytes, salt: str) -> dict[str, int]:
        """Per instance, how many leading blocks of the prompt a report there shares."""
        if not self._by_first:
            return {}
        first = prefix_hashes(token_ids[: key.block_size * 4], key.block_size, salt)
        reports = self._by_first.get((key, first[0])) if first else None
        if not reports:
            return {}
        hashes = prefix_hashes(token_ids, key.block_size, salt)
        now = self._clock()
        matches: dict[str, int] = {}
        for report in reports:
            if report.expires > now:
                shared = common_prefix(report.hashes, hashes)
                if shared > matches.get(report.instance_id, 0):
                    matches[report.instance_id] = shared
        return matches


def raise_hits(
    matches: dict[str, InstanceMatch], routed: dict[str, int], block_size: int
) -> tuple[dict[str, InstanceMatch], int]:
    """``matches`` with each instance's hits raised to the blocks a routed prompt there
    shares (every tier: a block on the GPU counts on all), and how many instances it
    raised. Only the instances the answer lists are raised (those of the context, or the
    one the query names): a report naming another adds none. The index's answers are
    shared objects: raised ones are copies."""
    raised = dict(matches)
    count = 0
    for name, blocks in routed.items():
        match = raised.get(name)
        if match is None:
            continue
        tokens = blocks * block_size
        if tokens > match.gpu:
            raised[name] = replace(
                match,
                gpu=tokens,
                cpu_local=max(match.cpu_local, tokens),
                cpu=max(match.cpu, tokens),
                disk=max(match.disk, tokens),
            )
            count += 1
    return raised, count


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading hashes ``a`` and ``b`` share. They are chained block hashes (each
    covers every block before it), so two lists that agree at a position agree before it:
    a binary search compares one hash per step."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low
