"""HTTP API (aiohttp): the Go service's routes, in two dialects chosen by the request.

A JSON request gets the Go service's shapes, errors ``{"error": message, "field":
path-or-null}``; a msgpack request (or a GET accepting msgpack) gets upstream's C++
conductor's (``conductor.dialect``): its ``/query`` answer, errors ``{"error", "reason"[,
"field"][, "index"]}``, a registration conflict as 400, an unknown body field refused.
Every request body is validated by a pydantic model from ``config``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import chain, islice
from typing import Any, TypeVar, cast

import msgpack
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram
from pydantic import BaseModel, ValidationError

from ._native import HeadReader, ProfileChain, QueryPlan, plain_query_fields
from .body_shape import (
    BodyShape,
    Malformed,
    NotAnObject,
    is_msgpack_bin,
    json_shape,
    msgpack_fields,
    msgpack_shape,
)
from .config import (
    InstanceDownRequest,
    InstanceUpRequest,
    QueryBase,
    QueryByHashRequest,
    QueryRequest,
    Registration,
    UnregisterRequest,
)
from .dialect import (
    EVERY_TIER,
    GO_TIERS,
    INVALID_MSGPACK,
    INVALID_REGISTRATION,
    INVALID_TYPE,
    INVALID_VALUE,
    OUT_OF_RANGE,
    TIERS_HEADER,
    UNKNOWN_FIELD,
    accepted_fields,
    cpp_match,
    parse_tiers,
    reason_of,
    tier_values,
)
from .hash_profile import HashProfile
from .http_guard import CONNECTION_PROTOCOL, ConnectionGuard
from .index import ContextKey, ContextView, InstanceMatch
from .lane_http import DECLINED_HEADERS, LANE_ROUTES, ApiRequest, LaneRequest, answer_head
from .loads import (
    DEFAULT_WAIT_S,
    LEASE_HEADER,
    LOADS_HEADER,
    MAX_INSTANCES,
    MAX_LEASE_NUMBER,
    OTHERS_HEADER,
    REPLICA_HEADER,
    LoadReport,
    ReplicaLoads,
    TooManyReplicas,
    loads_header,
)
from .manager import (
    CapacityExceeded,
    RegistrationConflict,
    RegistrationFailed,
    ServiceManager,
    ServiceNotFound,
)
from .persistence import StateFile
from .plain_query import PLAIN_ROUTE, Dialect, PlainHead, chain_root
from .plain_query import plan as plain_plan
from .query_lane import LaneSettings, QueryLane
from .routed import RoutedPrompts, RoutedRequest, raise_hits
from .security import BearerAuth, EndpointAllowlist, EndpointRefused, Unauthorized
from .snapshot import Snapshots
from .states import StoreState, SubscriberState
from .wire.events import MASK64, EngineHash

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
GLOBAL_VIEW_MAX_HASHES = 10_000
SMALL_BODY_BYTES = 64 * 1024  # registrations and other small bodies
JSON_BYTES_PER_TOKEN = 12  # "-2147483648,"
JSON_BYTES_PER_HASH = 21  # "18446744073709551615,"
JSON_BYTES_PER_LOAD = 384  # an instance's entry in a /loads report, a 256-character name
NOT_AN_OBJECT = "request body must be an object"
CAPACITY_RETRY_AFTER_S = 5
CONFLICT_LOG_INTERVAL_S = 60.0
# ours, on /query: a client names instances (a JSON list) and the answer says, per instance,
# up to when (the engine's publish time) the index holds everything it published, or null
PROGRESS_HEADER = "X-Conductor-Progress"
INDEXED_UNTIL_HEADER = "X-Conductor-Indexed-Until"
MAX_PROGRESS_INSTANCES = 256
# ours, on /query and /query_by_hash: "1" lists only the instances with a hit (the Go shape
# lists every instance of the tenant: ~100 bytes each to write and parse at 1,000 instances)
HITS_ONLY_HEADER = "X-Conductor-Hits-Only"
# ours, on /query and /query_by_hash: no context matched the query's (tenant, model, LoRA,
# block size); the value says which was asked and lists the model's contexts (the Go body,
# {"tenant": {}} or {}, gives no hint that a block size or LoRA name is off)
NO_CONTEXT_HEADER = "X-Conductor-No-Context"
NO_CONTEXT_LISTED = 16  # contexts named in the header at most
NO_CONTEXT_TEXT_CHARS = 80  # of each name in it: a header line stays well under 8 KiB
_progress_decoder = msgspec.json.Decoder(list[str])
_msgpack_numbers = msgspec.msgpack.Decoder(list[int] | bytes)  # an item array, or ints packed
_msgpack_map = msgspec.msgpack.Decoder(dict[str, Any])  # a plain body read whole
Body = TypeVar("Body", bound=BaseModel)
Answer = TypeVar("Answer")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """A refused request. ``reason`` and ``index`` show in the C++ dialect only."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.headers = headers or {}
        self.reason = reason
        self.index = index


def _at_most(count: int, limit: int, field: str) -> None:
    if count > limit:
        message = f"{field}: at most {limit} per request, got {count}"
        raise ApiError(413, message, field, reason=OUT_OF_RANGE)


@dataclass(frozen=True)
class ItemLimit:
    """A query route's array field: the names it goes by, the items one request may hold,
    and the bytes of one item packed into a msgpack bin."""

    field: str
    names: tuple[str, ...]
    limit: int
    packed_bytes: int

    def check(self, shape: BodyShape, body_bytes: int) -> None:
        """Refuse, before decoding, a body that breaks a limit once decoded (413) or whose
        array is large and of something else than numbers (400: decoding it would build an
        object per value)."""
        if shape.items is not None:
            _at_most(shape.items, self.limit, self.field)
        if not shape.plain and shape.value_bytes > SMALL_BODY_BYTES:
            raise self.not_numbers()
        rest = body_bytes - shape.value_bytes
        if rest > SMALL_BODY_BYTES:
            raise ApiError(
                413,
                f"request body too large: its fields besides {self.field} take {rest} bytes "
                f"(limit {SMALL_BODY_BYTES})",
            )

    def not_numbers(self) -> ApiError:
        message = f"{self.field}: must be an array of integers"
        return ApiError(400, message, self.field, reason=INVALID_TYPE)

    def decode_field(self, key: str | bytes, value: msgspec.Raw) -> Any:
        """A msgpack map's value. The array field's is decoded as numbers, by a decoder
        that stops at the first element that is none; failing that, as it is (validation
        names the element) if it is small, and refused if not."""
        if key in self.names:
            try:
                return _msgpack_numbers.decode(value)
            except msgspec.ValidationError:
                if len(memoryview(value)) > SMALL_BODY_BYTES:
                    raise self.not_numbers() from None
        return msgpack.unpackb(value, raw=False)


@dataclass(frozen=True)
class HttpLimits:
    """What one request may cost: its body bytes and items are bounded so that parsing and
    answering it holds the event loop well under 50 ms (see docs/operations.md)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_query_tokens: int = 131_072
    max_query_hashes: int = 8_192
    body_timeout_s: float = 30.0

    def body_bytes(self, path: str) -> int:
        """Per route: a maximum-size query in JSON, anything else small."""
        items = {
            "/query": self.max_query_tokens * JSON_BYTES_PER_TOKEN,
            "/routed": self.max_query_tokens * JSON_BYTES_PER_TOKEN,
            "/query_by_hash": self.max_query_hashes * JSON_BYTES_PER_HASH,
            "/loads": MAX_INSTANCES * JSON_BYTES_PER_LOAD,
        }.get(path, 0)
        return min(self.max_body_bytes, items + SMALL_BODY_BYTES)

    @cached_property
    def item_limits(self) -> dict[str, ItemLimit]:
        """Per route, its array field, counted before the body is decoded."""
        return {
            "/query": ItemLimit("token_ids", ("token_ids",), self.max_query_tokens, 4),
            "/routed": ItemLimit("token_ids", ("token_ids",), self.max_query_tokens, 4),
            "/query_by_hash": ItemLimit(
                "seq_hashes", ("seq_hashes", "block_hash"), self.max_query_hashes, 8
            ),
        }


class RateLimitedLog:
    """One WARNING per key and interval: a client retrying a refused request every second
    must not flood the log, and the first refusal must be visible."""

    def __init__(self, interval: float = CONFLICT_LOG_INTERVAL_S, max_keys: int = 4096) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self._last: dict[str, float] = {}

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.interval) < self.interval:
            return
        if len(self._last) >= self.max_keys:  # bounded: forget the expired ones
            self._last = {k: t for k, t in self._last.items() if now - t < self.interval}
        self._last[key] = now
        log.warning(message, *args)


_json_encode = msgspec.json.Encoder().encode  # compact, and several times json.dumps's speed
# faster than msgpack.packb on answers (the msgpack queries bench.load_bench times)
_msgpack_encode = msgspec.msgpack.Encoder().encode


def _wants_msgpack(request: ApiRequest) -> bool:
    return request.content_type == MSGPACK or MSGPACK in request.headers.get("Accept", "")


def speaks_cpp(request: ApiRequest) -> bool:
    """Upstream C++'s dialect: a msgpack body, or a GET that accepts msgpack (a JSON body
    that accepts msgpack gets the Go shapes, in msgpack, as before the dialects)."""
    if request.method == "GET":
        return MSGPACK in request.headers.get("Accept", "")
    return request.content_type == MSGPACK


def reply(request: ApiRequest, payload: Any, status: int = 200) -> web.Response:
    """JSON by default; msgpack when the client spoke or asked for msgpack."""
    if _wants_msgpack(request):
        return web.Response(body=_msgpack_encode(payload), status=status, content_type=MSGPACK)
    return web.Response(body=_json_encode(payload), status=status, content_type="application/json")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body too large (limit {limit} bytes)")


async def read_body(request: web.Request | LaneRequest, limit: int, timeout: float) -> bytes:
    """The body, at most ``limit`` bytes (413) and within ``timeout`` seconds (408)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body too large (limit {limit} bytes on {request.path})")
    if isinstance(request, LaneRequest):  # read whole by the lane, or timed out
        if request.body is None:
            raise _body_timed_out(timeout)
        return request.body
    if request.content.is_eof():  # it came whole with the headers: no wait, no timer
        whole = request.content.read_nowait()
        if len(whole) > limit:
            raise _too_large(limit)
        return whole
    body = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.content.iter_any():
                body += chunk
                if len(body) > limit:
                    raise _too_large(limit)
    except TimeoutError:
        raise _body_timed_out(timeout) from None
    return bytes(body)


def _body_timed_out(timeout: float) -> ApiError:
    return ApiError(408, f"request body not received within {timeout:g} s")


async def parse_body(
    request: web.Request | LaneRequest,
    model: type[Body],
    limits: HttpLimits,
    plain_json: Callable[[bytes], Body | None] | None = None,
    plain_msgpack: bool = False,
) -> Body:
    """The request's body as ``model`` (msgpack or JSON; ``plain_json`` parses the JSON
    bodies it can, ``plain_msgpack`` says whether ``_plain_msgpack`` tries the msgpack ones,
    the others are parsed the general way), or a precise 400 naming the first field in
    error. A query route's items are counted before decoding."""
    body = await read_body(request, limits.body_bytes(request.path), limits.body_timeout_s)
    items = limits.item_limits.get(request.path)
    try:
        if request.content_type == MSGPACK:
            parsed = _plain_msgpack(body, model, items) if plain_msgpack and items else None
            if parsed is not None:
                return parsed
            fields = _decode_msgpack(body, items)
            _refuse_unknown_fields(fields, model)
            return model.model_validate(fields)
        parsed = plain_json(body) if plain_json is not None else None
        if parsed is not None:
            return parsed
        if items is not None:
            _check_json_shape(body, items)
        return model.model_validate_json(body)
    except ValidationError as error:
        raise _invalid(error) from None


def _invalid(error: ValidationError) -> ApiError:
    """A validation error as a 400 naming its first problem's field (and, for a bad token
    id, its index) with upstream's reason for it."""
    first = error.errors()[0]
    kind = first["type"]
    if kind == "json_invalid":
        return ApiError(400, "Invalid JSON")
    if kind == "model_type" and not first["loc"]:
        return ApiError(400, NOT_AN_OBJECT, reason=INVALID_MSGPACK)
    field = ".".join(str(part) for part in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        message = "unsupported request field"
    index = first.get("ctx", {}).get("index")
    return ApiError(
        400,
        f"{field}: {message}" if field else message,
        field,
        reason=reason_of(kind),
        index=index if isinstance(index, int) else None,
    )


def _refuse_unknown_fields(fields: Any, model: type[BaseModel]) -> None:
    """Upstream C++ refuses a key its route does not know: the first one, in body order
    (a JSON body's are ignored, as the Go service does)."""
    if not isinstance(fields, dict):
        return  # not a map: validation says so
    accepted = accepted_fields(model)
    for key in fields:
        if key not in accepted:
            name = str(key)
            message = f"{name}: unsupported request field"
            raise ApiError(400, message, name, reason=UNKNOWN_FIELD)


def _plain_msgpack(body: bytes, model: type[Body], items: ItemLimit) -> Body | None:
    """``/query``'s usual msgpack body, read and validated in one go: a map of the route's
    fields whose array is a bin (token ids packed: what the router and upstream's C++
    proxy send) and whose other fields are small. None for anything else (an item array,
    an unknown key, an invalid value), which the general way then counts, reads field by
    field and reports precisely; 3.3 µs against that way's 7.3 in-process. The map is
    looked at still encoded first: an item array is never decoded twice."""
    try:
        encoded = msgpack_fields(body)
    except (NotAnObject, Malformed):
        return None
    arrays = [memoryview(encoded[name]) for name in items.names if name in encoded]
    if len(arrays) != 1 or not is_msgpack_bin(arrays[0]):
        return None
    rest_bytes = len(body) - len(arrays[0])
    if rest_bytes > SMALL_BODY_BYTES or not encoded.keys() <= accepted_fields(model):
        return None
    try:
        return model.model_validate(_msgpack_map.decode(body))
    except (msgspec.MsgspecError, ValueError):  # bad UTF-8, or invalid (a ValidationError)
        return None


def _decode_msgpack(body: bytes, items: ItemLimit | None) -> Any:
    """The body decoded; a query route's map is read field by field, its array field
    counted before anything is decoded."""
    try:
        if items is None:
            return msgpack.unpackb(body, raw=False)
        fields = msgpack_fields(body)
        if not all(isinstance(key, str | bytes) for key in fields):
            raise Malformed  # as msgpack's strict_map_key says
    except NotAnObject:
        raise ApiError(400, NOT_AN_OBJECT, reason=INVALID_MSGPACK) from None
    except Exception:
        raise _undecodable() from None
    items.check(msgpack_shape(fields, items.names, items.packed_bytes), len(body))
    try:
        return {key: items.decode_field(key, raw) for key, raw in fields.items()}
    except ApiError:
        raise
    except Exception:  # a value msgspec skipped over but cannot be decoded (bad UTF-8)
        raise _undecodable() from None


def _undecodable() -> ApiError:
    return ApiError(400, "Invalid msgpack", reason=INVALID_MSGPACK)


def _check_json_shape(body: bytes, items: ItemLimit) -> None:
    """A JSON body the plain reader declined (an escaped key, a nested value, an odd
    token): its items counted before pydantic decodes it all."""
    try:
        shape = json_shape(body, items.names)
    except NotAnObject:
        raise ApiError(400, NOT_AN_OBJECT) from None
    if shape is not None:  # None: no valid JSON, which pydantic reports before decoding
        items.check(shape, len(body))


def _header_text(text: str) -> str:
    """A name in a header: quoted, ASCII (JSON escapes), cut to NO_CONTEXT_TEXT_CHARS."""
    cut = text[:NO_CONTEXT_TEXT_CHARS]
    return json.dumps(cut) + ("..." if len(text) > len(cut) else "")


def _context_text(key: ContextKey) -> str:
    return (
        f"block_size={key.block_size} lora_name={_header_text(key.lora_name)} "
        f"tenant_id={_header_text(key.tenant_id)}"
    )


class GoMatch(msgspec.Struct, omit_defaults=True):
    """One instance's answer in the Go service's shape, under the tiers asked for (a struct:
    several times faster to make than the dict it encodes as, and a 1,000-instance answer
    makes hundreds; bench.load_bench's trace scenario times such answers)."""

    longest_matched: int
    DP: dict[str, int]  # noqa: N815 - the Go service's keys
    GPU: int | None = None  # noqa: N815
    CPU: int | None = None  # noqa: N815
    NPU: int | None = None  # noqa: N815
    CPU_LOCAL: int | None = None  # noqa: N815
    CPU_SHARE: int | None = None  # noqa: N815
    DISK: int | None = None  # noqa: N815


def _go_match(match: InstanceMatch, tiers: frozenset[str] = GO_TIERS) -> GoMatch:
    """Go's ``DP`` is each rank's cumulative disk hit."""
    ranks = match.ranks
    if len(ranks) == 1:  # one DP rank: most engines
        ((rank, hits),) = ranks.items()
        dp = {str(rank): hits[3]}
    else:
        dp = {str(rank): hits[3] for rank, hits in sorted(ranks.items())}
    best = (match.gpu, match.cpu_local, match.cpu, match.disk)
    return GoMatch(match.disk, dp, *tier_values(best, tiers))


def _each_answer(
    matches: dict[str, InstanceMatch], write: Callable[[InstanceMatch], Answer]
) -> dict[str, Answer]:
    """Each instance's answer, by name, in the order of ``matches`` (the index's is
    instance-id order, as Go writes a map's keys and C++ a std::map's); written once per
    distinct match object (the index shares equal answers: in a large fleet most instances
    have one of a few)."""
    written: dict[int, Answer] = {}
    answers = {}
    for name, match in matches.items():
        answer = written.get(id(match))
        if answer is None:
            answer = written[id(match)] = write(match)
        answers[name] = answer
    return answers


def _content_headers(content_type: str) -> tuple[tuple[str, str], ...]:
    """The headers the handler's answers in this content type carry (its ``reply``'s)."""
    return tuple(web.Response(body=b"", content_type=content_type).headers.items())


# the plain query's answers (conductor.plain_query), as the handler writes them
_GO_PLAIN = Dialect(
    False, _json_encode, _go_match, lambda tenant, answers: {tenant: answers},
    _content_headers("application/json"),
)  # fmt: skip
_CPP_PLAIN = Dialect(
    True, _msgpack_encode, cpp_match, lambda _, answers: {"instances": answers},
    _content_headers(MSGPACK),
)  # fmt: skip


# the heads the plain path reads: the values of PlainHead's headers, in its order
API: web.AppKey[ConductorApi] = web.AppKey("api")  # the app's routes, as api_app made them
PLAIN_HEADS = HeadReader(
    PLAIN_ROUTE.encode(),
    ("Accept", "Authorization", HITS_ONLY_HEADER, REPLICA_HEADER, LEASE_HEADER, PROGRESS_HEADER),
    (TIERS_HEADER, *DECLINED_HEADERS),
)


def _tiers(request: ApiRequest, default: frozenset[str]) -> frozenset[str]:
    """The tiers the answer names: the request's ``TIERS_HEADER``, else the dialect's."""
    value = request.headers.get(TIERS_HEADER)
    if value is None:
        return default
    try:
        return parse_tiers(value)
    except ValueError as error:
        raise ApiError(400, str(error), TIERS_HEADER, reason=INVALID_VALUE) from None


def _lease_number(value: str | None) -> int | None:
    """A query's decision lease number (``conductor.loads``, the header's ``value``); None
    without one, a 400 for one that is not a number in range."""
    if value is None:
        return None
    if not value.isascii() or not value.isdigit() or int(value) > MAX_LEASE_NUMBER:
        raise ApiError(
            400, f"{LEASE_HEADER}: expected a whole number up to {MAX_LEASE_NUMBER}",
            field=LEASE_HEADER, reason=INVALID_VALUE,
        )  # fmt: skip
    return int(value)


def _hits(
    request: ApiRequest, matches: dict[str, InstanceMatch] | None
) -> dict[str, InstanceMatch]:
    """``matches`` (none: no context), only those with a hit if the request asks so."""
    if matches and request.headers.get(HITS_ONLY_HEADER) == "1":
        return {name: match for name, match in matches.items() if match.disk}
    return matches or {}


@dataclass
class ApiOptions:
    """Everything the HTTP layer enforces besides the routes' own validation."""

    limits: HttpLimits
    auth: BearerAuth
    allowlist: EndpointAllowlist
    state: StateFile | None = None  # None: registrations are not persisted
    guard: ConnectionGuard | None = None
    snapshots: Snapshots | None = None  # None: no GET /snapshot
    replica_wait_s: float = DEFAULT_WAIT_S  # see conductor.loads
    keepalive_timeout_s: float = 75.0  # an idle connection's, aiohttp's default
    query_lane: bool = True  # False: aiohttp serves every request (conductor.query_lane)


class ConductorApi:
    def __init__(self, manager: ServiceManager, options: ApiOptions) -> None:
        self.manager = manager
        self.table = manager.table
        self.metrics = manager.metrics
        self.options = options
        self.refusals = RateLimitedLog()
        self.routed = RoutedPrompts()  # what routers sent where, not indexed yet
        self.metrics.routed_prompts.routed = self.routed
        self.loads = ReplicaLoads(max_wait_s=options.replica_wait_s)  # replicas' loads
        self.metrics.routed_prompts.loads = self.loads
        self._lane_settings: LaneSettings | None = None  # made at the first connection
        self._answered: dict[tuple[str, int], Counter] = {}  # http_requests, by label
        self._query_seconds: dict[str, Histogram] = {
            route: self.metrics.query_seconds.labels(route) for route in LANE_ROUTES
        }

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/query", self.query),
            web.post("/query_by_hash", self.query_by_hash),
            web.post("/routed", self.routed_report),
            web.post("/loads", self.loads_report),
            web.post("/register", self.register),
            web.post("/unregister", self.unregister),
            web.post("/instance_down", self.instance_down),
            web.post("/instance_up", self.instance_up),
            web.get("/global_view", self.global_view),
            web.get("/services", self.services),
            web.get("/health", self.health),
            web.get("/metrics", self.prometheus),
            web.get("/snapshot", self.snapshot),
        ]

    # -- queries -------------------------------------------------------------------------
    def _answer(
        self, request: ApiRequest, query: QueryBase, matches: dict[str, InstanceMatch] | None
    ) -> web.Response:
        """``matches`` in the request's dialect (only the instances with a hit when asked
        so); when no context matched, a header saying so. Upstream C++ answers an instance
        filter naming no instance of the context, and no context, with no instance."""
        cpp = speaks_cpp(request)
        tiers = _tiers(request, EVERY_TIER if cpp else GO_TIERS)
        if cpp:
            answers = _each_answer(_hits(request, matches), partial(cpp_match, tiers=tiers))
            response = reply(request, {"instances": answers})
        else:
            write = partial(_go_match, tiers=tiers)
            response = self._go_answer(request, query, matches, write)
        if matches is None:
            response.headers[NO_CONTEXT_HEADER] = self._no_context(query.context_key())
        return response

    def _go_answer(
        self,
        request: ApiRequest,
        query: QueryBase,
        matches: dict[str, InstanceMatch] | None,
        write: Callable[[InstanceMatch], GoMatch],
    ) -> web.Response:
        tenant, instance_id = query.tenant_id, query.instance_id
        if instance_id is not None:
            match = (matches or {}).get(instance_id, InstanceMatch())
            return reply(request, {tenant: {instance_id: write(match)}})
        if matches is None and tenant not in self.table.tenants():
            return reply(request, {})
        return reply(request, {tenant: _each_answer(_hits(request, matches), write)})

    def _no_context(self, asked: ContextKey) -> str:
        """What was asked and the contexts its model has, as one ASCII header line:
        ``no context matched model="m" block_size=16 lora_name="" tenant_id="default";
        contexts of the model: block_size=32 lora_name="" tenant_id="default"``."""
        what = f"no context matched model={_header_text(asked.model_name)} {_context_text(asked)}"
        known = self.table.model_contexts(asked.model_name)
        if not known:
            return f"{what}; the model has none"
        listed = ", ".join(_context_text(key) for key in known[:NO_CONTEXT_LISTED])
        unlisted = len(known) - NO_CONTEXT_LISTED
        return f"{what}; contexts of the model: {listed}" + (
            f" (+{unlisted} more)" if unlisted > 0 else ""
        )

    async def query(self, request: web.Request | LaneRequest) -> web.Response:
        started = time.perf_counter()
        limits = self.options.limits
        body = await parse_body(
            request, QueryRequest, limits, QueryRequest.from_plain_json, plain_msgpack=True
        )
        _at_most(len(body.token_ids) // 4, limits.max_query_tokens, "token_ids")
        replica = request.headers.get(REPLICA_HEADER)
        if replica is not None:  # after the other replicas' decisions on the model
            lease = _lease_number(request.headers.get(LEASE_HEADER))
            await self.loads.decide(replica, body.model, lease)
        matches = self.table.match_tokens(
            body.context_key(), body.token_ids, body.cache_salt or "", body.instance_id
        )
        if matches is not None:
            matches = self._with_routed(body, matches)
        response = self._answer(request, body, matches)
        progress = self._progress(request.headers.get(PROGRESS_HEADER), body.tenant_id)
        response.headers.extend(self._query_headers(progress, replica, matches or ()))
        self._query_seconds["/query"].observe(time.perf_counter() - started)
        return response

    def answer_plain(self, head: PlainHead, body: bytes, transport: Any) -> bytes | None:
        """A plain ``/query``'s whole answer, from C (``conductor.plain_query``), with the
        handler's headers and counts; None for any other request, which the handler answers
        (nothing is changed or counted before the answer is sure)."""
        started = time.perf_counter()
        cpp = head.media_type == MSGPACK
        if not cpp and MSGPACK in (head.accept or ""):
            return None
        if not self.options.auth.accepts(PLAIN_ROUTE, head.authorization):
            return None  # the handler refuses it, and logs so
        query = self._plain_fields(cpp, body)
        if query is None:
            return None
        key, model, tokens, salt = query
        try:
            lease = _lease_number(head.lease) if head.replica is not None else None
            progress = self._progress(head.progress, key.tenant_id)
        except ApiError:
            return None
        if len(tokens) // 4 > self.options.limits.max_query_tokens:
            return None
        fleet = self.table.plain_fleet(key)
        dialect = _CPP_PLAIN if cpp else _GO_PLAIN
        plan = plain_plan(fleet, dialect) if fleet is not None else None
        if fleet is None or plan is None:
            return None
        minimum = None
        if self.routed.holds_any():
            routed = self.routed.match(key, tokens, salt)
            minimum = [routed.get(name, 0) for name in fleet.names] if routed else None
        root = chain_root(fleet, tokens, salt)
        if root is None:
            return None
        answer, raised = plan.answer(tokens, root, head.hits_only == "1", minimum)
        replica = head.replica
        if replica is not None and not self.loads.try_decide(replica, model, lease):
            return None  # the handler waits for the other replica's decision
        extra = self._query_headers(progress, replica, fleet.name_set)
        if raised:
            self.metrics.routed_raised.inc(raised)
        self._count("/query", 200)
        self.metrics.plain_queries.inc()
        self._query_seconds["/query"].observe(time.perf_counter() - started)
        if self.options.guard is not None:
            self.options.guard.request_done(transport)
        response_headers = chain(dialect.headers, extra) if extra else dialect.headers
        return answer_head(200, response_headers, len(answer), head.keep_alive) + answer

    def thread_plans(
        self, key: ContextKey
    ) -> tuple[QueryPlan | None, QueryPlan | None, ProfileChain | None]:
        """A context's plans for the query thread (conductor.query_thread), JSON's and
        msgpack's, and in a profiled context how its blocks are keyed (a chain of no tokens,
        unsalted); no plans where it leaves the context's queries to the loop (a context not
        known, or a profile whose blocks C does not hash)."""
        fleet = self.table.plain_fleet(key)
        if fleet is None:
            return None, None, None
        chain = None
        if fleet.profile is not None:
            chain = cast(ProfileChain | None, chain_root(fleet, b"", ""))
            if chain is None:
                return None, None, None
        return plain_plan(fleet, _GO_PLAIN), plain_plan(fleet, _CPP_PLAIN), chain

    @staticmethod
    def thread_heads() -> tuple[bytes, bytes]:
        """A plain answer's head up to its length, as ``answer_plain`` writes it: JSON's
        and msgpack's."""
        end = b"0\r\n\r\n"
        heads = [answer_head(200, d.headers, 0, True) for d in (_GO_PLAIN, _CPP_PLAIN)]
        assert all(head.endswith(b"Content-Length: " + end) for head in heads)
        return heads[0][: -len(end)], heads[1][: -len(end)]

    def _query_headers(
        self, progress: str | None, replica: str | None, instances: Container[str]
    ) -> list[tuple[str, str]]:
        """A query answer's headers beside its content type, in order: the indexing progress
        asked for, the other replicas' loads of the answer's ``instances``."""
        headers = []
        if progress is not None:
            headers.append((INDEXED_UNTIL_HEADER, progress))
        if replica is not None:
            others = self.loads.others(replica, instances)
            headers.append((LOADS_HEADER, loads_header(others)))
            headers.append((OTHERS_HEADER, str(self.loads.count_others(replica))))
        return headers

    def _plain_fields(self, cpp: bool, body: bytes) -> tuple[ContextKey, str, bytes, str] | None:
        """A plain body's context, model, token ids and salt: read by C, else by the fast
        readers (None: the handler reads it)."""
        fields = plain_query_fields(body, cpp)
        if fields is not None:
            tenant, model, lora, block_size, salt, tokens = fields
            return ContextKey(tenant, model, lora, block_size), model, tokens, salt or ""
        if cpp:
            items = self.options.limits.item_limits.get("/query")
            query = _plain_msgpack(body, QueryRequest, items) if items else None
        else:
            try:
                query = QueryRequest.from_plain_json(body)
            except ValidationError:
                return None
        if query is None or query.instance_id is not None:
            return None
        return query.context_key(), query.model, query.token_ids, query.cache_salt or ""

    def read_plain_head(self, head: bytes) -> PlainHead | None:
        """A request head the plain path may answer (``PLAIN_HEADS``), or None."""
        read = PLAIN_HEADS.read(head)
        return None if read is None else PlainHead(*read)

    def _with_routed(
        self, body: QueryRequest, matches: dict[str, InstanceMatch]
    ) -> dict[str, InstanceMatch]:
        """``matches`` with the prompts routers sent and the index has not seen yet."""
        key = body.context_key()
        routed = self.routed.match(key, body.token_ids, body.cache_salt or "")
        if not routed:
            return matches
        raised, count = raise_hits(matches, routed, key.block_size)
        self.metrics.routed_raised.inc(count)
        return raised

    async def routed_report(self, request: web.Request) -> web.Response:
        """A router sent this prompt to this instance: ``/query`` counts it there (see
        ``conductor.routed``) until ``ttl_s`` ends."""
        limits = self.options.limits
        body = await parse_body(request, RoutedRequest, limits, RoutedRequest.from_plain_json)
        _at_most(len(body.token_ids) // 4, limits.max_query_tokens, "token_ids")
        recorded = self.routed.add(body)
        self.metrics.routed_reports.labels("recorded" if recorded else "no_block").inc()
        return reply(request, {"status": "recorded" if recorded else "no complete block"})

    async def loads_report(self, request: web.Request) -> web.Response:
        """A router replica's load per instance: the other replicas' queries see it (see
        ``conductor.loads``) until ``ttl_s`` ends or its next report."""
        body = await parse_body(request, LoadReport, self.options.limits)
        try:
            self.loads.report(body)
        except TooManyReplicas as error:
            raise ApiError(429, str(error), "replica", headers={"Retry-After": "1"}) from None
        return reply(request, {"status": "recorded", "replicas": len(self.loads)})

    def _progress(self, asked: str | None, tenant: str) -> str | None:
        """The indexing progress of the instances the progress header (``asked``) names, as
        JSON (what lets a router count a finished request as in flight until its blocks are
        in); None without the header."""
        if asked is None:
            return None
        try:
            instances = _progress_decoder.decode(asked)
        except msgspec.DecodeError:
            instances = None
        if instances is None or len(instances) > MAX_PROGRESS_INSTANCES:
            raise ApiError(
                400,
                f"{PROGRESS_HEADER}: expected a JSON list of at most "
                f"{MAX_PROGRESS_INSTANCES} instance ids",
                field=PROGRESS_HEADER,
                reason=INVALID_VALUE,
            )
        progress = {i: self.manager.indexed_until(i, tenant) for i in instances}
        return json.dumps(progress, separators=(",", ":"))  # ASCII: a header's value

    async def query_by_hash(self, request: web.Request | LaneRequest) -> web.Response:
        started = time.perf_counter()
        body = await parse_body(request, QueryByHashRequest, self.options.limits)
        _at_most(len(body.seq_hashes), self.options.limits.max_query_hashes, "seq_hashes")
        hashes = cast(list[EngineHash], [h & MASK64 for h in body.seq_hashes])
        matches = self.table.match_engine_hashes(body.context_key(), hashes, body.instance_id)
        response = self._answer(request, body, matches)
        self._query_seconds["/query_by_hash"].observe(time.perf_counter() - started)
        return response

    # -- registrations -------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        """Go answers a conflict 409, upstream C++ 400 ``invalid_registration``."""
        registration = await parse_body(request, Registration, self.options.limits)
        try:
            self.options.allowlist.check(registration)
        except EndpointRefused as error:
            self.refusals.warning(error.field + str(error), "register refused: %s", error)
            raise ApiError(403, str(error), error.field) from None
        try:
            added = await self.manager.register(registration)
        except RegistrationConflict as error:
            self.refusals.warning(registration.key, "register conflict: %s", error)
            status = 400 if speaks_cpp(request) else 409
            raise ApiError(status, str(error), reason=INVALID_REGISTRATION) from None
        except RegistrationFailed as error:
            raise ApiError(400, str(error), "endpoint", reason=INVALID_VALUE) from None
        except CapacityExceeded as error:
            retry = {"Retry-After": str(CAPACITY_RETRY_AFTER_S)}
            raise ApiError(503, str(error), headers=retry) from None
        if added and self.options.state is not None:
            await self.options.state.add(registration)
        name = registration.instance_id or registration.endpoint
        return reply(request, {"instance_id": name, "status": "registered successfully"})

    async def unregister(self, request: web.Request) -> web.Response:
        body = await parse_body(request, UnregisterRequest, self.options.limits)
        try:
            await self.manager.unregister(body.key)
        except ServiceNotFound:
            raise ApiError(404, f"service not found: {body.key}", "instance_id") from None
        if self.options.state is not None:
            await self.options.state.remove(body.key)
        return reply(
            request,
            {"removed_instances": [body.key], "status": "unregistered successfully"},
        )

    async def instance_down(self, request: web.Request) -> web.Response:
        """The router saw an instance die: its streams stop counting until it is up again
        or ``ttl_s`` passes without a repeat."""
        body = await parse_body(request, InstanceDownRequest, self.options.limits)
        try:
            streams, dropped = await self.manager.instance_down(
                body.instance_id, body.tenant_id, body.reason, body.ttl_s
            )
        except ServiceNotFound:
            raise ApiError(404, f"instance not found: {body.instance_id}", "instance_id") from None
        self.routed.forget(body.instance_id)
        answer = {"instance_id": body.instance_id, "streams": streams, "blocks_dropped": dropped}
        return reply(request, {**answer, "status": "marked down"})

    async def instance_up(self, request: web.Request) -> web.Response:
        body = await parse_body(request, InstanceUpRequest, self.options.limits)
        try:
            streams = await self.manager.instance_up(body.instance_id, body.tenant_id)
        except ServiceNotFound:
            raise ApiError(404, f"instance not found: {body.instance_id}", "instance_id") from None
        return reply(
            request, {"instance_id": body.instance_id, "streams": streams, "status": "marked up"}
        )

    # -- views ---------------------------------------------------------------------------
    async def services(self, request: web.Request) -> web.Response:
        services = [
            {
                **registration.go_view(),
                "State": self.manager.state_of(key),
                "KVStore": registration.kv_store,
                "Stream": self.manager.stream_view(key),  # ours: failures, down marks
            }
            for key, registration in sorted(self.manager.registrations.items())
        ]
        return reply(request, {"count": len(services), "services": services})

    async def global_view(self, request: web.Request) -> web.Response:
        """Counts per context; engine->prefix hashes only on request (``?hashes=N``). One
        shape for both dialects: upstream C++'s keys (``context_count``, each context's
        ``prefix_count``, ``hash_profile`` and ``instances``) and Go's, side by side."""
        try:
            wanted = min(int(request.query.get("hashes", "0")), GLOBAL_VIEW_MAX_HASHES)
        except ValueError:
            message = "hashes must be an integer"
            raise ApiError(400, message, "hashes", reason=INVALID_TYPE) from None
        views = sorted(self.table.context_views(), key=lambda view: repr(view.key))
        held = chain.from_iterable(self.table.held_hashes(view.key) for view in views)
        hashmap = [
            {str(engine_hash): prefix_hash} for engine_hash, prefix_hash in islice(held, wanted)
        ]
        profiles = self.manager.context_profiles()
        contexts = [self._context_entry(view, profiles.get(view.key)) for view in views]
        model_contexts: list[dict[str, Any]] = []
        for view in views:
            key = view.key
            model_contexts.extend(
                {
                    "model_name": key.model_name,
                    "lora_name": key.lora_name,
                    "block_size": key.block_size,
                    "additional_salt": "",
                    "tenant_id": key.tenant_id,
                    "instance_id": name,
                }
                for name in sorted(view.instances)
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

    def _context_entry(self, view: ContextView, profile: HashProfile | None) -> dict[str, Any]:
        """One context of ``/global_view``; ``prefix_count`` counts its distinct blocks on
        any tier (linear in its CPU and disk blocks, constant for a GPU-only context)."""
        key = view.key
        gpu, cpu, disk = view.blocks
        return {
            "tenant_id": key.tenant_id,
            "model_name": key.model_name,
            "lora_name": key.lora_name,
            "block_size": key.block_size,
            "prefix_count": self.table.prefix_count(key),
            "hash_profile": profile.wire_view() if profile else None,
            "blocks": {"GPU": gpu, "CPU": cpu, "DISK": disk},
            "instances": {name: list(ranks) for name, ranks in view.instances.items()},
            "kv_stores": {
                pool.kv_store: {"blocks": pool.blocks, "instances": list(pool.instances)}
                for pool in view.store_pools
            },
        }

    async def health(self, request: web.Request) -> web.Response:
        """Always 200 while serving; ``status`` is "degraded" when a stream's events cannot
        be indexed as registered or one of its tasks failed (``streams`` says which one and
        why) or a store is down (``kv_stores``: each store's pool blocks, check state and
        age)."""
        states: dict[SubscriberState, int] = {}
        streams: dict[str, dict[str, str]] = {}
        for key in sorted(self.manager.registrations):
            state = self.manager.state_of(key)
            states[state] = states.get(state, 0) + 1
            view = self.manager.stream_view(key)
            # only what is not the usual: failures, a down mark
            streams[key] = {name: value for name, value in view.items() if value}
            streams[key]["state"] = state
            if self.manager.registrations[key].kv_store:
                streams[key]["kv_store"] = self.manager.registrations[key].kv_store
            if key in self.manager.degraded:
                streams[key]["degraded"] = self.manager.degraded[key]
            if key in self.manager.resume_gaps:
                streams[key]["resume_gap"] = self.manager.resume_gaps[key]
        stores = self.manager.stores.view()
        blocks = self.table.store_blocks()
        for kv_store, store in stores.items():
            store["blocks"] = blocks.get(kv_store, 0)
        store_down = any(store["state"] is StoreState.DOWN for store in stores.values())
        return reply(
            request,
            {
                "status": "degraded"
                if self.manager.degraded or store_down or SubscriberState.FAILED in states
                else "ok",
                "services": len(self.manager.registrations),
                "subscribers": states,
                "streams": streams,
                "contexts": self.table.context_count(),
                "blocks": self.table.block_count(),
                "kv_stores": dict(sorted(stores.items())),
            },
        )

    async def snapshot(self, _: web.Request) -> web.Response:
        """The index as a snapshot (docs/wire.md), built now: what a peer restores from."""
        if self.options.snapshots is None:
            raise ApiError(404, "snapshots are off")
        try:
            data = await self.options.snapshots.build()
        except (TimeoutError, RuntimeError) as error:
            raise ApiError(503, f"snapshot not built: {error or 'batches did not pause'}") from None
        return web.Response(body=data, content_type="application/octet-stream")

    # -- every request's checks, errors and counts ---------------------------------------
    async def answered(
        self, request: ApiRequest, handle: Callable[[], Awaitable[web.StreamResponse]], route: str
    ) -> web.StreamResponse:
        """``handle``'s response, or the refusal in the request's dialect; counted, and the
        connection guard told the request is answered (aiohttp's and the lane's alike)."""
        try:
            self.options.auth.check(request)
            response = await handle()
        except Unauthorized:
            self.refusals.warning(
                f"401 {request.remote}", "unauthorized %s from %s", request.path, request.remote
            )
            response = _refusal(request, ApiError(401, "missing or invalid bearer token"))
            response.headers["WWW-Authenticate"] = "Bearer"
        except ApiError as error:
            response = _refusal(request, error)
            response.headers.update(error.headers)
            if error.status in (408, 413):  # the rest of the body is not worth reading
                response.force_close()
        except web.HTTPException as error:  # 404, 405, 413 from aiohttp itself
            if error.status < 400:
                raise
            message = {413: "request body too large"}.get(error.status, error.reason)
            response = _refusal(request, ApiError(error.status, message))
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = _refusal(request, ApiError(500, "internal error"))
        self._count(route, response.status)
        if self.options.guard is not None:
            self.options.guard.request_done(request.transport)
        return response

    def _count(self, route: str, status: int) -> None:
        counter = self._answered.get((route, status))
        if counter is None:  # labels() costs a few µs a request; routes x statuses are few
            counter = self._answered[(route, status)] = self.metrics.http_requests.labels(
                route, str(status)
            )
        counter.inc()

    async def answer_lane(self, request: LaneRequest) -> web.Response:
        """A query the lane read (``conductor.query_lane``), answered as aiohttp would."""
        handler = self.query if request.path == "/query" else self.query_by_hash
        response = await self.answered(request, partial(handler, request), request.path)
        assert isinstance(response, web.Response), "the query routes answer whole bodies"
        return response

    def lane_protocol(self, runner: web.AppRunner) -> asyncio.Protocol:
        """A new connection's protocol: the query lane, with aiohttp behind it."""
        settings = self._lane_settings
        if settings is None:
            limits = self.options.limits
            settings = self._lane_settings = LaneSettings(
                self.answer_lane,
                self.read_plain_head,
                self.answer_plain,
                runner.server,  # type: ignore[arg-type]  # set up before any connection
                limits.body_bytes,
                limits.body_timeout_s,
                self.options.keepalive_timeout_s,
            )
        return QueryLane(settings)

    async def prometheus(self, request: web.Request) -> web.Response:
        response = web.Response(body=self.metrics.render())
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response


def _error_middleware(api: ConductorApi) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        return await api.answered(request, partial(handler, request), name)

    return middleware


def _refusal(request: ApiRequest, error: ApiError) -> web.Response:
    """The error in the request's dialect: Go's ``{"error", "field"}``, or upstream C++'s
    ``{"error"[, "reason"][, "field"][, "index"]}`` (no key without a value)."""
    if not speaks_cpp(request):
        return reply(request, {"error": error.message, "field": error.field}, error.status)
    extras = {"reason": error.reason, "field": error.field, "index": error.index}
    body = {"error": error.message, **{k: v for k, v in extras.items() if v is not None}}
    return reply(request, body, error.status)


def api_app(manager: ServiceManager, options: ApiOptions) -> web.Application:
    """The routes and their error handling; ``conductor.service`` adds what runs behind."""
    api = ConductorApi(manager, options)
    app = web.Application(
        client_max_size=options.limits.max_body_bytes, middlewares=[_error_middleware(api)]
    )
    app.add_routes(api.routes())
    app[API] = api
    if options.query_lane:
        app[CONNECTION_PROTOCOL] = api.lane_protocol
    return app
