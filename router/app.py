"""The proxy: a request passes through the stages once each, in order.

1. ``client_request``: the JSON body, read and checked within the limits; which endpoint.
2. ``prompt_ids``: the prompt's ids: given, the shared tokenizer, or an engine's.
3. ``lookup``: each instance's hit, from the index (``index_client``: a conductor service
   or the index in the router) and the prompts in flight.
4. ``decision``: the policy's choice among the healthy instances (and a decode instance).
5. ``forwarding``: the call to the engine and the answer streamed back, retried on the
   next-best instance while one fails; ``in_flight`` holds the request's load meanwhile.
6. ``upkeep``: beside every request, the background tasks (probes, scrapes, registrations,
   reports, store states, the tokenizer's verification).

This module builds the stages from the configuration, starts and stops what they own, and
answers the endpoints: a completion runs through the stages; ``/tokenize``, ``/v1/models``,
``/health`` and ``/metrics`` read them. A response carries the decision in
``x-conductor-*`` headers so operators can see why a request went where it went; every
error is OpenAI-shaped (``errors.ApiError``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from conductor.runtime import LoopLagMonitor

from .client_request import read_completion, read_tokenize
from .conductor_client import ConductorClient
from .config import RouterConfig
from .decision import Decider, Routed
from .embedded import EmbeddedConductor
from .errors import ApiError
from .forwarding import Forwarder
from .in_flight import InFlight
from .index_client import IndexClient
from .lookup import IndexLookup
from .metrics import RouterMetrics
from .notices import Notices
from .pending import PendingPrefixes
from .policy import RoutingParams, SloViolation
from .pool import CostLearner, InstancePool
from .prompt_ids import TOKENIZED_BY, PromptTokenizer
from .rotation import Rotation
from .sessions import UpstreamSessions
from .upkeep import Upkeep

log = logging.getLogger(__name__)


class Router:
    """The stages of one router and its endpoints. The index and the stages that ask it
    are made by ``start`` (in the event loop: they own connections or subscriptions)."""

    index: IndexClient
    lookup: IndexLookup
    forwarder: Forwarder
    upkeep: Upkeep

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.limits = config.limits
        self.params: RoutingParams = config.routing_params()
        self.learner = CostLearner(self.params.cost) if config.routing.learn_cost_model else None
        self.pool = InstancePool.build(
            ((i.instance_id, i.http_endpoint) for i in config.prefill.instances),
            (
                (i.instance_id or f"decode-{n}", i.http_endpoint)
                for n, i in enumerate(config.decode.instances)
            ),
            config.kv_stores(),
            retry_after_s=config.upstream.probe_interval_seconds,
        )
        self.metrics = RouterMetrics()
        self.pending = PendingPrefixes() if config.routing.in_flight_prefixes else None
        self.notices = Notices(log)
        self.lag = LoopLagMonitor(self.metrics.registry, "router")
        self.sessions = UpstreamSessions(config.upstream.connect_timeout_seconds)
        self.rotation = Rotation(self.pool, self.metrics, self.notices, self.pending)
        # raises TokenizerUnavailable (a ValueError) for a directory it cannot read
        self.tokenizer = PromptTokenizer(
            config, self.metrics, self.pool, self.sessions, self.rotation
        )
        self.decider = Decider(self.params, self.learner, self.pool, self.metrics)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self.lag.start()
        self.sessions.open(self.pool.all())
        self.rotation.start()
        self.metrics.publish_cost_model(self.params.cost)
        self.index = self._connect_index()
        self.lookup = IndexLookup(self.index, self.pending, self.metrics, self.params.block_size)
        in_flight = InFlight(
            self.pool,
            self.metrics,
            self.pending,
            self.index,
            self.config.routing.in_flight_grace_seconds,
        )
        self.forwarder = Forwarder(
            self.decider, in_flight, self.rotation, self.sessions, self.pool, self.learner,
            self.metrics, self.config.upstream,
        )  # fmt: skip
        self.upkeep = Upkeep(
            self.config, self.index, self.pool, self.rotation, self.sessions, self.tokenizer,
            self.learner, self.metrics,
        )  # fmt: skip
        self.tokenizer.publish()
        self.upkeep.start()

    def _connect_index(self) -> IndexClient:
        if self.config.conductor.embedded:
            return EmbeddedConductor(self.config.prefill.config)
        return ConductorClient.connect(
            self.config.conductor, self.config.prefill.config, self.notices
        )

    async def stop(self) -> None:
        await asyncio.gather(self.upkeep.stop(), self.lag.stop())
        await self.index.close()
        await self.sessions.close()

    # -- endpoints -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` and ``/v1/chat/completions``, through every stage."""
        started = time.perf_counter()
        client = await read_completion(request, self.limits)
        self._refuse_unserved(client.model)
        tokenized = await self.tokenizer.tokenize(client)
        lookup = await self.lookup.find(tokenized.tokens, client.cache_salt)
        return await self.forwarder.forward(request, Routed(tokenized, lookup, started))

    async def tokenize_prompt(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` (a ``prompt``, or ``messages`` for a chat): answered by the
        router's own tokenizer on an endpoint an engine agreed on, when the engines' model
        list gives the model's ``max_model_len``; else passed on to an engine's
        ``/tokenize`` (its answer, errors included, as it gave it).
        ``x-conductor-tokenized-by`` says which (``local`` or ``engine``)."""
        client = await read_tokenize(request, self.limits)
        if client.model is not None:  # optional here: the configured model
            self._refuse_unserved(client.model)
        answer = await self.tokenizer.local_answer(client)
        if answer is not None:
            return web.json_response(answer, headers={TOKENIZED_BY: "local"})
        async for upstream, status, answered in self.tokenizer.engines_tokenize(
            client.raw, client.forwarded
        ):
            if status < 500:
                headers = {
                    TOKENIZED_BY: "engine",
                    "x-conductor-prefill-instance": upstream.instance_id,
                }
                return web.Response(
                    body=answered, status=status, content_type="application/json", headers=headers
                )
        raise ApiError(503, "no prefill instance answered /tokenize", "ServiceUnavailableError")

    def _refuse_unserved(self, model: Any) -> None:
        """vLLM's own 404 for a model no upstream serves, without a round trip."""
        if self.pool.serves_nowhere(model):
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    async def models(self, request: web.Request) -> web.Response:
        """What the upstreams serve; the configured model until any list is known."""
        data = self.pool.served_models() or [
            {
                "id": self.config.prefill.config.modelname,
                "object": "model",
                "owned_by": "conductor-router",
            }
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        """``degraded`` with the reasons while no prefill instance is in rotation (a 503:
        nothing can be served) or no conductor can be asked (a 200: requests are routed by
        load meanwhile)."""
        healthy = [u.instance_id for u in self.pool.prefill.values() if u.healthy]
        reasons = [] if healthy else ["no prefill instance is in rotation"]
        reasons += self.index.degraded_reasons()
        body: dict[str, Any] = {
            "status": "degraded" if reasons else "ok",
            "reasons": reasons,
            "prefill_instances": healthy,
            "decode_instances": [u.instance_id for u in self.pool.healthy_decode()],
            "policy": self.params.policy,
            "event_loop_lag_worst_seconds": round(self.lag.worst, 4),
            "conductors": self.index.states(),
            "tasks": self.upkeep.health(),
        }
        if self.upkeep.store_states:
            body["kv_stores"] = self.upkeep.store_states
        return web.json_response(body, status=200 if healthy else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry) + self.index.exposition()
        response = web.Response(body=body)
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response


def create_app(router: Router) -> web.Application:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except ApiError as error:
            response = error.response()
        except SloViolation as violation:
            router.metrics.rejections.labels("ttft_slo").inc()
            response = ApiError(429, str(violation)).response()
        except web.HTTPException as error:
            if error.status < 400:
                raise
            response = ApiError(error.status, error.reason).response()
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away: nothing to answer
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = ApiError(500, "internal error").response()
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        router.metrics.requests.labels(route, str(response.status)).inc()
        if response.status in (502, 503, 504):
            router.metrics.rejections.labels(f"http_{response.status}").inc()
        return response

    app = web.Application(client_max_size=router.limits.max_body_bytes + 1, middlewares=[errors])
    app.add_routes(
        [
            web.post("/v1/completions", router.completions),
            web.post("/v1/chat/completions", router.completions),
            web.post("/tokenize", router.tokenize_prompt),
            web.get("/v1/models", router.models),
            web.get("/health", router.health),
            web.get("/metrics", router.prometheus),
        ]
    )

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
