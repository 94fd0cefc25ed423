"""Stage 6, beside every request: the router's background tasks, started and stopped
together.

- ``learn_models``: what each upstream serves (``/v1/models``), at once and again for every
  healthy upstream whose list is unknown; one that does not serve its configured model is
  a warning.
- ``probe_unhealthy``: each upstream out of rotation, until its ``/health`` answers 200.
- ``refresh_engine_load``: each engine's ``/metrics``: its own running and waiting requests
  (load other clients put on it) and its store loads (the store's learned cost).
- ``keep_registered``: the event streams registered with the index, again every
  ``reregister_interval_seconds`` so that a restarted conductor relearns them.
- ``report_dead_upstreams``: the instances out of rotation, told to the index.
- ``watch_stores``: each Mooncake store's state as the index knows it (while one is down
  its loads are not priced).
- ``watch_keys``: the keys file, reread when it changes.
- ``tokenizers``: each model's own tokenizer: loaded from the model directory its engines
  name when none was found at start, then checked against an engine's ``/tokenize``.

Each is supervised: a failure is logged with its traceback, counted
(``router_task_failures_total``) and the task restarted with backoff; ``/health`` shows
each one's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from conductor.failures import describe
from conductor.runtime import SupervisedTask
from conductor.states import StoreState

from .config import RouterConfig
from .engine_metrics import IN_FLIGHT, Sample, engine_in_flight, parse_metrics
from .index_client import ConductorUnavailable, IndexClient
from .keys import KeyRing
from .metrics import RouterMetrics
from .models import ServedModel
from .pool import CostLearner, InstancePool, Upstream
from .rotation import Rotation
from .sessions import UpstreamSessions
from .store_loads import STORE_METRICS, loads_in

log = logging.getLogger("router.app")  # the router's lines keep their logger (docs/router.md)

MODELS_RETRY_S = 2.0  # how soon an upstream whose model list is unknown is asked again
DOWN_TTL_PROBES = 3  # an /instance_down mark lasts this many probe intervals (re-sent)
REGISTER_RETRY_S = 1.0  # a failed registration round is retried this soon, then less often
SCRAPED_METRICS = frozenset((*IN_FLIGHT, *STORE_METRICS))  # what an engine scrape reads


class Upkeep:
    def __init__(
        self,
        config: RouterConfig,
        index: IndexClient,
        pool: InstancePool,
        rotation: Rotation,
        sessions: UpstreamSessions,
        models: dict[str, ServedModel],
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self._timeouts = config.upstream
        self._index = index
        self._pool = pool
        self._rotation = rotation
        self._sessions = sessions
        self._models = models
        self._metrics = metrics
        self.tasks: dict[str, SupervisedTask] = {}
        # each configured store's state as the index last reported it
        self.store_states = dict.fromkeys(
            sorted(set(config.kv_stores().values())), StoreState.UNCHECKED
        )

    def start(self, keys: KeyRing | None = None) -> None:
        """Every task; ``keys``: a keys file to watch for changes."""
        for store in self.store_states:
            self._metrics.store_up.labels(store).set(1)
        background: dict[str, Callable[[], Awaitable[None]]] = {
            "learn_models": self._learn_models,  # meanwhile, not after registering
            "probe_unhealthy": self._probe_unhealthy,
            "refresh_engine_load": self._refresh_engine_load,
            "keep_registered": self._keep_registered,
            "report_dead_upstreams": self._report_dead_upstreams,
            "tokenizers": self._settle_tokenizers,
        }
        if self.store_states:  # no store, nothing to watch
            background["watch_stores"] = self._watch_stores
        if keys is not None:
            background["watch_keys"] = keys.watch
        for name, factory in background.items():
            self.tasks[name] = SupervisedTask(name, factory, self._metrics.task_failures)
            self.tasks[name].start()

    async def stop(self) -> None:
        await asyncio.gather(*(task.stop() for task in self.tasks.values()))

    def health(self) -> dict[str, dict[str, Any]]:
        """Each task as ``/health`` shows it."""
        return {
            name: {"state": task.state, "restarts": task.restarts, "last_error": task.last_error}
            for name, task in self.tasks.items()
        }

    def _control_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self._timeouts.control_timeout_seconds)

    # -- the engines -----------------------------------------------------------------------
    async def _learn_models(self) -> None:
        """What each upstream serves: at once (never holding start-up back), then for every
        healthy upstream whose list is unknown (unreachable so far, or back after a failure)."""
        while True:
            unknown = [u for u in self._pool.all() if u.healthy and u.models is None]
            await asyncio.gather(*(self._learn(upstream) for upstream in unknown))
            await asyncio.sleep(MODELS_RETRY_S)

    async def _learn(self, upstream: Upstream) -> None:
        try:
            async with self._sessions.to(upstream).get(
                "/v1/models", timeout=self._control_timeout()
            ) as response:
                if response.status != 200:
                    return
                upstream.models = served_models(await response.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        names = upstream.model_names()
        if upstream.model not in names:
            log.warning(
                "upstream instance=%s url=%s serves %s, not the configured modelname %r "
                "(registered with the conductor): requests for it cannot be served there",
                upstream.instance_id,
                upstream.url,
                names,
                upstream.model,
            )

    async def _probe_unhealthy(self) -> None:
        """Probe each upstream out of rotation (every ``probe_interval_seconds``); a 200 on
        ``/health`` brings it back."""
        while True:
            await asyncio.sleep(self._timeouts.probe_interval_seconds / 2)
            for upstream in self._pool.due_for_probe():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self._sessions.to(upstream).get(
                        "/health", timeout=self._control_timeout()
                    ) as response:
                        if response.status == 200:
                            self._rotation.bring_back(upstream)
                            continue
                self._rotation.take_out(upstream, "its /health does not answer 200")

    async def _refresh_engine_load(self) -> None:
        """Engines' own running+waiting counts, for load that other clients put on them,
        and their store loads, for the store's cost."""
        while True:
            await asyncio.sleep(self._timeouts.metrics_interval_seconds)
            for upstream in self._pool.all():
                if upstream.healthy:
                    await self._scrape(upstream)

    async def _scrape(self, upstream: Upstream) -> None:
        """One engine's ``/metrics``: lines that do not parse and values out of range are
        skipped and counted, the rest still count. An engine that refuses the connection is
        out of rotation (found even while no request goes there)."""
        try:
            async with self._sessions.to(upstream).get(
                "/metrics", timeout=self._control_timeout()
            ) as response:
                text = await response.text()
        except TimeoutError:  # slow is not dead
            return
        except aiohttp.ClientConnectionError as error:  # refused or reset: gone
            self._rotation.take_out(upstream, f"/metrics: {describe(error)}")
            return
        except (aiohttp.ClientError, ValueError):
            return
        samples, skipped = parse_metrics(text, SCRAPED_METRICS)
        upstream.engine_in_flight, rejected = engine_in_flight(samples)
        self._metrics.rejected("metrics_line", skipped)
        self._metrics.rejected("metrics_value", rejected)
        served = self._models.get(upstream.model)
        if upstream.kv_store and served is not None and served.learner is not None:
            self._learn_store_loads(served.name, served.learner, upstream, samples)

    def _learn_store_loads(
        self, model: str, learner: CostLearner, upstream: Upstream, samples: list[Sample]
    ) -> None:
        loads = loads_in(samples)
        if loads is None:
            return
        delta = loads.since(upstream.store_loads)
        upstream.store_loads = loads
        if delta is not None:
            learner.observe_store_loads(delta)
            self._metrics.publish_cost_model(model, learner.model)

    async def _settle_tokenizers(self) -> None:
        """Each model's own tokenizer: found (in the directory its engines name) and
        checked against an engine's word on each endpoint. Models whose tokenizer is settled
        are not looked at again; those without one are, as their engines come and go."""
        unsettled = dict(self._models)
        while unsettled:
            for name, model in list(unsettled.items()):
                if await model.tokenizer.find_local() and await model.tokenizer.verify():
                    del unsettled[name]
            await asyncio.sleep(MODELS_RETRY_S)

    # -- the index -------------------------------------------------------------------------
    async def _keep_registered(self) -> None:
        """Register at once, in the background: the router listens and routes by load
        meanwhile (``/health`` says why it is degraded). Then again every
        ``reregister_interval_seconds`` (idempotent) so that a restarted conductor relearns
        the streams; a round that failed is retried sooner, backing off up to that interval."""
        interval = self._config.conductor.reregister_interval_seconds
        retry = REGISTER_RETRY_S
        while True:
            if await self._index.register(self._config.served_models()):
                retry, wait = REGISTER_RETRY_S, interval
            else:
                retry, wait = min(retry * 2, interval), min(retry, interval)
            await asyncio.sleep(wait)

    async def _report_dead_upstreams(self) -> None:
        """Tell the index which prefill instances are out of rotation, so their blocks stop
        counting in ``/query``: ``/instance_down`` with a TTL of a few probe intervals,
        re-sent every interval while it stays out, and ``/instance_up`` once it is back
        (were that lost, the mark expires)."""
        interval = self._timeouts.probe_interval_seconds
        registered = {
            i.instance_id: model.tenant_id
            for model in self._config.served_models()
            for i in model.instances
            if i.registrations
        }
        sent: dict[str, float] = {}  # instance → when its down mark was last sent
        changed = self._rotation.changed
        while True:
            changed.clear()
            for instance_id, tenant in registered.items():
                upstream = self._pool.prefill[instance_id]
                now = time.monotonic()
                if not upstream.healthy and now - sent.get(instance_id, -interval) >= interval:
                    sent[instance_id] = now
                    await self._index.report_instance(
                        instance_id, tenant, True, DOWN_TTL_PROBES * interval,
                        "router: out of rotation",
                    )  # fmt: skip
                elif upstream.healthy and sent.pop(instance_id, None) is not None:
                    await self._index.report_instance(instance_id, tenant, False, 0.0, "")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await changed.wait()

    async def _watch_stores(self) -> None:
        """The index's word on each configured store. Without an answer the last word
        stands: the conductor's queries fail too, and routing falls back."""
        interval = self._config.conductor.store_check_interval_seconds
        while True:
            with contextlib.suppress(ConductorUnavailable):
                states = await self._index.store_states(timeout=min(interval, 1.0))
                for store in self.store_states:
                    self._set_store_state(store, states.get(store, StoreState.UNCHECKED))
            await asyncio.sleep(interval)

    def _set_store_state(self, store: str, state: StoreState) -> None:
        previous, self.store_states[store] = self.store_states[store], state
        if (previous is StoreState.DOWN) == (state is StoreState.DOWN):
            return
        if state is StoreState.DOWN:
            self._pool.stores_down.add(store)
            log.warning("kv store %s is down: its loads are not priced, nothing is pulled", store)
        else:
            self._pool.stores_down.discard(store)
            log.info("kv store %s is %s: its loads are priced again", store, state)
        self._metrics.store_up.labels(store).set(0 if state is StoreState.DOWN else 1)


def served_models(answer: Any) -> tuple[dict[str, Any], ...]:
    """The entries of a ``/v1/models`` answer that name a model (others are skipped)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    cards = data if isinstance(data, list) else []
    return tuple(c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str))
