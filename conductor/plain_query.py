"""The plain query, read and answered in C, from the index straight to the answer's bytes.

Most queries ask one thing: which instances of a context hold how much of a prompt. In
Python the request's reading (the head's regex and multidict, the body's pydantic model)
and the handler's objects (the match per instance, the answer's dicts, a ``web.Response``,
the task that runs it) cost ~80 µs of CPU in the service, more than the index's own work:
the interpreter runs that code cold between two requests. So the query lane
(``conductor.query_lane``) reads each head with a ``_native.HeadReader`` into a
``PlainHead`` and offers it with its body to ``ConductorApi.answer_plain``, which reads the
body's fields with ``_native.plain_query_fields`` (else the pydantic fast readers) and
answers through a ``_native.QueryPlan`` (conductor/native/request.c, answer.c); it leaves
every other request to the handler, which answers everything as before.

Plain is: ``POST /query`` with no header asking for other tiers (msgpack asked for only by
a msgpack body), a body naming no instance, of a context whose instances have 63 DP ranks at
most (``index.PlainFleet``; its blocks keyed by Go prefix hashes, or by a hash profile's
chain, ``_native.ProfileChain``), and, from a router replica, a decision lease it need not
wait for (``loads.ReplicaLoads.try_decide``). Then an instance's answer holds four numbers
for itself and four for each of its DP ranks: on each tier (the GPU, its own CPU, any CPU
it can load from, a pool's included, any tier), the tokens a rank's slot holds in a row
from the prompt's start, and for the instance the most of its ranks', raised to what
routers routed there (``conductor.routed``). A plan holds a template per set of ranks,
made here by the handler's own encoders with a sentinel where each number goes, and C
writes the numbers in. Both ways answer alike byte for byte, and the C readers read as the
Python ones (tests/conductor/test_plain_query.py compares them over random fleets,
requests, heads and bodies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from ._native import ProfileChain, QueryPlan
from .hashing import PrefixHash, salt_root
from .index import InstanceMatch, PlainFleet, TierHits

PLAIN_ROUTE = "/query"  # the route of plain queries
TIERS = 4  # the numbers of an instance and of each of its DP ranks
MOST_RANKS = 63  # an instance's in a plan (a template's kinds are bytes)


class PlainHead(NamedTuple):
    """A head the plain path may answer, as ``_native.HeadReader`` reads it: the body's
    length, keep-alive, the media type (None: no Content-Type), then the first value of
    each header the answer depends on (None: absent)."""

    length: int
    keep_alive: bool
    media_type: str | None
    accept: str | None
    authorization: str | None
    hits_only: str | None
    replica: str | None
    lease: str | None
    progress: str | None


@dataclass(frozen=True, eq=False)
class Dialect:
    """How the handler answers a query in one dialect: what the plans copy."""

    msgpack: bool
    encode: Callable[[Any], bytes]
    write: Callable[[InstanceMatch], Any]  # one instance's answer, as ``encode`` takes it
    wrap: Callable[[str, dict[str, Any]], Any]  # the answer around a tenant's instances
    headers: tuple[tuple[str, str], ...]  # the response's (its content type)


def plan(fleet: PlainFleet, dialect: Dialect) -> QueryPlan | None:
    """The fleet's plan for its answers in ``dialect`` (made once, kept with the fleet);
    None if an answer's numbers are not all one instance's tokens."""
    if dialect not in fleet.plans:
        fleet.plans[dialect] = _make(fleet, dialect)
    return cast(QueryPlan | None, fleet.plans[dialect])


def chain_root(fleet: PlainFleet, tokens: bytes, salt: str) -> PrefixHash | ProfileChain | None:
    """What a plan's answer keys the prompt's blocks from: the salt's Go root, or in a
    profiled context the prompt's own chain; None if C does not hash that profile's
    blocks (a pickled block past one frame: the handler hashes it)."""
    if fleet.profile is None:
        return salt_root(salt)
    key = fleet.key
    keys = fleet.profile.block_keys(tokens, key.block_size, key.lora_name, salt)
    return keys if isinstance(keys, ProfileChain) else None


def _sentinels(count: int) -> list[int]:
    """Numbers in no template but where a match's tokens go, in the order of a template's
    kinds (conductor/native/answer.c): the instance's on the GPU, its own CPU, any CPU,
    any tier, then each of its DP ranks' the same."""
    return [2**63 - 25 - 27 * kind for kind in range(count)]


def _checks(count: int) -> list[int]:
    """Other numbers, to check a template with."""
    return [12_345 + 1_000 * kind for kind in range(count)]


def _value(dialect: Dialect, ranks: tuple[int, ...], numbers: list[int]) -> bytes:
    """An instance's answer with these ``numbers`` (in the order of ``_sentinels``): its
    hits on each tier, then each of its ``ranks``' (less, when a routed prompt raised the
    instance's)."""
    hits = [_hits(numbers, TIERS * j) for j in range(1 + len(ranks))]
    match = InstanceMatch(*hits[0], dict(zip(ranks, hits[1:], strict=True)))
    return dialect.encode(dialect.write(match))


def _hits(numbers: list[int], at: int) -> TierHits:
    return (numbers[at], numbers[at + 1], numbers[at + 2], numbers[at + 3])


def _template(dialect: Dialect, ranks: tuple[int, ...]) -> tuple[tuple[bytes, ...], bytes] | None:
    """The answer of an instance of these DP ranks, cut where its numbers go, and which
    number goes in each cut; None if it holds a number that is none of them."""
    count = TIERS * (1 + len(ranks))
    encoded = _value(dialect, ranks, _sentinels(count))
    marks = [dialect.encode(sentinel) for sentinel in _sentinels(count)]
    parts, kinds, at = [], bytearray(), 0
    while True:
        found = [(encoded.find(mark, at), kind) for kind, mark in enumerate(marks)]
        found = [(position, kind) for position, kind in found if position >= 0]
        if not found:
            break
        position, kind = min(found)
        parts.append(encoded[at:position])
        kinds.append(kind)
        at = position + len(marks[kind])
    parts.append(encoded[at:])
    checks = [dialect.encode(check) for check in _checks(count)]
    filled = (
        b"".join(part + checks[kind] for part, kind in zip(parts[:-1], kinds, strict=True))
        + parts[-1]
    )
    if filled != _value(dialect, ranks, _checks(count)):
        return None
    return tuple(parts), bytes(kinds)


def _make(fleet: PlainFleet, dialect: Dialect) -> QueryPlan | None:
    if any(len(ranks) > MOST_RANKS for ranks in fleet.ranks):
        return None
    templates = {ranks: _template(dialect, ranks) for ranks in set(fleet.ranks)}
    whole = dialect.encode(dialect.wrap(fleet.key.tenant_id, {}))
    at = whole.rindex(dialect.encode({}))  # the instances' map: the answer's last value
    if dialect.msgpack:  # C writes the map's length
        opener, closer = whole[:at], whole[at + 1 :]
        names = [dialect.encode(name) for name in fleet.names]
    else:  # C writes the entries between the braces, with commas
        opener, closer = whole[: at + 1], whole[at + 1 :]
        names = [dialect.encode(name) + b":" for name in fleet.names]
    instances = []
    for name, ranks, bits in zip(names, fleet.ranks, fleet.bits, strict=True):
        template = templates[ranks]
        if template is None:
            return None
        instances.append((name, bits, *template))
    return QueryPlan(
        fleet.blocks, fleet.pool_members, tuple(instances), opener, closer, dialect.msgpack
    )
