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

from .index import InstanceMatch, TierHits

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


# ours, on /query and /query_by_hash: the tiers an answer names, comma-separated, any case.
# Upstream's C++ tip answers gpu, cpu, disk; its later revision npu, cpu_local, cpu_share,
# disk, with nothing in the request to choose. A msgpack answer carries both sets unless
# the header names some (an exact-shape client names its set); a JSON answer Go's GPU, CPU,
# DISK unless it names others (in capitals there).
TIERS_HEADER = "X-Conductor-Tiers"
TIER_NAMES = ("gpu", "cpu", "npu", "cpu_local", "cpu_share", "disk")  # in the answer's order
EVERY_TIER = frozenset(TIER_NAMES)
GO_TIERS = frozenset(("gpu", "cpu", "disk"))


def parse_tiers(value: str) -> frozenset[str]:
    """The tier names a ``TIERS_HEADER`` value lists; ValueError says what is wrong."""
    names = frozenset(name.strip().lower() for name in value.split(","))
    unknown = sorted(names - EVERY_TIER)
    if unknown:
        raise ValueError(
            f"{TIERS_HEADER}: unknown tier {unknown[0]!r}; known: {', '.join(TIER_NAMES)}"
        )
    for usual in (EVERY_TIER, GO_TIERS):  # the same object: tier_values' fast paths
        if names == usual:
            return usual
    return names


TierValues = tuple[int | None, int | None, int | None, int | None, int | None, int | None]


def tier_values(hits: TierHits, tiers: frozenset[str]) -> TierValues:
    """Cumulative hits (gpu, own CPU, any CPU, disk) under ``TIER_NAMES``, None where a
    tier is not asked for: gpu and npu are the GPU hit, cpu and cpu_share any CPU,
    cpu_local the engine's own CPU. (Positional: a 1,000-instance answer makes thousands.)"""
    gpu, cpu_local, cpu, disk = hits
    if tiers is EVERY_TIER:
        return gpu, cpu, gpu, cpu_local, cpu, disk
    if tiers is GO_TIERS:
        return gpu, cpu, None, None, None, disk
    values = (gpu, cpu, gpu, cpu_local, cpu, disk)
    kept = [
        value if name in tiers else None for name, value in zip(TIER_NAMES, values, strict=True)
    ]
    return kept[0], kept[1], kept[2], kept[3], kept[4], kept[5]


class CppTiers(msgspec.Struct, omit_defaults=True):
    """One DP rank's cumulative hit, in tokens, under the tiers asked for."""

    gpu: int | None = None
    cpu: int | None = None
    npu: int | None = None
    cpu_local: int | None = None
    cpu_share: int | None = None
    disk: int | None = None


class CppMatch(msgspec.Struct, omit_defaults=True):
    """One instance's ``/query`` answer in upstream C++'s shape: ``dp`` is each rank's GPU
    hit, ``rank_matches`` each rank's tiers (ranks as decimal strings), the instance tiers
    the best of its ranks, ``longest_matched`` its disk tier. A struct, as ``GoMatch`` in
    ``conductor.api``: several times faster to make than the dict it encodes as."""

    longest_matched: int
    dp: dict[str, int]
    rank_matches: dict[str, CppTiers]
    gpu: int | None = None
    cpu: int | None = None
    npu: int | None = None
    cpu_local: int | None = None
    cpu_share: int | None = None
    disk: int | None = None


def cpp_match(match: InstanceMatch, tiers: frozenset[str] = EVERY_TIER) -> CppMatch:
    """One instance's answer; ranks in numeric order, as upstream's std::map keeps them."""
    ranks = match.ranks
    if len(ranks) == 1:  # one DP rank: most engines
        ((rank, hits),) = ranks.items()
        name = str(rank)
        dp = {name: hits[0]}
        tiers_of = {name: CppTiers(*tier_values(hits, tiers))}
    else:
        dp, tiers_of = {}, {}
        for rank, hits in sorted(ranks.items()):
            dp[str(rank)] = hits[0]
            tiers_of[str(rank)] = CppTiers(*tier_values(hits, tiers))
    best = (match.gpu, match.cpu_local, match.cpu, match.disk)
    return CppMatch(match.disk, dp, tiers_of, *tier_values(best, tiers))
