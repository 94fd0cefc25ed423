"""What a load from the Mooncake store costs, as the engines themselves measure it.

vLLM's MooncakeStoreConnector reports on ``/metrics`` the bytes its store reads returned and
the seconds they took (``vllm:mooncake_store_operation_bytes_total`` and
``..._time_seconds_sum`` with ``operation="load_get"``), and vLLM counts the prompt tokens
it got from the connector (``vllm:external_prefix_cache_hits_total``). Between two scrapes
of one engine, bytes ÷ seconds is the bandwidth its loads reached and bytes ÷ tokens the KV
bytes per token: the two numbers of the router's store cost. Per-request figures cannot
give them: an answer's ``cached_tokens`` does not separate GPU hits from store loads, and
its TTFT mixes the load with queueing and compute that costs far more per token
(bench.store_bench times a load against recomputing).
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine_metrics import Sample, parse_metrics

HIT_TOKENS = "vllm:external_prefix_cache_hits_total"
LOAD_BYTES = "vllm:mooncake_store_operation_bytes_total"
LOAD_SECONDS = "vllm:mooncake_store_operation_time_seconds_sum"
STORE_METRICS = (HIT_TOKENS, LOAD_BYTES, LOAD_SECONDS)  # what ``loads_in`` reads


@dataclass(frozen=True, slots=True)
class StoreLoads:
    """One engine's cumulative store loads (successful reads only)."""

    tokens: float
    bytes: float
    seconds: float

    def since(self, earlier: StoreLoads | None) -> StoreLoads | None:
        """The loads between ``earlier`` and now; None without a baseline or after the
        engine restarted (its counters went back)."""
        if earlier is None:
            return None
        delta = StoreLoads(
            self.tokens - earlier.tokens,
            self.bytes - earlier.bytes,
            self.seconds - earlier.seconds,
        )
        return delta if min(delta.tokens, delta.bytes, delta.seconds) >= 0 else None


def store_loads(metrics_text: str) -> StoreLoads | None:
    """The store-load counters of a ``/metrics`` text (see ``loads_in``)."""
    return loads_in(parse_metrics(metrics_text)[0])


def loads_in(samples: list[Sample]) -> StoreLoads | None:
    """The store-load counters of a ``/metrics`` scrape's samples; None when it is no vLLM
    engine's (no external prefix-cache counter). Reads not reported yet count as 0:
    labelled counters appear at their first increment. Lines that do not parse are
    skipped (``engine_metrics``)."""
    totals = dict.fromkeys(STORE_METRICS, 0.0)
    seen = set()
    for sample in samples:
        if sample.name not in totals:
            continue
        if sample.name != HIT_TOKENS and (
            sample.labels.get("operation") != "load_get" or sample.labels.get("status") != "ok"
        ):
            continue
        totals[sample.name] += sample.value
        seen.add(sample.name)
    if HIT_TOKENS not in seen:
        return None
    return StoreLoads(totals[HIT_TOKENS], totals[LOAD_BYTES], totals[LOAD_SECONDS])
