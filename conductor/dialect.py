"""Upstream Mooncake's C++ conductor dialect: the answers and error reasons a msgpack client
of it expects (``mooncake-conductor/src/kvevent/event_manager.cpp``, branch
``dev/conductor``, 19ffa6e4a). The API speaks it to a request with a msgpack body (or a
GET accepting msgpack) and the Go service's JSON shapes to the rest (``conductor.api``).

Pure: shapes and names only, no I/O.
"""

from __future__ import annotations

import functools

import msgspec
from pydantic import AliasChoices, BaseModel

from .index import InstanceMatch

# the ``reason`` of a 400 in upstream's error envelope {"error", "reason"[, "field"][, "index"]}
INVALID_MSGPACK = "invalid_msgpack"
UNKNOWN_FIELD = "unknown_field"
MISSING = "missing"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
OUT_OF_RANGE = "out_of_range"
UNSUPPORTED = "unsupported"
INVALID_REGISTRATION = "invalid_registration"

# pydantic's error types (and ours, raised as PydanticCustomError) -> upstream's reason; any
# other ``*_type`` / ``*_parsing`` is a wrong type, anything else a wrong value
_REASONS = {
    "missing": MISSING,
    "extra_forbidden": UNKNOWN_FIELD,
    "greater_than": OUT_OF_RANGE,
    "greater_than_equal": OUT_OF_RANGE,
    "less_than": OUT_OF_RANGE,
    "less_than_equal": OUT_OF_RANGE,
    "token_range": OUT_OF_RANGE,
    "unsupported": UNSUPPORTED,
    "model_type": INVALID_TYPE,
    "model_attributes_type": INVALID_TYPE,
}


def reason_of(error_type: str) -> str:
    """The upstream reason for a validation error of this pydantic type."""
    reason = _REASONS.get(error_type)
    if reason is not None:
        return reason
    if error_type.endswith(("_type", "_parsing")):
        return INVALID_TYPE
    return INVALID_VALUE


@functools.cache
def accepted_fields(model: type[BaseModel]) -> frozenset[str]:
    """Every key a body of ``model`` may hold: its fields and their aliases. Upstream
    refuses any other key (ours, as lora_id or kv_store, are fields: they stay accepted)."""
    names = set(model.model_fields)
    for info in model.model_fields.values():
        alias = info.validation_alias
        if isinstance(alias, str):
            names.add(alias)
        elif isinstance(alias, AliasChoices):
            names.update(choice for choice in alias.choices if isinstance(choice, str))
    return frozenset(names)


class CppTiers(msgspec.Struct):
    """One DP rank's cumulative hit, in tokens: gpu <= cpu <= disk."""

    gpu: int
    cpu: int
    disk: int


class CppMatch(msgspec.Struct):
    """One instance's ``/query`` answer in upstream C++'s shape: ``dp`` is each rank's GPU
    hit, ``rank_matches`` each rank's three tiers (ranks as decimal strings), the instance
    tiers the best of its ranks, ``longest_matched`` its disk tier. A struct, as ``GoMatch``
    in ``conductor.api``: several times faster to make than the dict it encodes as."""

    longest_matched: int
    dp: dict[str, int]
    rank_matches: dict[str, CppTiers]
    gpu: int
    cpu: int
    disk: int


def cpp_match(match: InstanceMatch) -> CppMatch:
    """One instance's answer; ranks in numeric order, as upstream's std::map keeps them."""
    ranks = match.ranks
    if len(ranks) == 1:  # one DP rank: most engines
        ((rank, (gpu, cpu, disk)),) = ranks.items()
        name = str(rank)
        dp = {name: gpu}
        tiers = {name: CppTiers(gpu, cpu, disk)}
    else:
        dp, tiers = {}, {}
        for rank, (gpu, cpu, disk) in sorted(ranks.items()):
            dp[str(rank)] = gpu
            tiers[str(rank)] = CppTiers(gpu, cpu, disk)
    return CppMatch(match.disk, dp, tiers, match.gpu, match.cpu, match.disk)
