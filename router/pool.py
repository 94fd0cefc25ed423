"""The router's view of its engines: health, load and store per instance, and the cost
model it learns from observed TTFTs and the engines' store loads. Synchronous; the app's
tasks feed it."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from yarl import URL

from .policy import Candidate, PrefillCostModel
from .store_loads import StoreLoads

RETRY_AFTER_FAILURE_S = 1.0
# one observation moves the learned per-token cost by at most this factor of itself: a
# single absurd TTFT (a stalled engine, a bad clock) cannot price every instance out of
# the SLO (every later request a 429, so nothing is learned that would undo it)
MAX_SAMPLE_RATIO = 4.0


@dataclass(slots=True)
class Upstream:
    """One engine instance (prefill or decode) and the load the router put on it."""

    instance_id: str
    url: str
    model: str = ""  # the base model it serves, as configured ("": any, in unit tests)
    host: str = field(init=False)  # of ``url``, once: a trace's upstream span names them
    port: int = field(init=False)
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    # the other router replicas' load on it, as the conductor last said (replica_load.py)
    others_in_flight: int = 0
    others_queued_prefill_tokens: int = 0
    engine_in_flight: int = 0  # running + waiting, as the engine's /metrics last said
    healthy: bool = True
    requests: int = 0
    # its ``/v1/models`` entries; None until learned, and again after a failure (it may
    # come back as another deployment)
    models: tuple[dict[str, Any], ...] | None = None
    kv_store: str = ""  # the Mooncake store master it saves to and loads from ("": none)
    store_loads: StoreLoads | None = None  # its store-load counters at the last scrape

    def __post_init__(self) -> None:
        url = URL(self.url)
        self.host, self.port = url.host or "", url.port or 0

    @property
    def load(self) -> int:
        """In-flight requests: the router replicas', or the engine's own count when others
        use it too."""
        return max(self.in_flight + self.others_in_flight, self.engine_in_flight)

    @property
    def queue_tokens(self) -> int:
        """Uncached prompt tokens the router replicas sent and the engine has not prefilled."""
        return self.queued_prefill_tokens + self.others_queued_prefill_tokens

    def model_names(self) -> list[str]:
        return [card["id"] for card in self.models or ()]

    def may_serve(self, model: Any) -> bool:
        """False only when its list is known and lacks ``model``."""
        return self.models is None or any(card["id"] == model for card in self.models)


@dataclass(slots=True)
class Ticket:
    """One request's claim on an upstream; release exactly once, whatever happens."""

    upstream: Upstream
    prefill_tokens: int
    changed: Callable[[], None] | None = None  # the pool's load listener
    prefilled: bool = False
    released: bool = False

    def first_token(self) -> None:
        if not self.prefilled:
            self.prefilled = True
            self.upstream.queued_prefill_tokens -= self.prefill_tokens
            if self.changed is not None:
                self.changed()

    def release(self) -> None:
        if not self.released:
            self.first_token()
            self.released = True
            self.upstream.in_flight -= 1
            if self.changed is not None:
                self.changed()


@dataclass(slots=True)
class CostLearner:
    """Fits the per-token prefill cost from observed TTFTs (exponential moving average),
    and the store's cost from the engines' own store-load counters.

    Of the prefill constants only ``per_token_s`` is learned: it dominates prefill time and
    one scalar converges from few samples. The store's bytes per token and bandwidth are
    ratios of exponentially weighted sums (bytes ÷ tokens, bytes ÷ seconds), so a scrape
    with many loads weighs more than one with a single small load.
    """

    model: PrefillCostModel
    weight: float = 0.1
    samples: int = 0
    store_samples: int = 0
    _loads: tuple[float, float, float] = (0.0, 0.0, 0.0)  # weighted tokens, bytes, seconds

    def observe(self, new_tokens: int, queued_tokens: int, ttft_s: float) -> None:
        """A request with ``new_tokens`` to compute, sent behind ``queued_tokens``, took
        ``ttft_s`` to its first token."""
        work = new_tokens + queued_tokens
        if work <= 0 or ttft_s <= self.model.overhead_s:
            return
        current = self.model.per_token_s
        per_token = (ttft_s - self.model.overhead_s) / work
        if current > 0:
            per_token = min(max(per_token, current / MAX_SAMPLE_RATIO), current * MAX_SAMPLE_RATIO)
        learned = (1 - self.weight) * self.model.per_token_s + self.weight * per_token
        self.model = dataclasses.replace(self.model, per_token_s=learned)
        self.samples += 1

    def observe_store_loads(self, loads: StoreLoads) -> None:
        """What one engine loaded from the store between two scrapes."""
        if loads.tokens <= 0 or loads.bytes <= 0 or loads.seconds <= 0:
            return
        keep = 1 - self.weight
        tokens, nbytes, seconds = (
            keep * old + new
            for old, new in zip(
                self._loads, (loads.tokens, loads.bytes, loads.seconds), strict=True
            )
        )
        self._loads = (tokens, nbytes, seconds)
        self.model = dataclasses.replace(
            self.model,
            store_bytes_per_token=nbytes / tokens,
            store_bandwidth_bytes_s=nbytes / seconds,
        )
        self.store_samples += 1


@dataclass
class InstancePool:
    prefill: dict[str, Upstream]
    decode: dict[str, Upstream] = field(default_factory=dict)
    stores_down: set[str] = field(default_factory=set)  # stores the conductor reports down
    retry_after_s: float = RETRY_AFTER_FAILURE_S  # how soon a failed upstream is probed
    # called whenever this router's own load on an upstream changes (replica_load.py)
    load_listener: Callable[[], None] | None = None
    _retry_at: dict[str, float] = field(default_factory=dict)
    _others: set[str] = field(default_factory=set)  # upstreams the other replicas load

    @classmethod
    def build(
        cls,
        prefill: Iterable[tuple[str, str]],
        decode: Iterable[tuple[str, str]] = (),
        kv_stores: Mapping[str, str] | None = None,
        retry_after_s: float = RETRY_AFTER_FAILURE_S,
        models: Mapping[str, str] | None = None,
    ) -> InstancePool:
        """``kv_stores``: instance_id → the store master it shares (prefill instances);
        ``models``: instance_id → the base model it serves."""
        stores, bases = kv_stores or {}, models or {}
        return cls(
            {
                name: Upstream(
                    name, url.rstrip("/"), bases.get(name, ""), kv_store=stores.get(name, "")
                )
                for name, url in prefill
            },
            {name: Upstream(name, url.rstrip("/"), bases.get(name, "")) for name, url in decode},
            retry_after_s=retry_after_s,
        )

    def all(self) -> list[Upstream]:
        return [*self.prefill.values(), *self.decode.values()]

    def candidates(
        self,
        hits: Mapping[str, tuple[int, int, int]],
        model: Any = None,
        out_of_rotation: bool = False,
        base: str | None = None,
    ) -> list[Candidate]:
        """Healthy prefill instances (``out_of_rotation``: the others) with their (GPU, CPU,
        DISK) hit and load; with a ``base`` model, only its instances, and with a ``model``
        (the name requested: the base's or an adapter's), only those that may serve it (an
        unknown list may). While an instance's store is down its hit is its GPU hit alone:
        the engine recomputes the rest."""
        candidates = []
        for up in self.prefill.values():
            if (
                up.healthy == out_of_rotation
                or (base is not None and up.model != base)
                or (model is not None and not up.may_serve(model))
            ):
                continue
            gpu, cpu, disk = hits.get(up.instance_id, (0, 0, 0))
            store = bool(up.kv_store)
            if up.kv_store in self.stores_down:
                cpu = disk = gpu
                store = False
            candidates.append(
                Candidate(
                    up.instance_id,
                    gpu,
                    cpu,
                    disk,
                    in_flight=up.load,
                    queued_prefill_tokens=up.queue_tokens,
                    store=store,
                )
            )
        return candidates

    def served_models(self) -> list[dict[str, Any]]:
        """Every model and adapter some upstream in rotation serves, each once (the first
        upstream's entry)."""
        cards: dict[str, dict[str, Any]] = {}
        for up in self.all():
            for card in up.models or () if up.healthy else ():
                cards.setdefault(card["id"], card)
        return list(cards.values())

    def serves_nowhere(self, model: Any, base: str | None = None) -> bool:
        """True only when no upstream (of the ``base`` model's, when given) serves ``model``
        and every one that could take the request has said what it serves: an unknown list
        never rejects a request. Asked per request (``models.Catalog.resolve``): one pass,
        ended by the first upstream that serves it or has not said."""
        known = False
        for up in itertools.chain(self.prefill.values(), self.decode.values()):
            if base is not None and up.model != base:
                continue
            if up.models is None:
                if up.healthy:
                    return False
            elif up.may_serve(model):
                return False
            else:
                known = True
        return known

    def base_of(self, name: str) -> tuple[str, bool] | None:
        """The base model of the upstreams whose list names ``name``, and whether it is an
        adapter there (its card names a ``parent``); None when no known list names it."""
        for up in self.all():
            for card in up.models or ():
                if card["id"] == name:
                    return up.model, card.get("parent") is not None
        return None

    def lists_unknown(self, base: str) -> bool:
        """Some upstream of ``base`` in rotation has not said what it serves yet."""
        return any(up.healthy and up.models is None and up.model == base for up in self.all())

    def max_model_len(self, model: str) -> int | None:
        """``model``'s context length as an upstream's ``/v1/models`` entry gives it (vLLM's
        do); None while none does."""
        for up in self.all():
            for card in up.models or ():
                length = card.get("max_model_len")
                if card["id"] == model and type(length) is int and length > 0:
                    return length
        return None

    def roots(self, model: str) -> list[str]:
        """The model directories ``model``'s upstreams name for it (vLLM's card ``root``)."""
        return list(
            dict.fromkeys(
                card["root"]
                for up in self.all()
                if up.model == model
                for card in up.models or ()
                if card["id"] == model and isinstance(card.get("root"), str)
            )
        )

    def healthy_decode(self, base: str | None = None) -> list[Upstream]:
        """The decode instances in rotation (of the ``base`` model's, when given)."""
        return [up for up in self.decode.values() if up.healthy and base in (None, up.model)]

    def claim(self, upstream: Upstream, prefill_tokens: int) -> Ticket:
        upstream.in_flight += 1
        upstream.requests += 1
        upstream.queued_prefill_tokens += prefill_tokens
        if self.load_listener is not None:
            self.load_listener()
        return Ticket(upstream, prefill_tokens, self.load_listener)

    def own_loads(self) -> dict[str, tuple[int, int]]:
        """This router's (queued prefill tokens, in-flight requests) per upstream it loads."""
        return {
            up.instance_id: (up.queued_prefill_tokens, up.in_flight)
            for up in self.all()
            if up.queued_prefill_tokens or up.in_flight
        }

    def set_others(self, loads: Mapping[str, tuple[int, int]]) -> None:
        """The other router replicas' (queued prefill tokens, in-flight requests) per
        upstream; those not named carry none."""
        for name in self._others - loads.keys():
            if (up := self.prefill.get(name) or self.decode.get(name)) is not None:
                up.others_queued_prefill_tokens = up.others_in_flight = 0
        for name, (queued, in_flight) in loads.items():
            if (up := self.prefill.get(name) or self.decode.get(name)) is not None:
                up.others_queued_prefill_tokens, up.others_in_flight = queued, in_flight
        self._others = set(loads)

    def mark_failed(self, upstream: Upstream, now: float | None = None) -> None:
        """Take it out of rotation; the health prober brings it back."""
        upstream.healthy = False
        upstream.models = None
        self._retry_at[upstream.instance_id] = (
            time.monotonic() if now is None else now
        ) + self.retry_after_s

    def due_for_probe(self, now: float | None = None) -> list[Upstream]:
        now = time.monotonic() if now is None else now
        return [
            up
            for up in self.all()
            if not up.healthy and self._retry_at.get(up.instance_id, 0.0) <= now
        ]

    def mark_healthy(self, upstream: Upstream) -> None:
        upstream.healthy = True
        self._retry_at.pop(upstream.instance_id, None)
