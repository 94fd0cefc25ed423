"""Stage 4 of a request: where it goes.

The healthy prefill instances not tried yet that may serve the model are the candidates,
with their hits and load; the policy (``policy.py``) picks one, least loaded without the
index's answer, and with disaggregation the least loaded decode instance goes with it. A
longer prefix left on another instance is counted (``router_cache_forgone_tokens_total``);
at DEBUG each decision is one log line.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .errors import ApiError
from .index_client import Hits
from .lookup import Lookup
from .metrics import RouterMetrics
from .policy import Candidate, Decision, RoutingParams, choose
from .pool import CostLearner, InstancePool, Upstream
from .prompt_ids import Tokenized
from .tracing import RequestTrace

if TYPE_CHECKING:
    from .models import Target

log = logging.getLogger("router.app")  # the router's lines keep their logger (docs/router.md)

MAX_LOGGED_CANDIDATES = 16  # a routing decision's DEBUG line lists at most this many


@dataclass(frozen=True, slots=True)
class Routed:
    """One request on its way: what every attempt at it shares (the model and adapter it
    asks for, its prompt, the request as the engine gets it, the index's answer) and when
    the router received it."""

    target: Target
    tokenized: Tokenized
    lookup: Lookup
    started: float
    trace: RequestTrace


@dataclass(frozen=True, slots=True)
class Choice:
    """One attempt's instances: the policy's decision on the prefill instance, and the
    decode instance (None without disaggregation)."""

    decision: Decision
    prefill: Upstream
    decode: Upstream | None


class NoCandidates(ApiError):
    """Every prefill instance that may serve the request was tried, or none is left."""

    def __init__(self) -> None:
        super().__init__(503, "no healthy prefill instance", "ServiceUnavailableError")


class Decider:
    """One model's decisions: among its instances, with its routing settings."""

    def __init__(
        self,
        params: RoutingParams,
        learner: CostLearner | None,
        pool: InstancePool,
        metrics: RouterMetrics,
        base: str | None = None,
    ) -> None:
        self._params = params
        self._learner = learner
        self._pool = pool
        self._metrics = metrics
        self._base = base  # the model whose instances are candidates (None: every one)
        self._turn = itertools.count()  # rotates ties between equally good instances
        self._rng = random.Random()

    def choose(self, routed: Routed, exclude: set[str]) -> Choice:
        """The next attempt's instances, ``exclude`` (the instances tried) left out."""
        fallback = routed.lookup.fallback
        candidates = self.candidates(routed.lookup.hits, exclude, routed.target.name)
        decision = self.decide(routed.tokenized.count, candidates, fallback)
        decode = self.decode_instance()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(decision_line(decision, candidates, decode, fallback))
        return Choice(decision, self._pool.prefill[decision.instance_id], decode)

    def candidates(self, hits: Hits, exclude: set[str], model: object = None) -> list[Candidate]:
        """The model's healthy instances not yet tried that may serve ``model`` (the name
        asked for: the model's or an adapter's), with their hits and load. When every one is
        out of rotation they are tried anyway: one may be back before its next probe says
        so; a 503 when none is left."""
        for out_of_rotation in (False, True):
            candidates = [
                c
                for c in self._pool.candidates(hits, model, out_of_rotation, self._base)
                if c.instance_id not in exclude
            ]
            if candidates:
                return candidates
        raise NoCandidates()

    def decide(
        self, prompt_tokens: int, candidates: list[Candidate], fallback: str | None
    ) -> Decision:
        """Run the policy over ``candidates``; least_loaded without the index's answer."""
        params = self._params
        if self._learner is not None:
            params = replace(params, cost=self._learner.model)
        if fallback:
            params = replace(params, policy="least_loaded")
        decision = choose(params, candidates, next(self._turn), prompt_tokens, self._rng)
        self._metrics.decisions.labels(decision.policy, decision.instance_id).inc()
        longest = min(max(c.disk_tokens for c in candidates), prompt_tokens)  # cumulative tiers
        if longest > decision.cached_tokens:
            self._metrics.forgone_tokens.inc(longest - decision.cached_tokens)
        return decision

    def decode_instance(self) -> Upstream | None:
        """The least loaded healthy decode instance; None without disaggregation (a 503
        when every decode instance is out of rotation)."""
        if not self._pool.decode:
            return None
        decode_upstreams = self._pool.healthy_decode(self._base)
        if not decode_upstreams:
            raise ApiError(503, "no healthy decode instance", "ServiceUnavailableError")
        return min(decode_upstreams, key=lambda u: (u.load, u.requests))


def decision_line(
    decision: Decision,
    candidates: Sequence[Candidate],
    decode: Upstream | None,
    fallback: str | None,
) -> str:
    """A routing decision for the DEBUG log: where it went, the hit it counted on, the
    policy, each candidate's hit, load and score (the policy's: estimated TTFT seconds for
    ``ttft``, none for the simple ones), and why the index's answer is missing."""
    shown = []
    for c in candidates[:MAX_LOGGED_CANDIDATES]:
        text = f"{c.instance_id}:gpu={c.gpu_tokens}"
        if c.disk_tokens > c.gpu_tokens:
            text += f",cpu={c.cpu_tokens},disk={c.disk_tokens}"
        text += f",load={c.in_flight},queued={c.queued_prefill_tokens}"
        if (score := decision.scores.get(c.instance_id)) is not None:
            text += f",score={score:.6g}"
        shown.append(text)
    if len(candidates) > MAX_LOGGED_CANDIDATES:
        shown.append(f"+{len(candidates) - MAX_LOGGED_CANDIDATES}")
    return (
        f"route prefill={decision.instance_id} decode={decode.instance_id if decode else '-'} "
        f"cached_tokens={decision.cached_tokens} policy={decision.policy} "
        f"fallback={fallback or '-'} candidates={'|'.join(shown)}"
    )
