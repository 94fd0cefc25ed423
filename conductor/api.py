"""HTTP API (aiohttp): Go-compatible routes and shapes, JSON or msgpack bodies.

Errors are ``{"error": message, "field": path-or-null}`` with a precise status; every
request body is validated by a pydantic model from ``config``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgpack
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from .config import (
    QueryByHashRequest,
    QueryRequest,
    Registration,
    UnregisterRequest,
)
from .index import InstanceMatch
from .manager import (
    RegistrationConflict,
    RegistrationFailed,
    ServiceManager,
    ServiceNotFound,
)

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
GLOBAL_VIEW_MAX_HASHES = 10_000
Body = TypeVar("Body", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field


def _wants_msgpack(request: web.Request) -> bool:
    return request.content_type == MSGPACK or MSGPACK in request.headers.get("Accept", "")


def reply(request: web.Request, payload: Any, status: int = 200) -> web.Response:
    """JSON by default; msgpack when the client spoke or asked for msgpack."""
    if _wants_msgpack(request):
        return web.Response(body=msgpack.packb(payload), status=status, content_type=MSGPACK)
    return web.Response(
        text=json.dumps(payload, separators=(",", ":")),
        status=status,
        content_type="application/json",
    )


async def parse_body(request: web.Request, model: type[Body]) -> Body:
    body = await request.read()
    try:
        if request.content_type == MSGPACK:
            try:
                data = msgpack.unpackb(body, raw=False)
            except Exception:
                raise ApiError(400, "Invalid msgpack") from None
            return model.model_validate(data)
        return model.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, "Invalid JSON") from None
        if first["type"] == "model_type":
            raise ApiError(400, "request body must be an object") from None
        field = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{field}: {message}" if field else message, field) from None


def _go_match(match: InstanceMatch) -> dict[str, Any]:
    return {
        "longest_matched": match.disk,
        "DP": {str(rank): disk for rank, (_, _, disk) in sorted(match.ranks.items())},
        "GPU": match.gpu,
        "CPU": match.cpu,
        "DISK": match.disk,
    }


class ConductorApi:
    def __init__(self, manager: ServiceManager) -> None:
        self.manager = manager
        self.table = manager.table
        self.metrics = manager.metrics

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/query", self.query),
            web.post("/query_by_hash", self.query_by_hash),
            web.post("/register", self.register),
            web.post("/unregister", self.unregister),
            web.get("/global_view", self.global_view),
            web.get("/services", self.services),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
        ]

    # -- queries -------------------------------------------------------------------------
    def _answer(
        self, tenant: str, instance_id: str | None, matches: dict[str, InstanceMatch] | None
    ) -> dict[str, Any]:
        if instance_id is not None:
            match = (matches or {}).get(instance_id, InstanceMatch())
            return {tenant: {instance_id: _go_match(match)}}
        if matches is None and tenant not in self.table.tenants():
            return {}
        return {tenant: {name: _go_match(m) for name, m in sorted((matches or {}).items())}}

    async def query(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        body = await parse_body(request, QueryRequest)
        matches = self.table.match_tokens(
            body.context_key(), body.token_ids, body.cache_salt or "", body.instance_id
        )
        response = reply(request, self._answer(body.tenant_id, body.instance_id, matches))
        self.metrics.query_seconds.labels("/query").observe(time.perf_counter() - started)
        return response

    async def query_by_hash(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        body = await parse_body(request, QueryByHashRequest)
        hashes = [h & 0xFFFFFFFFFFFFFFFF for h in body.seq_hashes]
        matches = self.table.match_engine_hashes(body.context_key(), hashes, body.instance_id)
        response = reply(request, self._answer(body.tenant_id, body.instance_id, matches))
        self.metrics.query_seconds.labels("/query_by_hash").observe(time.perf_counter() - started)
        return response

    # -- registrations -------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        registration = await parse_body(request, Registration)
        try:
            await self.manager.register(registration)
        except RegistrationConflict as error:
            raise ApiError(409, str(error)) from None
        except RegistrationFailed as error:
            raise ApiError(400, str(error), "endpoint") from None
        name = registration.instance_id or registration.endpoint
        return reply(request, {"instance_id": name, "status": "registered successfully"})

    async def unregister(self, request: web.Request) -> web.Response:
        body = await parse_body(request, UnregisterRequest)
        try:
            await self.manager.unregister(body.key)
        except ServiceNotFound:
            raise ApiError(404, f"service not found: {body.key}", "instance_id") from None
        return reply(
            request,
            {"removed_instances": [body.key], "status": "unregistered successfully"},
        )

    # -- views ---------------------------------------------------------------------------
    async def services(self, request: web.Request) -> web.Response:
        services = [
            {
                **registration.go_view(),
                "State": self.manager.state_of(key),
                "KVStore": registration.kv_store,
            }
            for key, registration in sorted(self.manager.registrations.items())
        ]
        return reply(request, {"count": len(services), "services": services})

    async def global_view(self, request: web.Request) -> web.Response:
        """Counts per context; engine->prefix hashes only on request (``?hashes=N``)."""
        try:
            wanted = min(int(request.query.get("hashes", "0")), GLOBAL_VIEW_MAX_HASHES)
        except ValueError:
            raise ApiError(400, "hashes must be an integer", "hashes") from None
        model_contexts, contexts, hashmap = [], [], []
        for key, context in sorted(self.table.contexts.items(), key=lambda kv: repr(kv[0])):
            instances: dict[str, list[int]] = {}
            for slot in context.slots.values():
                if not slot.kv_store:  # a store's pool is shown under kv_stores
                    instances.setdefault(slot.instance_id, []).append(slot.dp_rank)
                for holdings in slot.holdings:
                    for engine_hash, prefix_hash in holdings.by_engine_hash.items():
                        if len(hashmap) >= wanted:
                            break
                        hashmap.append({str(engine_hash): prefix_hash})
            gpu, cpu, disk = context.block_counts()
            contexts.append(
                {
                    "tenant_id": key.tenant_id,
                    "model_name": key.model_name,
                    "lora_name": key.lora_name,
                    "block_size": key.block_size,
                    "blocks": {"GPU": gpu, "CPU": cpu, "DISK": disk},
                    "instances": {name: sorted(ranks) for name, ranks in instances.items()},
                    "kv_stores": {
                        kv_store: {"blocks": blocks, "instances": served}
                        for kv_store, (blocks, served) in sorted(context.store_pools().items())
                    },
                }
            )
            model_contexts.extend(
                {
                    "model_name": key.model_name,
                    "lora_name": key.lora_name,
                    "block_size": key.block_size,
                    "additional_salt": "",
                    "tenant_id": key.tenant_id,
                    "instance_id": name,
                }
                for name in sorted(instances)
            )
        return reply(
            request,
            {
                "context_count": len(contexts),
                "model_contexts": model_contexts,
                "hashmap": hashmap,
                "contexts": contexts,
            },
        )

    async def health(self, request: web.Request) -> web.Response:
        """Always 200 while serving; ``status`` is "degraded" when a stream's events cannot
        be indexed as registered (``streams`` says which one and why) or a store is down
        (``kv_stores``: each store's pool blocks, check state and age)."""
        states: dict[str, int] = {}
        streams: dict[str, dict[str, str]] = {}
        for key in sorted(self.manager.registrations):
            state = self.manager.state_of(key)
            states[state] = states.get(state, 0) + 1
            streams[key] = {"state": state}
            if self.manager.registrations[key].kv_store:
                streams[key]["kv_store"] = self.manager.registrations[key].kv_store
            if key in self.manager.degraded:
                streams[key]["degraded"] = self.manager.degraded[key]
        stores = self.manager.stores.view()
        blocks = self.table.store_blocks()
        for kv_store, store in stores.items():
            store["blocks"] = blocks.get(kv_store, 0)
        store_down = any(store["state"] == "down" for store in stores.values())
        return reply(
            request,
            {
                "status": "degraded" if self.manager.degraded or store_down else "ok",
                "services": len(self.manager.registrations),
                "subscribers": states,
                "streams": streams,
                "contexts": len(self.table.contexts),
                "blocks": self.table.block_count(),
                "kv_stores": dict(sorted(stores.items())),
            },
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self.metrics.registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response


def _error_middleware(api: ConductorApi) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        try:
            response = await handler(request)
        except ApiError as error:
            response = reply(request, {"error": error.message, "field": error.field}, error.status)
        except web.HTTPException as error:  # 404, 405, 413 from aiohttp itself
            if error.status < 400:
                raise
            message = {413: "request body too large"}.get(error.status, error.reason)
            response = reply(request, {"error": message, "field": None}, error.status)
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = reply(request, {"error": "internal error", "field": None}, 500)
        api.metrics.http_requests.labels(name, str(response.status)).inc()
        return response

    return middleware


def create_app(manager: ServiceManager, max_body_bytes: int = 16 * 1024 * 1024) -> web.Application:
    api = ConductorApi(manager)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_error_middleware(api)])
    app.add_routes(api.routes())
    return app
