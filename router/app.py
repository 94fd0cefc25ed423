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
from conductor.security import BearerAuth, Unauthorized

from .admission import Admission
from .client_request import read_completion, read_tokenize
from .conductor_client import ConductorClient
from .config import ModelSection, RouterConfig
from .decision import Routed
from .embedded import EmbeddedConductor
from .errors import ApiError
from .forwarding import Forwarder
from .in_flight import InFlight
from .index_client import IndexClient
from .keys import PRIORITY_HEADER, ClientKey, KeyRing, effective_cache_salt
from .lookup import IndexLookup
from .metrics import RouterMetrics
from .models import Catalog, ServedModel, Target
from .notices import Notices
from .pending import PendingPrefixes
from .policy import SloViolation
from .pool import InstancePool
from .prompt_ids import TOKENIZED_BY
from .rotation import Rotation
from .sessions import UpstreamSessions
from .tracing import RequestTrace, make_tracer
from .upkeep import Upkeep

log = logging.getLogger(__name__)
TRACE = web.RequestKey("trace", RequestTrace)  # a completion's, for the error middleware


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
        sections = config.served_models()
        decode = _decode_instances(sections)
        models = {i.instance_id: m.modelname for m in sections for i in m.instances}
        self.pool = InstancePool.build(
            ((i.instance_id, i.http_endpoint) for m in sections for i in m.instances),
            ((name, url) for name, url, _ in decode),
            config.kv_stores(),
            retry_after_s=config.upstream.probe_interval_seconds,
            models=models | {name: model for name, _, model in decode},
        )
        self.metrics = RouterMetrics()
        in_flight_prefixes = any(m.routing.in_flight_prefixes for m in sections)
        self.pending = PendingPrefixes() if in_flight_prefixes else None
        self.notices = Notices(log)
        self.lag = LoopLagMonitor(self.metrics.registry, "router")
        self.sessions = UpstreamSessions(config.upstream.connect_timeout_seconds)
        self.rotation = Rotation(self.pool, self.metrics, self.notices, self.pending)
        # raises TokenizerUnavailable (a ValueError) for a directory it cannot read
        served = [
            ServedModel(
                section,
                config.limits,
                config.upstream,
                self.metrics,
                self.pool,
                self.sessions,
                self.rotation,
            )  # fmt: skip
            for section in sections
        ]
        self.catalog = Catalog(served, self.pool)
        # raises KeysFileError (a ValueError) for a keys file it cannot use
        self.keys = KeyRing(
            config.keys.file, self.metrics.registry, config.keys.reload_interval_seconds
        )
        self.admission = Admission(self.metrics.registry)
        for section in sections:
            self.admission.register_model(
                section.modelname,
                section.max_concurrent_requests or None,
                section.max_queued_requests,
            )
        # raises TracingUnavailable (a ValueError) when its packages are missing
        self.tracer = make_tracer(config.tracing)
        self.tracer.register_metrics(self.metrics.registry)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self.lag.start()
        self.sessions.open(self.pool.all())
        self.rotation.start()
        for served in self.catalog.models.values():
            self.metrics.publish_cost_model(served.name, served.params.cost)
            served.tokenizer.announce()
        self.index = self._connect_index()
        self.lookup = IndexLookup(self.index, self.pending, self.metrics)
        grace_s = max(m.section.routing.in_flight_grace_seconds for m in self._served())
        in_flight = InFlight(self.pool, self.metrics, self.pending, self.index, grace_s)
        self.forwarder = Forwarder(
            in_flight, self.rotation, self.sessions, self.pool, self.metrics, self.config.upstream
        )
        self.upkeep = Upkeep(
            self.config, self.index, self.pool, self.rotation, self.sessions,
            self.catalog.models, self.metrics,
        )  # fmt: skip
        self.upkeep.start(self.keys if self.keys.enabled else None)

    def _served(self) -> list[ServedModel]:
        return list(self.catalog.models.values())

    def _connect_index(self) -> IndexClient:
        if self.config.conductor.embedded:
            return EmbeddedConductor(self.config.conductor)
        return ConductorClient.connect(self.config.conductor, self.notices, self.pool)

    async def stop(self) -> None:
        await asyncio.gather(self.upkeep.stop(), self.lag.stop())
        await self.index.close()
        await self.sessions.close()
        await self.tracer.shutdown()

    # -- endpoints -----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``/v1/completions`` and ``/v1/chat/completions``: the client's key and limits,
        then every stage, each a span of the request's trace."""
        started = time.perf_counter()
        trace = request[TRACE] = self.tracer.begin(
            request.headers, method=request.method, route=request.path
        )
        key = self.keys.authenticate(request.headers.get("Authorization"))
        client = await read_completion(request, self.limits, self._engine_authorization(request))
        target = self._target(key, client.model)
        trace.set(model=target.name, key_id=key.id, tenant_id=key.tenant)
        if target.lora_name:
            trace.set(lora_name=target.lora_name)
        priority = self.keys.priority_of(key, request.headers.get(PRIORITY_HEADER))
        async with self.admission.admit(key, target.served.name, priority) as admitted:
            if key.isolated:
                client = client.with_cache_salt(effective_cache_salt(key, client.cache_salt))
            with trace.span("tokenize") as span:
                tokenized = await target.served.tokenizer.tokenize(client)
                span.set(tokenized_by=tokenized.by, prompt_tokens=tokenized.count)
            # a batch is counted as its first prompt's tokens times its prompts: the router
            # tokenizes the first one only, and the key pays for what the engines compute
            await admitted.charge_tokens(tokenized.count * len(client.prompts))
            with trace.span("index.query") as span:
                lookup = await self.lookup.find(
                    tokenized.tokens,
                    target.context,
                    client.cache_salt,
                    target.served.in_flight_prefixes,
                )
                if lookup.fallback:
                    span.set(fallback=lookup.fallback)
            # the router's own time: what it waited for the key's or the model's turn is not
            # the engine's time to first token (the cost model learns from that)
            routed = Routed(target, tokenized, lookup, started + admitted.queued_seconds, trace)
            return await self.forwarder.forward(request, routed)

    def _target(self, key: ClientKey, model: Any) -> Target:
        """The model the request names, if the key may use it (else the same 404)."""
        return self.catalog.resolve(model, key.allows)

    def _engine_authorization(self, request: web.Request) -> str | None:
        """The ``Authorization`` an engine gets: the engines' own key when configured; the
        client's, unless it was a key of the router's."""
        if self.config.upstream.api_key:
            return f"Bearer {self.config.upstream.api_key}"
        return None if self.keys.enabled else request.headers.get("Authorization")

    async def tokenize_prompt(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` (a ``prompt``, or ``messages`` for a chat): answered by the
        model's tokenizer in the router on an endpoint an engine agreed on, when the
        engines' model list gives the model's ``max_model_len``; else passed on to an
        engine's ``/tokenize`` (its answer, errors included, as it gave it).
        ``x-conductor-tokenized-by`` says which (``local`` or ``engine``)."""
        key = self.keys.authenticate(request.headers.get("Authorization"))
        client = await read_tokenize(request, self.limits, self._engine_authorization(request))
        tokenizer = self._target(key, client.model).served.tokenizer
        answer = await tokenizer.local_answer(client)
        if answer is not None:
            return web.json_response(answer, headers={TOKENIZED_BY: "local"})
        async for upstream, status, answered in tokenizer.engines_tokenize(
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

    async def models(self, request: web.Request) -> web.Response:
        """Every model and adapter the engines in rotation serve (that the key may use)."""
        key = self.keys.authenticate(request.headers.get("Authorization"))
        cards = [card for card in self.catalog.cards() if key.allows(card["id"])]
        return web.json_response({"object": "list", "data": cards})

    async def health(self, request: web.Request) -> web.Response:
        """``degraded`` with the reasons while no prefill instance is in rotation (a 503:
        nothing can be served) or no conductor can be asked (a 200: requests are routed by
        load meanwhile). Per model: its instances in rotation, its policy, and where its
        prompts' ids come from (with the setting to change when an engine must say)."""
        healthy = [u.instance_id for u in self.pool.prefill.values() if u.healthy]
        reasons = [] if healthy else ["no prefill instance is in rotation"]
        reasons += self.index.degraded_reasons()
        default = self.catalog.default
        body: dict[str, Any] = {
            "status": "degraded" if reasons else "ok",
            "reasons": reasons,
            "prefill_instances": healthy,
            "decode_instances": [u.instance_id for u in self.pool.healthy_decode()],
            "policy": default.params.policy,
            "models": {served.name: self._model_health(served) for served in self._served()},
            "event_loop_lag_worst_seconds": round(self.lag.worst, 4),
            "conductors": self.index.states(),
            "tasks": self.upkeep.health(),
        }
        if self.upkeep.store_states:
            body["kv_stores"] = self.upkeep.store_states
        if isinstance(self.index, EmbeddedConductor):  # as a conductor's /health has them
            body["streams"] = self.index.streams()
        return web.json_response(body, status=200 if healthy else 503)

    def _model_health(self, served: ServedModel) -> dict[str, Any]:
        instances = [
            u.instance_id
            for u in self.pool.prefill.values()
            if u.healthy and u.model == served.name
        ]
        return {
            "prefill_instances": instances,
            "adapters": served.section.adapters,
            "policy": served.params.policy,
            "default": served is self.catalog.default,
            "tokenizer": served.tokenizer.health(),
        }

    async def snapshot(self, request: web.Request) -> web.Response:
        """The embedded index as a snapshot (docs/wire.md), built now by the conductor's
        own code: what a conductor or another router with ``peers`` restores from. With
        ``conductor.auth_token`` it needs that bearer token; a router with keys needs one
        set (the index holds every client's prompts' block hashes)."""
        if not isinstance(self.index, EmbeddedConductor):
            raise ApiError(404, "no embedded index here: the conductors serve /snapshot")
        token = self.config.conductor.auth_token
        if not token and self.keys.enabled:
            raise ApiError(403, "set conductor.auth_token to serve the index's snapshot")
        try:
            BearerAuth(token, all_routes=True).check(request)
        except Unauthorized:
            raise ApiError(401, "needs conductor.auth_token as the bearer token") from None
        try:
            data = await self.index.snapshots.build()
        except (TimeoutError, RuntimeError) as error:
            reason = error or "batches did not pause"
            raise ApiError(503, f"snapshot not built: {reason}") from None
        return web.Response(body=data, content_type="application/octet-stream")

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry) + self.index.exposition()
        response = web.Response(body=body)
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response


def _decode_instances(sections: list[ModelSection]) -> list[tuple[str, str, str]]:
    """(instance_id, url, base model) of every decode instance, unnamed ones numbered."""
    decode = [(i, m.modelname) for m in sections for i in m.decode]
    return [
        (i.instance_id or f"decode-{n}", i.http_endpoint, model)
        for n, (i, model) in enumerate(decode)
    ]


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
        if (trace := request.get(TRACE)) is not None:
            if not response.prepared:  # an error: a streamed answer carries it already
                response.headers.update(trace.response_headers())
            trace.end(response.status)
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
            web.get("/snapshot", router.snapshot),
        ]
    )

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
