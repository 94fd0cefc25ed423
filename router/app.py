"""The proxy: tokenize → ask the conductor → choose → forward (or prefill → decode).

Everything that decides is in ``policy`` (pure) and ``pool`` (state); this module owns
sockets, timeouts, retries and streaming. A response carries the decision in
``x-conductor-*`` headers so operators can see why a request went where it went.

With a Mooncake store configured (a prefill instance's ``kv_store``), the router asks the
conductor's ``/health`` every ``store_check_interval_seconds`` whether each store is up: while
one is down, its instances' hits are their GPU hits alone (no load priced, no prefix pulled
through it). The store's cost is learned from the engines' own store-load metrics.

Misconfiguration is loud: the router learns what each upstream serves (``/v1/models``, at
start and again whenever an upstream's list is unknown), warns when one does not serve the
configured ``modelname``, and answers vLLM's 404 itself for a model no upstream serves. Index
drift is visible: each answer's engine-reported cached tokens are compared with the
conductor's prediction for the prefill instance (``router_cache_*`` metrics, ``usage``).

Faults stay contained: every upstream call has a timeout (connect, a stream's headers, first
byte, then idle between chunks; ``upstream`` section), a request waiting for its first byte
from an engine taken out of rotation meanwhile moves on at once, numbers the engines report
are checked before they count (``engine_metrics``), a request body is bounded in bytes, JSON
values and depth (``limits``), background tasks are supervised (restarted, counted, shown on
``/health``), and the event loop's lag is measured (``router_event_loop_lag_seconds``).
Engines out of rotation are reported to the conductors (``/instance_down``, re-sent while
they stay out, then ``/instance_up``) so that their blocks stop counting. Every error is
OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, TypeVar

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from conductor.failures import describe
from conductor.hashing import token_bytes
from conductor.runtime import LoopLagMonitor, SupervisedTask
from conductor.states import StoreState

from . import disagg
from .conductor_client import ConductorClient
from .config import LimitsSection, RouterConfig
from .embedded import EmbeddedConductor
from .engine_metrics import IN_FLIGHT, engine_in_flight, in_range, parse_metrics
from .index_client import MAX_TOKENS, ConductorUnavailable, Hits, IndexClient, PromptBlocks
from .metrics import RouterMetrics
from .notices import Notices
from .pending import RECHECK_S, PendingPrefixes, PendingPrompt
from .policy import Candidate, Decision, RoutingParams, SloViolation, choose, reusable_hits
from .pool import CostLearner, InstancePool, Ticket, Upstream
from .store import STORE_METRICS, loads_in
from .tokenizer import InvalidPrompt, LocalTokenizer, Unsupported, probes
from .usage import UsageTap, cached_tokens

log = logging.getLogger(__name__)
T = TypeVar("T")

FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
MODELS_RETRY_S = 2.0  # how soon an upstream whose model list is unknown is asked again
MAX_TTFT_MS = 3_600_000.0  # an engine-reported TTFT past an hour is no measurement
TOKENIZE_ATTEMPTS = 3  # engines asked for a prompt's tokens before routing without them
# a body past this many bytes is tokenized in a worker thread (HF tokenizers release the
# GIL): about 5k tokens, a few ms of encoding. A smaller one is encoded on the loop when it
# is the only request being routed (no thread hop); in a burst every one goes to a thread,
# so the encodings run on every core and the loop keeps reading the conductor's answers
INLINE_TOKENIZE_BYTES = 16 * 1024
DOWN_TTL_PROBES = 3  # an /instance_down mark lasts this many probe intervals (re-sent)
REGISTER_RETRY_S = 1.0  # a failed registration round is retried this soon, then less often
MAX_LOGGED_CANDIDATES = 16  # a routing decision's DEBUG line lists at most this many
TOKENIZED_BY = "x-conductor-tokenized-by"
SCRAPED_METRICS = frozenset((*IN_FLIGHT, *STORE_METRICS))  # what an engine scrape reads
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class _TokenizeAnswer(msgspec.Struct):
    """An engine's ``/tokenize`` answer: the ids (its other fields are not read)."""

    tokens: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]]


_TOKENIZE_ANSWER = msgspec.json.Decoder(_TokenizeAnswer)


class ApiError(Exception):
    """An OpenAI-style error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, kind: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or ERROR_TYPES.get(status, "InternalServerError")

    def response(self) -> web.Response:
        body = {"message": self.message, "type": self.kind, "param": self.param}
        return web.json_response({"error": {**body, "code": self.status}}, status=self.status)


class UpstreamFailed(Exception):
    """Connection refused/reset or a 5xx before anything reached the client: retry."""


class UpstreamTimeout(UpstreamFailed):
    """No first byte within the timeout: retried elsewhere; a 504 when nowhere is left."""


@dataclass(frozen=True, slots=True)
class Routed:
    """One request as received, and what every routing attempt for it shares."""

    body: dict[str, Any]
    raw: bytes  # forwarded as received when nothing needs changing
    prompt_tokens: int
    tokenized_by: str  # given, local, engine or none (router_tokenize_total's path)
    fallback: str | None  # why the conductor's answer is missing, if it is
    started: float
    prompt: PromptBlocks | None  # None: the prompt's ids are unknown
    # per instance, hit tokens a prompt in flight there added to the conductor's answer
    in_flight_hits: dict[str, int]


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.limits = config.limits
        self.timeouts = config.upstream
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
        # each configured store's state as the conductor last reported it
        self.store_states = dict.fromkeys(
            sorted(set(config.kv_stores().values())), StoreState.UNCHECKED
        )
        self.metrics = RouterMetrics()
        self.pending = PendingPrefixes() if config.routing.in_flight_prefixes else None
        self._release_scheduled = False  # a look at the finished prompts held is due
        self._turn = itertools.count()  # rotates ties between equally good instances
        self._tokenizing = 0  # prompts being tokenized by the local tokenizer
        self._tokenizer_turn = itertools.count()  # spreads /tokenize calls
        self._rng = random.Random()
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._control: aiohttp.ClientSession | None = None
        self.conductor: IndexClient | None = None
        self.notices = Notices(log)
        self.lag = LoopLagMonitor(self.metrics.registry, "router")
        self.tasks: dict[str, SupervisedTask] = {}
        self._health_changed = asyncio.Event()  # wakes the dead-upstream reporter
        # per upstream, resolved when it is next taken out of rotation: wakes the requests
        # waiting for its first byte
        self._taken_out: dict[str, asyncio.Future[None]] = {}
        directory = config.tokenizer.directory(config.prefill.config.modelname)
        # raises TokenizerUnavailable (a ValueError) for a directory it cannot read
        self.local = (
            LocalTokenizer.load(directory, config.tokenizer.chunk_cache_tokens)
            if directory is not None
            else None
        )
        if self.local is not None and self.local.encoder is not None:
            self.metrics.watch_encoder(self.local.encoder)
        # the paths (completions, chat) the local tokenizer serves: once an engine agreed
        self.local_paths: set[bool] = set() if config.tokenizer.verify else {False, True}
        if self.local is not None and self.local.chat_unsupported:
            log.info("chat prompts go to the engines' /tokenize: %s", self.local.chat_unsupported)

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self.lag.start()
        self._control = aiohttp.ClientSession()
        upstream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.timeouts.connect_timeout_seconds
        )
        for upstream in self.pool.all():  # one pooled session (connection pool) per upstream
            self._sessions[upstream.instance_id] = aiohttp.ClientSession(
                upstream.url,
                timeout=upstream_timeout,
                # no cap: a capped pool queues requests (and /tokenize) inside the router,
                # where neither the engine's load nor the TTFT estimate can see them
                connector=aiohttp.TCPConnector(limit=0),
            )
            self.metrics.healthy.labels(upstream.instance_id).set(1)
        for store in self.store_states:
            self.metrics.store_up.labels(store).set(1)
        self._publish_cost_model()
        if self.config.conductor.embedded:
            self.conductor = EmbeddedConductor(self.config.prefill.config)
        else:
            self.conductor = ConductorClient.connect(
                self.config.conductor, self.config.prefill.config, self.notices
            )
        background: dict[str, Callable[[], Awaitable[None]]] = {
            "learn_models": self._learn_models,  # meanwhile, not after registering
            "probe_unhealthy": self._probe_unhealthy,
            "refresh_engine_load": self._refresh_engine_load,
            "keep_registered": self._keep_registered,
            "report_dead_upstreams": self._report_dead_upstreams,
        }
        if self.store_states:  # no store, nothing to watch
            background["watch_stores"] = self._watch_stores
        if self.local is not None and self.config.tokenizer.verify:
            background["verify_tokenizer"] = self._verify_tokenizer
        self._publish_local_paths()
        for name, factory in background.items():
            self.tasks[name] = SupervisedTask(name, factory, self.metrics.task_failures)
            self.tasks[name].start()

    async def stop(self) -> None:
        await asyncio.gather(*(task.stop() for task in self.tasks.values()), self.lag.stop())
        if self.conductor is not None:
            await self.conductor.close()
        for session in [*self._sessions.values(), self._control]:
            if session is not None:
                await session.close()

    def session(self, upstream: Upstream) -> aiohttp.ClientSession:
        return self._sessions[upstream.instance_id]

    # -- background ----------------------------------------------------------------------
    def _control_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeouts.control_timeout_seconds)

    async def _probe_unhealthy(self) -> None:
        """Probe each upstream out of rotation (every ``probe_interval_seconds``); a 200 on
        ``/health`` brings it back."""
        while True:
            await asyncio.sleep(self.timeouts.probe_interval_seconds / 2)
            for upstream in self.pool.due_for_probe():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.session(upstream).get(
                        "/health", timeout=self._control_timeout()
                    ) as response:
                        if response.status == 200:
                            self._healthy(upstream)
                            continue
                self._failed(upstream, "its /health does not answer 200")

    async def _refresh_engine_load(self) -> None:
        """Engines' own running+waiting counts, for load that other clients put on them,
        and their store loads, for the store's cost."""
        while True:
            await asyncio.sleep(self.timeouts.metrics_interval_seconds)
            for upstream in self.pool.all():
                if upstream.healthy:
                    await self._scrape(upstream)

    async def _scrape(self, upstream: Upstream) -> None:
        """One engine's ``/metrics``: lines that do not parse and values out of range are
        skipped and counted, the rest still count. An engine that refuses the connection is
        out of rotation (found even while no request goes there)."""
        try:
            async with self.session(upstream).get(
                "/metrics", timeout=self._control_timeout()
            ) as response:
                text = await response.text()
        except TimeoutError:  # slow is not dead
            return
        except aiohttp.ClientConnectionError as error:  # refused or reset: gone
            self._failed(upstream, f"/metrics: {describe(error)}")
            return
        except (aiohttp.ClientError, ValueError):
            return
        samples, skipped = parse_metrics(text, SCRAPED_METRICS)
        upstream.engine_in_flight, rejected = engine_in_flight(samples)
        self._rejected("metrics_line", skipped)
        self._rejected("metrics_value", rejected)
        if upstream.kv_store and self.learner is not None:
            self._learn_store_loads(upstream, samples)

    def _rejected(self, value: str, count: int = 1) -> None:
        if count:
            self.metrics.rejected_values.labels(value).inc(count)

    def _learn_store_loads(self, upstream: Upstream, samples) -> None:
        assert self.learner is not None
        loads = loads_in(samples)
        if loads is None:
            return
        delta = loads.since(upstream.store_loads)
        upstream.store_loads = loads
        if delta is not None:
            self.learner.observe_store_loads(delta)
            self._publish_cost_model()

    async def _watch_stores(self) -> None:
        """The conductor's word on each configured store (its /health). Without an answer
        the last word stands: the conductor's queries fail too, and routing falls back."""
        assert self.conductor is not None
        interval = self.config.conductor.store_check_interval_seconds
        while True:
            with contextlib.suppress(ConductorUnavailable):
                states = await self.conductor.store_states(timeout=min(interval, 1.0))
                for store in self.store_states:
                    self._set_store_state(store, states.get(store, StoreState.UNCHECKED))
            await asyncio.sleep(interval)

    def _set_store_state(self, store: str, state: StoreState) -> None:
        previous, self.store_states[store] = self.store_states[store], state
        if (previous is StoreState.DOWN) == (state is StoreState.DOWN):
            return
        if state is StoreState.DOWN:
            self.pool.stores_down.add(store)
            log.warning("kv store %s is down: its loads are not priced, nothing is pulled", store)
        else:
            self.pool.stores_down.discard(store)
            log.info("kv store %s is %s: its loads are priced again", store, state)
        self.metrics.store_up.labels(store).set(0 if state is StoreState.DOWN else 1)

    def _publish_cost_model(self) -> None:
        model = self.params.cost if self.learner is None else self.learner.model
        for name in ("per_token_s", "store_bytes_per_token", "store_bandwidth_bytes_s"):
            self.metrics.cost_model.labels(name).set(getattr(model, name))

    async def _learn_models(self) -> None:
        """What each upstream serves: at once (never holding start-up back), then for every
        healthy upstream whose list is unknown (unreachable so far, or back after a failure)."""
        while True:
            unknown = [u for u in self.pool.all() if u.healthy and u.models is None]
            await asyncio.gather(*(self._learn(upstream) for upstream in unknown))
            await asyncio.sleep(MODELS_RETRY_S)

    async def _learn(self, upstream: Upstream) -> None:
        try:
            async with self.session(upstream).get(
                "/v1/models", timeout=self._control_timeout()
            ) as response:
                if response.status != 200:
                    return
                upstream.models = served_models(await response.json(content_type=None))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return
        configured = self.config.prefill.config.modelname
        names = upstream.model_names()
        if configured not in names:
            log.warning(
                "upstream instance=%s url=%s serves %s, not the configured modelname %r "
                "(registered with the conductor): requests for it cannot be served there",
                upstream.instance_id,
                upstream.url,
                names,
                configured,
            )

    async def _keep_registered(self) -> None:
        """Register at once, in the background: the router listens and routes by load
        meanwhile (``/health`` says why it is degraded). Then again every
        ``reregister_interval_seconds`` (idempotent) so that a restarted conductor relearns
        the streams; a round that failed is retried sooner, backing off up to that interval."""
        assert self.conductor is not None
        interval = self.config.conductor.reregister_interval_seconds
        retry = REGISTER_RETRY_S
        while True:
            if await self.conductor.register(self.config.prefill.instances):
                retry, wait = REGISTER_RETRY_S, interval
            else:
                retry, wait = min(retry * 2, interval), min(retry, interval)
            await asyncio.sleep(wait)

    async def _report_dead_upstreams(self) -> None:
        """Tell the conductors which prefill instances are out of rotation, so their blocks
        stop counting in ``/query``: ``/instance_down`` with a TTL of a few probe
        intervals, re-sent every interval while it stays out, and ``/instance_up`` once it
        is back (were that lost, the mark expires)."""
        assert self.conductor is not None
        interval = self.timeouts.probe_interval_seconds
        registered = [i.instance_id for i in self.config.prefill.instances if i.registrations]
        sent: dict[str, float] = {}  # instance → when its down mark was last sent
        while True:
            self._health_changed.clear()
            for instance_id in registered:
                upstream = self.pool.prefill[instance_id]
                now = time.monotonic()
                if not upstream.healthy and now - sent.get(instance_id, -interval) >= interval:
                    sent[instance_id] = now
                    await self.conductor.report_instance(
                        instance_id, True, DOWN_TTL_PROBES * interval, "router: out of rotation"
                    )
                elif upstream.healthy and sent.pop(instance_id, None) is not None:
                    await self.conductor.report_instance(instance_id, False, 0.0, "")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._health_changed.wait()

    async def _verify_tokenizer(self) -> None:
        """Trust the local tokenizer for completions and for chat once an engine's
        ``/tokenize`` gives the same ids for every probe; a mismatch (or an engine that
        cannot tokenize chat) leaves that path with the engines for good."""
        assert self.local is not None
        pending = {False} if self.local.chat_unsupported else {False, True}
        while pending:
            for upstream in self._rotation(self.pool.prefill.values())[:1]:
                for chat in sorted(pending):
                    verdict = await self._agrees(upstream, chat)
                    if verdict is not None:
                        pending.discard(chat)
                    if verdict:
                        self.local_paths.add(chat)
                        log.info("tokenizing %s prompts in the router", _path_name(chat))
                self._publish_local_paths()
            if pending:
                await asyncio.sleep(MODELS_RETRY_S)

    async def _agrees(self, upstream: Upstream, chat: bool) -> bool | None:
        """Whether ``upstream``'s /tokenize gives the local ids for every probe of the
        path; None when it did not answer (asked again later)."""
        assert self.local is not None
        for probe_chat, body in probes(self.local, self.config.prefill.config.modelname):
            if probe_chat != chat:
                continue
            try:
                engine: Any = await self._tokenize_on(upstream, body)
            except ApiError as error:  # the engine refuses it: so must the router
                engine = error.message
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None
            if engine is None:
                return None
            try:
                local: Any = self.local.prompt_ids(chat, body)
            except Unsupported as unsupported:
                local = f"unsupported: {unsupported.reason}"
            if engine != local:
                log.warning(
                    "the router's tokenizer disagrees with instance=%s on a %s probe (%s): "
                    "those prompts keep going to the engines' /tokenize",
                    upstream.instance_id, _path_name(chat), _difference(local, engine),
                )  # fmt: skip
                return False
        return True

    def _publish_local_paths(self) -> None:
        for chat in (False, True):
            active = self.local is not None and chat in self.local_paths
            self.metrics.local_tokenizer.labels(_path_name(chat)).set(int(active))

    # -- deciding ------------------------------------------------------------------------
    async def tokenize(
        self, path: str, body: dict[str, Any], raw: bytes
    ) -> tuple[list[int] | None, str]:
        """The prompt's token ids and where they came from: given in the request, the
        router's own tokenizer (``tokenizer``), else a prefill instance's ``/tokenize``;
        None when no instance could say. A slow or odd tokenizer is skipped for the next
        one, never taken for a dead engine."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            try:  # checks every id in C: several times faster than a Python loop
                return msgspec.convert(prompt, list[int], strict=True), "given"
            except msgspec.ValidationError:  # not ids, or one past 64 bits (still ids)
                if all(type(t) is int for t in prompt):
                    return prompt, "given"
        chat = path.endswith("chat/completions")
        if self.local is not None and chat in self.local_paths:
            try:
                tokens = await self._tokenize_locally(chat, body, len(raw))
            except Unsupported as unsupported:
                self.metrics.local_skipped.labels(unsupported.reason).inc()
            except InvalidPrompt as invalid:
                raise ApiError(400, str(invalid), param="messages" if chat else "prompt") from None
            else:
                self._check_prompt_length(len(tokens))
                return tokens, "local"
        tokens = await self._tokenize_remotely(chat, body)
        return tokens, "none" if tokens is None else "engine"

    async def _tokenize_locally(self, chat: bool, body: dict[str, Any], size: int) -> list[int]:
        assert self.local is not None
        self._tokenizing += 1
        try:
            if size <= INLINE_TOKENIZE_BYTES and self._tokenizing == 1:
                return self.local.prompt_ids(chat, body)
            return await asyncio.to_thread(self.local.prompt_ids, chat, body)
        finally:
            self._tokenizing -= 1

    def _forwards_ids(self, path: str, body: dict[str, Any], tokenized_by: str) -> bool:
        """Whether the engine gets the router's ids instead of the prompt's text: saves it
        tokenizing the prompt again (~2 µs a token) where the ids are surely its own."""
        return (
            tokenized_by == "local"
            and self.config.tokenizer.forward_token_ids
            and not path.endswith("chat/completions")  # vLLM's chat takes no ids
            and not body.get("echo")
        )

    def _check_prompt_length(self, tokens: int) -> None:
        limit = self.limits.max_json_items
        if tokens >= limit:
            raise ApiError(400, f"the prompt is over the router's limit of {limit} tokens")

    async def _tokenize_remotely(self, chat: bool, body: dict[str, Any]) -> list[int] | None:
        request: dict[str, Any] = {"model": body.get("model")}
        if chat:
            request["messages"] = body.get("messages")
        else:
            request["prompt"] = body.get("prompt")
        async for _, status, raw in self._engines_tokenize(json.dumps(request).encode(), {}):
            tokens = self._ids_in(status, raw)
            if tokens is not None:
                return tokens
        return None

    async def _engines_tokenize(
        self, payload: bytes, headers: dict[str, str]
    ) -> AsyncIterator[tuple[Upstream, int, bytes]]:
        """Healthy prefill instances' ``/tokenize`` answers (status, body), one at a time,
        at most ``TOKENIZE_ATTEMPTS`` asked. A slow one is counted and skipped, never taken
        for dead; one that refuses the connection is out of rotation until probed."""
        for upstream in self._rotation(self.pool.prefill.values())[:TOKENIZE_ATTEMPTS]:
            try:
                status, raw = await self._engine_tokenize(upstream, payload, headers)
            except TimeoutError:
                self.metrics.timeouts.labels(upstream.instance_id, "tokenize").inc()
                continue
            except aiohttp.ClientConnectionError as error:
                self._failed(upstream, f"/tokenize: {describe(error)}")
                continue
            except aiohttp.ClientError:
                continue
            yield upstream, status, raw

    async def _engine_tokenize(
        self, upstream: Upstream, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """One engine's ``/tokenize`` answer, within the tokenize timeout however the
        engine trickles it."""
        async with asyncio.timeout(self.timeouts.tokenize_timeout_seconds):
            async with self.session(upstream).post(
                "/tokenize", data=payload, headers={**headers, "Content-Type": "application/json"}
            ) as response:
                return response.status, await response.read()

    async def _tokenize_on(self, upstream: Upstream, request: dict[str, Any]) -> list[int] | None:
        """One engine's ``/tokenize`` ids (``_ids_in``)."""
        return self._ids_in(
            *await self._engine_tokenize(upstream, json.dumps(request).encode(), {})
        )

    def _ids_in(self, status: int, raw: bytes) -> list[int] | None:
        """The token ids of an engine's ``/tokenize`` answer; None for an answer of another
        shape (counted) or a 5xx; its 4xx is the client's error."""
        if 400 <= status < 500:
            raise ApiError(status, _upstream_message(raw.decode(errors="replace")))
        if status != 200:
            return None
        self._check_prompt_length(raw.count(b","))
        try:  # parsed and every id checked in C
            return _TOKENIZE_ANSWER.decode(raw).tokens
        except msgspec.MsgspecError:
            self._rejected("tokenize_answer")
            return None

    def _rotation(self, upstreams) -> list[Upstream]:
        healthy = [u for u in upstreams if u.healthy]
        if not healthy:
            return []
        start = next(self._tokenizer_turn) % len(healthy)
        return healthy[start:] + healthy[:start]

    async def hits(self, prompt: PromptBlocks | None) -> tuple[Hits, str | None]:
        """The index's answer for the prompt, or no hits and why (the fallback reason)."""
        if prompt is None:
            return {}, "tokenize_failed"
        assert self.conductor is not None
        asked = time.perf_counter()
        try:
            awaiting = () if self.pending is None else self.pending.awaiting_index()
            hits = await self.conductor.hits(prompt, awaiting)
        except ConductorUnavailable:  # logged once by the client, not per request
            return {}, "conductor_unavailable"
        finally:
            self.metrics.conductor_query_seconds.observe(time.perf_counter() - asked)
        return reusable_hits(hits, prompt.tokens, self.params.block_size), None

    def prompt_blocks(self, tokens: list[int], body: dict[str, Any]) -> PromptBlocks:
        """The prompt as the index and the prompts in flight read it (packed once: a
        conductor is sent the int32s, the block hashes are hashed when first read)."""
        return PromptBlocks(
            token_bytes(tokens), self.params.block_size, body.get("cache_salt") or ""
        )

    def add_in_flight(self, hits: Hits, prompt: PromptBlocks) -> dict[str, int]:
        """Raise each instance's GPU hit in ``hits`` to the longest prefix of the prompt
        sent there and still pending; returns the tokens this added, per instance."""
        if self.pending is None:
            return {}
        block_size = self.params.block_size
        added: dict[str, int] = {}
        pending_hits = {
            name: (blocks * block_size,) * 3
            for name, blocks in self.pending.match(prompt.hashes).items()
        }
        for name, (pending, _, _) in reusable_hits(pending_hits, prompt.tokens, block_size).items():
            gpu, cpu, disk = hits.get(name, (0, 0, 0))
            if pending > gpu:
                hits[name] = (pending, max(cpu, pending), max(disk, pending))
                added[name] = pending - gpu
        return added

    def candidates(self, hits: Hits, exclude: set[str], model: Any = None) -> list[Candidate]:
        """The healthy instances not yet tried that may serve ``model``, with their hits and
        load. When every one is out of rotation they are tried anyway: one may be back
        before its next probe says so; a 503 when none is left."""
        for out_of_rotation in (False, True):
            candidates = [
                c
                for c in self.pool.candidates(hits, model, out_of_rotation)
                if c.instance_id not in exclude
            ]
            if candidates:
                return candidates
        raise ApiError(503, "no healthy prefill instance", "ServiceUnavailableError")

    def decide(
        self, prompt_tokens: int, candidates: list[Candidate], fallback: str | None
    ) -> Decision:
        """Run the policy over ``candidates``; least_loaded without the conductor's answer."""
        params = self.params
        if self.learner is not None:
            params = replace(params, cost=self.learner.model)
        if fallback:
            params = replace(params, policy="least_loaded")
        decision = choose(params, candidates, next(self._turn), prompt_tokens, self._rng)
        self.metrics.decisions.labels(decision.policy, decision.instance_id).inc()
        longest = min(max(c.disk_tokens for c in candidates), prompt_tokens)  # cumulative tiers
        if longest > decision.cached_tokens:
            self.metrics.forgone_tokens.inc(longest - decision.cached_tokens)
        return decision

    def _failed(self, upstream: Upstream, reason: str) -> None:
        """Out of rotation until the prober sees it healthy again (logged once, then as a
        reminder while it stays out); the requests waiting for its first byte move on."""
        self.notices.fault(
            f"upstream {upstream.instance_id}",
            "upstream instance=%s out of rotation: %s",
            upstream.instance_id,
            reason,
        )
        self.pool.mark_failed(upstream)
        if self.pending is not None:  # a restarted engine must not be credited its old prompts
            self.pending.forget(upstream.instance_id)
        self.metrics.healthy.labels(upstream.instance_id).set(0)
        self._health_changed.set()
        taken_out = self._taken_out.pop(upstream.instance_id, None)
        if taken_out is not None:
            taken_out.set_result(None)

    def _taken_out_signal(self, upstream: Upstream) -> asyncio.Future[None]:
        """Resolved when ``upstream`` is next taken out of rotation."""
        signal = self._taken_out.get(upstream.instance_id)
        if signal is None:
            signal = asyncio.get_running_loop().create_future()
            self._taken_out[upstream.instance_id] = signal
        return signal

    async def _first_byte(
        self, upstream: Upstream, call: Awaitable[T], deadline: float, stage: str
    ) -> T:
        """``call`` (an answer's headers, its first chunk, a prefill's whole answer) by
        ``deadline`` (loop time), else UpstreamTimeout of ``stage``; UpstreamFailed at once
        when the upstream is taken out of rotation meanwhile (a failed probe or scrape,
        another request's failure): nobody waits out a timeout on an engine known dead."""
        work = asyncio.ensure_future(call)
        taken_out = self._taken_out_signal(upstream)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.wait((work, taken_out), return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
        finally:
            work.cancel()  # nothing when it is done; else it is abandoned
        if taken_out.done():
            raise UpstreamFailed(
                f"instance {upstream.instance_id} was taken out of rotation before its first byte"
            )
        raise self._timed_out(upstream, stage)

    def _healthy(self, upstream: Upstream) -> None:
        self.pool.mark_healthy(upstream)
        self.metrics.healthy.labels(upstream.instance_id).set(1)
        self.notices.recovered(
            f"upstream {upstream.instance_id}", "upstream instance=%s back", upstream.instance_id
        )
        self._health_changed.set()

    # -- handlers ------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        body, raw = await read_json_body(request, self.limits)
        model = body.get("model")
        if self.pool.serves_nowhere(model):  # vLLM's own answer, without a round trip
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        tokens, tokenized_by = await self.tokenize(request.path, body, raw)
        self.metrics.tokenized.labels(tokenized_by).inc()
        if tokens is not None and self._forwards_ids(request.path, body, tokenized_by):
            body, raw = {**body, "prompt": tokens}, with_prompt_ids(body, tokens)
        prompt = None if tokens is None else self.prompt_blocks(tokens, body)
        hits, fallback = await self.hits(prompt)
        in_flight_hits = {} if fallback or prompt is None else self.add_in_flight(hits, prompt)
        if fallback:
            self.metrics.fallbacks.labels(fallback).inc()
        routed = Routed(
            body, raw, len(tokens or ()), tokenized_by, fallback, started, prompt, in_flight_hits
        )
        self.metrics.prompt_tokens.inc(routed.prompt_tokens)
        failed: set[str] = set()
        last: UpstreamFailed | None = None
        while True:  # each failed instance is excluded, so this ends
            try:
                candidates = self.candidates(hits, failed, model)
            except ApiError as error:
                if isinstance(last, UpstreamTimeout) and error.status == 503:
                    raise ApiError(504, f"no upstream answered in time: {last}") from None
                raise
            decision = self.decide(routed.prompt_tokens, candidates, fallback)
            decode = self._decode_instance()
            if log.isEnabledFor(logging.DEBUG):
                log.debug(decision_line(decision, candidates, decode, fallback))
            if not failed:
                self.metrics.proxy_seconds.observe(time.perf_counter() - started)
            upstream = self.pool.prefill[decision.instance_id]
            try:
                return await self._serve(request, routed, decision, upstream, decode)
            except UpstreamFailed as error:
                last = error
                failed.add(upstream.instance_id)
                self._failed(upstream, str(error))
                self.metrics.retries.labels(upstream.instance_id).inc()

    def _decode_instance(self) -> Upstream | None:
        """The least loaded healthy decode instance; None without disaggregation (a 503
        when every decode instance is out of rotation)."""
        if not self.pool.decode:
            return None
        decode_upstreams = self.pool.healthy_decode()
        if not decode_upstreams:
            raise ApiError(503, "no healthy decode instance", "ServiceUnavailableError")
        return min(decode_upstreams, key=lambda u: (u.load, u.requests))

    async def _serve(
        self,
        request: web.Request,
        routed: Routed,
        decision: Decision,
        prefill: Upstream,
        decode: Upstream | None,
    ) -> web.StreamResponse:
        self.metrics.cached_tokens.inc(decision.cached_tokens)
        headers = {
            "x-conductor-prefill-instance": prefill.instance_id,
            "x-conductor-cached-tokens": str(decision.cached_tokens),
            "x-conductor-policy": decision.policy,
            TOKENIZED_BY: routed.tokenized_by,
            "x-conductor-overhead-ms": f"{(time.perf_counter() - routed.started) * 1000:.3f}",
        }
        if routed.fallback:
            headers["x-conductor-fallback"] = routed.fallback
        forwarded = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
        forwarded["Content-Type"] = "application/json"
        new_tokens = max(routed.prompt_tokens - decision.cached_tokens, 0)
        ticket = self.pool.claim(prefill, new_tokens)
        if added := routed.in_flight_hits.get(prefill.instance_id):
            self.metrics.in_flight_hit_tokens.inc(min(added, decision.cached_tokens))
        pending = (
            self.pending.add(prefill.instance_id, routed.prompt.hashes)
            if self.pending is not None and routed.prompt is not None
            else None
        )
        queued_before = prefill.queued_prefill_tokens - new_tokens
        self.metrics.in_flight.labels(prefill.instance_id).inc()
        # without the conductor's answer there is no prediction to compare the engine's with
        predicted = None if routed.fallback else decision.cached_tokens
        try:
            if decode is None:
                return await self._stream(
                    request, prefill, routed, routed.raw, forwarded, headers, ticket,
                    learn=(new_tokens, queued_before), predicted=predicted,
                )  # fmt: skip
            headers["x-conductor-decode-instance"] = decode.instance_id
            answer = await self._prefill_only(request.path, routed.body, prefill, forwarded)
            if predicted is not None:
                realized = self._cached_tokens(cached_tokens(answer), routed)
                self.metrics.record_cache_use(prefill.instance_id, predicted, realized)
            params = disagg.transfer_params(answer)
            ticket.first_token()
            self._observe(new_tokens, queued_before, time.perf_counter() - routed.started)
            payload = json.dumps(disagg.decode_request(routed.body, params)).encode()
            decode_ticket = self.pool.claim(decode, 0)
            try:
                return await self._stream(
                    request, decode, routed, payload, forwarded, headers, decode_ticket
                )
            except UpstreamFailed as error:  # the prefill is fine: do not retry it
                self._failed(decode, str(error))
                message = f"decode instance {decode.instance_id} failed: {error}"
                raise ApiError(
                    504 if isinstance(error, UpstreamTimeout) else 502, message
                ) from None
            finally:
                decode_ticket.release()
        finally:
            ticket.release()
            self.metrics.in_flight.labels(prefill.instance_id).dec()
            if pending is not None:
                self._held_until_indexed(pending)

    def _held_until_indexed(self, prompt: PendingPrompt) -> None:
        """A request ended: its prompt stays in flight until the index has its blocks, as
        the conductor says (the embedded index, or ours in each query's answer); looked at
        every ``RECHECK_S`` while some finished prompt is held."""
        assert self.pending is not None
        self.pending.end(prompt, time.time())
        if not self._release_scheduled:
            self._release_scheduled = True
            asyncio.get_running_loop().call_later(RECHECK_S, self._release_indexed)

    def _release_indexed(self) -> None:
        assert self.pending is not None and self.conductor is not None
        grace_s = self.config.routing.in_flight_grace_seconds
        self.pending.release_indexed(self.conductor.indexed_until, time.time(), grace_s)
        self._release_scheduled = self.pending.ending
        if self._release_scheduled:
            asyncio.get_running_loop().call_later(RECHECK_S, self._release_indexed)

    def _observe(self, new_tokens: int, queued_tokens: int, ttft_s: float | None) -> None:
        if ttft_s is None:
            return
        self.metrics.ttft_seconds.observe(ttft_s)
        if self.learner is not None:
            self.learner.observe(new_tokens, queued_tokens, ttft_s)
            self._publish_cost_model()

    async def _prefill_only(
        self, path: str, body: dict[str, Any], prefill: Upstream, headers: dict[str, str]
    ) -> dict[str, Any]:
        """The prefill leg of disaggregation: its answer (kv_transfer_params and usage),
        within the first-byte timeout (one token is all it computes)."""
        deadline = asyncio.get_running_loop().time() + self.timeouts.first_byte_timeout_seconds
        call = self._prefill_answer(path, body, prefill, headers)
        try:
            answer = await self._first_byte(prefill, call, deadline, "first_byte")
        except (aiohttp.ClientError, ValueError, RecursionError) as error:
            raise UpstreamFailed(describe(error)) from None
        return answer if isinstance(answer, dict) else {}

    async def _prefill_answer(
        self, path: str, body: dict[str, Any], prefill: Upstream, headers: dict[str, str]
    ) -> Any:
        async with self.session(prefill).post(
            path, json=disagg.prefill_request(body), headers=headers
        ) as response:
            if response.status >= 500:
                raise UpstreamFailed(f"prefill answered {response.status}")
            answer = await response.json(content_type=None)
            if response.status != 200:
                raise ApiError(response.status, _upstream_message(answer), "UpstreamError")
            return answer

    async def _stream(
        self,
        request: web.Request,
        upstream: Upstream,
        routed: Routed,
        payload: bytes,
        forwarded: dict[str, str],
        headers: dict[str, str],
        ticket: Ticket,
        learn: tuple[int, int] | None = None,
        predicted: int | None = None,
    ) -> web.StreamResponse:
        """Forward and pass the answer through chunk by chunk (SSE stays SSE). Failing
        before the first byte is retryable; after it, the client sees the transfer cut.
        With ``predicted`` (the conductor's hit on the prefill instance), a complete 200
        answer's cached tokens are compared with it."""
        now = asyncio.get_running_loop().time()
        deadline = now + self.timeouts.first_byte_timeout_seconds
        headers_by, stage = deadline, "first_byte"
        if routed.body.get("stream") is True:  # vLLM sends a stream's headers at once
            stream_headers_by = now + self.timeouts.stream_headers_timeout_seconds
            if stream_headers_by < deadline:
                headers_by, stage = stream_headers_by, "stream_headers"
        post = self.session(upstream).post(request.path, data=payload, headers=forwarded)
        try:
            upstream_response = await self._first_byte(upstream, post, headers_by, stage)
        except aiohttp.ClientConnectionError as error:
            raise UpstreamFailed(describe(error)) from None
        async with upstream_response:
            if upstream_response.status >= 500:
                raise UpstreamFailed(f"answered {upstream_response.status}")
            response = web.StreamResponse(status=upstream_response.status)
            for name, value in upstream_response.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers[name] = value
            response.headers.update(headers)
            streaming = upstream_response.content_type == "text/event-stream"
            tap = UsageTap(streaming) if predicted is not None else None
            first = True
            try:
                async for chunk in self._chunks(upstream, upstream_response.content, deadline):
                    if first:
                        first = False
                        ticket.first_token()
                        if learn is not None:
                            ttft = self._ttft(upstream_response, routed, time.perf_counter())
                            self._observe(*learn, ttft)
                        await response.prepare(request)
                    await response.write(chunk)
                    if tap is not None:
                        tap.feed(chunk)
            except (aiohttp.ClientPayloadError, TimeoutError) as error:
                if first:  # a cut (no first byte in time is an UpstreamTimeout)
                    raise UpstreamFailed(f"answer cut before any byte: {describe(error)}") from None
                if isinstance(error, TimeoutError):
                    self.metrics.timeouts.labels(upstream.instance_id, "idle").inc()
                self._failed(upstream, f"answer cut short: {describe(error)}")
                assert request.transport is not None
                request.transport.close()  # the client must see a truncated answer, not EOF
                return response
            if first:
                await response.prepare(request)
            await response.write_eof()
            if tap is not None and upstream_response.status == 200:
                realized = self._cached_tokens(tap.cached_tokens(), routed)
                self.metrics.record_cache_use(upstream.instance_id, predicted, realized)
            return response

    async def _chunks(
        self, upstream: Upstream, content: aiohttp.StreamReader, deadline: float
    ) -> AsyncIterator[bytes]:
        """The answer's chunks as they come: the first by ``deadline`` (the first-byte
        timeout, as ``_first_byte`` waits), each next one within the idle timeout (else
        TimeoutError)."""
        chunk = await self._first_byte(upstream, content.readany(), deadline, "first_byte")
        while chunk:
            yield chunk
            async with asyncio.timeout(self.timeouts.idle_timeout_seconds):
                chunk = await content.readany()

    def _timed_out(self, upstream: Upstream, stage: str) -> UpstreamTimeout:
        self.metrics.timeouts.labels(upstream.instance_id, stage).inc()
        if stage == "stream_headers":
            timeout = self.timeouts.stream_headers_timeout_seconds
            return UpstreamTimeout(
                f"instance {upstream.instance_id} sent no stream headers within {timeout}s"
            )
        timeout = self.timeouts.first_byte_timeout_seconds
        return UpstreamTimeout(f"instance {upstream.instance_id} sent nothing within {timeout}s")

    def _ttft(self, response: aiohttp.ClientResponse, routed: Routed, now: float) -> float | None:
        """The engine's own TTFT when it reports a sane one (a finite number of ms within an
        hour; else it is ignored and counted); else, for a stream, the first byte's time
        (a whole non-streamed answer says nothing about its first token)."""
        reported = response.headers.get("x-engine-ttft-ms")
        if reported is not None:
            try:
                ttft_ms = float(reported)
            except ValueError:
                ttft_ms = float("nan")
            if in_range(ttft_ms, MAX_TTFT_MS):
                return ttft_ms / 1000
            self._rejected("ttft_header")
        return now - routed.started if routed.body.get("stream") else None

    def _cached_tokens(self, reported: int | None, routed: Routed) -> int | None:
        """An engine's cached-token count when it is one (0..the prompt's tokens); else
        None (counted): the answer counts as unverified."""
        if reported is None:
            return None
        if in_range(reported, routed.prompt_tokens or MAX_TOKENS):
            return reported
        self._rejected("cached_tokens")
        return None

    async def tokenize_prompt(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` (a ``prompt``, or ``messages`` for a chat): answered by the
        router's own tokenizer on a path an engine agreed on, when the engines' model list
        gives the model's ``max_model_len``; else passed on to an engine's ``/tokenize``
        (its answer, errors included, as it gave it). ``x-conductor-tokenized-by`` says
        which (``local`` or ``engine``)."""
        body, raw = await read_json_object(request, self.limits)
        _check_types(body, (("model", str),))
        chat = _tokenize_kind(body)
        model = body.get("model")
        if model is not None and self.pool.serves_nowhere(model):
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        answer = await self._tokenize_here(chat, body, len(raw), model)
        if answer is not None:
            return web.json_response(answer, headers={TOKENIZED_BY: "local"})
        forwarded = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
        async for upstream, status, answered in self._engines_tokenize(raw, forwarded):
            if status < 500:
                headers = {
                    TOKENIZED_BY: "engine",
                    "x-conductor-prefill-instance": upstream.instance_id,
                }
                return web.Response(
                    body=answered, status=status, content_type="application/json", headers=headers
                )
        raise ApiError(503, "no prefill instance answered /tokenize", "ServiceUnavailableError")

    async def _tokenize_here(
        self, chat: bool, body: dict[str, Any], size: int, model: str | None
    ) -> dict[str, Any] | None:
        """vLLM's ``/tokenize`` answer from the local tokenizer; None when it cannot give
        the engines' answer (not trusted on this path, a request it leaves to them, the
        model's ``max_model_len`` unknown)."""
        max_model_len = self.pool.max_model_len(model or self.config.prefill.config.modelname)
        want_strs = body.get("return_token_strs")
        if (
            self.local is None
            or chat not in self.local_paths
            or max_model_len is None
            or not (want_strs is None or type(want_strs) is bool)
        ):
            return None
        try:
            tokens = await self._tokenize_locally(chat, body, size)
        except Unsupported as unsupported:
            self.metrics.local_skipped.labels(unsupported.reason).inc()
            return None
        except InvalidPrompt as invalid:
            raise ApiError(400, str(invalid), param="messages" if chat else "prompt") from None
        return {
            "count": len(tokens),
            "max_model_len": max_model_len,
            "tokens": tokens,
            "token_strs": self.local.token_strs(tokens) if want_strs else None,
        }

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
        if self.conductor is not None:
            reasons += self.conductor.degraded_reasons()
        body: dict[str, Any] = {
            "status": "degraded" if reasons else "ok",
            "reasons": reasons,
            "prefill_instances": healthy,
            "decode_instances": [u.instance_id for u in self.pool.healthy_decode()],
            "policy": self.params.policy,
            "event_loop_lag_worst_seconds": round(self.lag.worst, 4),
            "conductors": self.conductor.states() if self.conductor is not None else {},
            "tasks": {
                name: {
                    "state": task.state,
                    "restarts": task.restarts,
                    "last_error": task.last_error,
                }
                for name, task in self.tasks.items()
            },
        }
        if self.store_states:
            body["kv_stores"] = self.store_states
        return web.json_response(body, status=200 if healthy else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        if self.conductor is not None:  # the embedded index's series, conductor_*
            body += self.conductor.exposition()
        response = web.Response(body=body)
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response


def decision_line(
    decision: Decision,
    candidates: Sequence[Candidate],
    decode: Upstream | None,
    fallback: str | None,
) -> str:
    """A routing decision for the DEBUG log: where it went, the hit it counted on, the
    policy, each candidate's hit, load and score (the policy's: estimated TTFT seconds for
    ``ttft``, none for the simple ones), and why the conductor's answer is missing."""
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


def _upstream_message(answer: Any) -> str:
    if isinstance(answer, str):
        with contextlib.suppress(ValueError):
            answer = json.loads(answer)
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message", answer["error"]))
    return str(answer)[:500]


def served_models(answer: Any) -> tuple[dict[str, Any], ...]:
    """The entries of a ``/v1/models`` answer that name a model (others are skipped)."""
    data = answer.get("data") if isinstance(answer, dict) else None
    cards = data if isinstance(data, list) else []
    return tuple(c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str))


async def read_json_body(
    request: web.Request, limits: LimitsSection
) -> tuple[dict[str, Any], bytes]:
    """A completion request's JSON object (``read_json_object``): a ``model``, and the
    fields the router reads of the right types (400 naming the field)."""
    body, raw = await read_json_object(request, limits)
    _check_types(body, (("model", str), ("stream", bool), ("max_tokens", int), ("cache_salt", str)))
    if not _utf8(body.get("cache_salt") or ""):  # the salt is hashed as UTF-8
        raise ApiError(400, "`cache_salt` must be valid Unicode text", param="cache_salt")
    if "model" not in body:
        raise ApiError(400, "`model` is required", param="model")
    return body, raw


def _check_types(body: dict[str, Any], fields: Iterable[tuple[str, type]]) -> None:
    """Each of ``fields`` the body sets (not null) is of its type; else a 400 naming it."""
    for key, kind in fields:
        if key in body and body[key] is not None and not isinstance(body[key], kind):
            raise ApiError(400, f"`{key}` must be a {kind.__name__}", param=key)


def _tokenize_kind(body: dict[str, Any]) -> bool:
    """Whether a ``/tokenize`` body is a chat's (``messages``) rather than a ``prompt``; a
    400 unless it gives exactly one of them."""
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        param = "messages" if has_prompt else "prompt"
        raise ApiError(400, "give exactly one of `prompt` and `messages`", param=param)
    return has_messages


async def read_json_object(
    request: web.Request, limits: LimitsSection
) -> tuple[dict[str, Any], bytes]:
    """The request's JSON object, within the limits: bytes (413), values and depth (400,
    ``param`` "body" as vLLM names a body's errors), read time (408). Values are counted
    before parsing, so no body holds the event loop longer than parsing ``max_json_items``
    values takes."""
    max_bytes = limits.max_body_bytes
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"request body over {max_bytes} bytes")
    try:
        async with asyncio.timeout(limits.body_read_timeout_seconds):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body over {max_bytes} bytes") from None
    except TimeoutError:
        message = f"request body not received within {limits.body_read_timeout_seconds}s"
        raise ApiError(408, message) from None
    if raw.count(b",") >= limits.max_json_items:
        raise ApiError(
            400, f"request body has over {limits.max_json_items} JSON values", param="body"
        )
    too_deep = ApiError(
        400, f"request body is nested deeper than {limits.max_json_depth} levels", param="body"
    )
    try:
        body = _loads(raw)
    except RecursionError:  # nested past the interpreter's limit: over ours too
        raise too_deep from None
    except ValueError:
        raise ApiError(400, "request body is not valid JSON", param="body") from None
    brackets = raw.count(b"[") + raw.count(b"{")  # a body with few cannot nest deeply
    if brackets > limits.max_json_depth and _deeper_than(body, limits.max_json_depth):
        raise too_deep
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", param="body")
    return body, raw


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (JSON escapes allow lone surrogates; UTF-8 does not)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def with_prompt_ids(body: dict[str, Any], tokens: list[int]) -> bytes:
    """``body`` as JSON with ``prompt`` replaced by ``tokens``: the ids through msgspec
    (~20× faster than json on 10k ids), the other fields as ``json`` writes them (a NaN the
    client sent stays a NaN, where msgspec would write null)."""
    rest = json.dumps({k: v for k, v in body.items() if k != "prompt"}, separators=(",", ":"))
    ids = b'{"prompt":' + msgspec.json.encode(tokens)
    return ids + b"}" if rest == "{}" else ids + b"," + rest[1:].encode()


def _loads(raw: bytes) -> Any:
    """``json.loads``, through msgspec (several times faster on token lists) when it can:
    what msgspec refuses (NaN, huge numbers, lone surrogates, deep nesting) takes the
    standard parser, so every body means what it meant."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        return json.loads(raw)


def _path_name(chat: bool) -> str:
    return "chat" if chat else "completions"


def _difference(local: Any, engine: Any) -> str:
    """Where the router's ids first differ from an engine's answer, for the log."""
    if not isinstance(engine, list) or not isinstance(local, list):
        return f"the router has {local!r:.100}, the engine answered {engine!r:.200}"
    at = next((i for i, (a, b) in enumerate(zip(local, engine, strict=False)) if a != b), None)
    at = min(len(local), len(engine)) if at is None else at
    return (
        f"first difference at token {at}: router {local[at : at + 5]} engine {engine[at : at + 5]}"
    )


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests more than ``limit`` levels (iteratively: no recursion)."""
    stack: list[tuple[Iterable[Any], int]] = [([value], 0)]
    while stack:
        children, depth = stack.pop()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child.values() if isinstance(child, dict) else child, depth + 1))
    return False


def create_app(router: Router) -> web.Application:
    @web.middleware
    async def errors(request: web.Request, handler) -> web.StreamResponse:
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
