"""The plain query, answered in C from the index straight to the answer's bytes.

Most queries ask one thing: which instances of a context hold how much of a prompt. In
Python the handler's objects for that (the match per instance, the answer's dicts, a
``web.Response``, the task that runs it) cost ~80 µs of CPU in the service, more than
the index's own work: the interpreter runs that code cold between two requests. So the
query lane (``conductor.query_lane``) offers each request to ``ConductorApi.answer_plain``
first, which answers a plain one through a ``_native.QueryPlan`` (conductor/native/
answer.c), and leaves the rest to the handler, which answers everything as before.

Plain is: ``POST /query`` with no header asking for more than the match (no tiers,
replica, lease or progress header; msgpack asked for only by a msgpack body), a body the
fast readers accept whole (``config.QueryRequest.from_plain_json``, ``api._plain_msgpack``)
naming no instance, of a context with a ``PlainFleet`` (Go prefix hashes, no pool, every
instance one engine slot of one DP rank) whose blocks are all on the GPU tier, while no
router's routed prompt is held (``conductor.routed``). Then every number in an instance's
answer is the same, the tokens its slot holds in a row from the prompt's start: a plan
holds the answer's templates, made here by the handler's own encoders with a sentinel
where that number goes, and C writes the numbers in. Both ways answer alike byte for
byte (tests/conductor/test_plain_query.py compares them over random fleets).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from ._native import QueryPlan
from .index import InstanceMatch, PlainFleet

SENTINEL = 2**63 - 25  # a number in no template but where a match's tokens go
CHECK = 12_345  # a second number, to check a template's numbers are all the tokens


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


def _value(fleet: PlainFleet, dialect: Dialect, tokens: int) -> bytes:
    """One instance's answer when its slot holds ``tokens`` (on every tier)."""
    hits = (tokens, tokens, tokens, tokens)
    return dialect.encode(dialect.write(InstanceMatch(*hits, {fleet.rank: hits})))


def _make(fleet: PlainFleet, dialect: Dialect) -> QueryPlan | None:
    parts = _value(fleet, dialect, SENTINEL).split(dialect.encode(SENTINEL))
    if dialect.encode(CHECK).join(parts) != _value(fleet, dialect, CHECK):
        return None
    whole = dialect.encode(dialect.wrap(fleet.tenant, {}))
    at = whole.rindex(dialect.encode({}))  # the instances' map: the answer's last value
    if dialect.msgpack:  # C writes the map's length
        opener, closer = whole[:at], whole[at + 1 :]
        names = tuple(dialect.encode(name) for name in fleet.names)
    else:  # C writes the entries between the braces, with commas
        opener, closer = whole[: at + 1], whole[at + 1 :]
        names = tuple(dialect.encode(name) + b":" for name in fleet.names)
    return QueryPlan(fleet.blocks, fleet.bits, names, tuple(parts), opener, closer, dialect.msgpack)
