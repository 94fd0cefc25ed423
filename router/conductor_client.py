"""Talks to the conductors: registers the prefill instances' event streams, asks for hits,
reports engines the router sees dead.

Requests are msgpack with int32-packed tokens (the cheapest form for the conductor to
parse); answers in the Go shape ``{tenant: {instance: {GPU, CPU, DISK, ...}}}`` and in the
C++ rewrite's ``{"instances": {id: {gpu, cpu, disk}}}`` are both understood.

With several conductors the router registers with every one and asks one at a time: the
one that answered last, else the next in order (each within the query timeout). The router
registers in the background and serves meanwhile (by load); ``degraded_reasons`` says, for
``/health``, why no conductor can be asked yet. A
conductor's token (``auth_token``) goes as ``Authorization: Bearer`` on every call. A
conductor that stops answering is logged once, then as a periodic reminder, and its return
once.

A query past its timeout is not cut: the router routes without it, and the answer is still
read (within the control timeout) so that its keep-alive connection serves the next query.
Cutting it closed the connection, and under load every timeout then cost a new TCP
connection on both sides, which made the next query later still.

Queries ask our conductor to list only the instances with a hit (``X-Conductor-Hits-Only``;
the Go shape lists every instance, which at 1,000 instances is most of an answer's bytes).
A query may name instances (``progress_of``) whose indexing progress the router wants to
know: our conductor answers, in a header, up to when it holds everything each published
(the Go service does not: ``indexed_until`` stays None). Past ``MAX_PROGRESS_OF`` instances
each query names the next ones in turn.

Router replicas share what they route through the conductors (``conductor.share_routed``):
each decision's prompt is reported to every conductor (``/routed``), whose answers to the
other replicas count it on its instance until its events are indexed. Reports are fire and
forget: queued (at most ``MAX_REPORTS_QUEUED``, the oldest dropped and counted) and sent by
one background task, never on a request's path. A conductor that does not take them is
named in ``/health``'s reasons (this replica then routes on what it sent itself).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

import aiohttp
import msgpack
from prometheus_client import generate_latest

from conductor.api import HITS_ONLY_HEADER, INDEXED_UNTIL_HEADER, PROGRESS_HEADER
from conductor.failures import describe
from conductor.lane_http import LANE_ROUTES
from conductor.loads import LOADS_HEADER, OTHERS_HEADER
from conductor.states import StoreState

from .config import ConductorSection, ModelSection
from .index_client import (
    MAX_TOKENS,
    ConductorState,
    ConductorUnavailable,
    Hits,
    IndexContext,
    PromptBlocks,
    answer_text,
)
from .metrics import ReplicaMetrics
from .notices import Notices
from .pool import InstancePool
from .replica_load import WORDING as LOAD_WORDING
from .replica_load import LoadSharing
from .shared_route import SharedRoute, Wording

log = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
MAX_LATE_CALLS = 32  # late answers still read in the background; past it, calls are cut
MAX_PROGRESS_OF = 64  # instances a query asks the indexing progress of
ROUTED_WORDING = Wording(
    taken="routed prompts",
    refused="routed prompts",
    shared="routed prompts",
    setting="conductor.share_routed",
    unseen="this one's",
    alone="routes on what it sent itself",
)
MAX_REPORTS_QUEUED = 1024  # routed prompts waiting to be reported; past it the oldest go
REPORTS_AT_ONCE = 16  # routed prompts reported concurrently
T = TypeVar("T")


class RegistrationRefused(Exception):
    """The conductor answered, and said no (a conflict, 409 in JSON and 400 in msgpack: the
    stream is registered differently)."""


class ConductorClient:
    """The conductor services as the router's index (``index_client.IndexClient``)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        section: ConductorSection,
        notices: Notices,
        pool: InstancePool,
        control: aiohttp.ClientSession | None = None,
    ) -> None:
        self._session = session  # /query and /query_by_hash
        self._control = control or session  # every other call
        self._section = section
        self._notices = notices
        self.urls = section.urls()
        self._current = 0  # the conductor asked first: the one that answered last
        token = section.auth_token
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._headers = {"Content-Type": MSGPACK, "Accept": MSGPACK, **self._auth}
        self._registered: set[str] = set()  # conductors whose last registration round worked
        self._registration_errors: dict[str, str] = {}  # conductor -> why it has not (yet)
        self._late: set[asyncio.Future[Any]] = set()  # calls past their timeout, still read
        self._indexed_until: dict[str, float] = {}  # instance -> as the conductor last said
        self._progress_turns = itertools.count()
        self.replica_metrics = ReplicaMetrics()
        self._reports: deque[tuple[PromptBlocks, str]] = deque()
        self._reporter: asyncio.Task[None] | None = None
        metrics = self.replica_metrics
        self._routed = SharedRoute(
            "/routed", ROUTED_WORDING, metrics.reports, metrics.sharing, notices
        )
        self._loads: LoadSharing | None = None
        if section.share_load:
            route = SharedRoute(
                "/loads", LOAD_WORDING, metrics.load_reports, metrics.load_sharing, notices
            )
            self._loads = LoadSharing(
                pool, self.urls, self._post, section.share_load_ttl_seconds,
                self._control_timeout(), route,
            )  # fmt: skip
            self._loads.start()

    @classmethod
    def connect(
        cls, section: ConductorSection, notices: Notices, pool: InstancePool
    ) -> ConductorClient:
        """A client with connection pools of its own, uncapped: a query never queues behind
        other calls for a connection. Queries have a pool of their own: a conductor answers
        them on its query lane until a connection carries another route (docs/architecture.md,
        "The query lane")."""
        pools = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60))
            for _ in range(2)
        ]
        return cls(pools[0], section, notices, pool, control=pools[1])

    async def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
        if self._loads is not None:
            await self._loads.close()
        await self._session.close()
        await self._control.close()

    def exposition(self) -> bytes:
        """How this router shares what it routed (a conductor service's own series are on
        its ``/metrics``)."""
        return generate_latest(self.replica_metrics.registry)

    def indexed_until(self, instance_id: str) -> float | None:
        """The conductor held everything the instance published up to this time (the
        engine's clock), as of its last answer; None: not known."""
        return self._indexed_until.get(instance_id)

    def _progress_turn(self, instances: list[str]) -> list[str]:
        """At most ``MAX_PROGRESS_OF`` of ``instances``, the next ones each time."""
        if len(instances) <= MAX_PROGRESS_OF:
            return instances
        start = next(self._progress_turns) * MAX_PROGRESS_OF % len(instances)
        return (instances[start:] + instances[:start])[:MAX_PROGRESS_OF]

    def _learn_progress(self, header: str | None) -> None:
        if header is None:
            return
        try:
            progress = json.loads(header)
        except ValueError:
            return
        if not isinstance(progress, dict):
            return
        for instance, until in progress.items():  # a time is a finite number, else unknown
            if type(until) in (int, float) and math.isfinite(until):
                self._indexed_until[instance] = float(until)

    def states(self) -> dict[str, ConductorState]:
        """Each conductor: ``down`` while its calls fail, else ``up``."""
        return {
            url: ConductorState.DOWN if self._notices.failing(url) else ConductorState.UP
            for url in self.urls
        }

    def degraded_reasons(self) -> list[str]:
        """Why no conductor can be asked, one line per conductor; empty while one has
        accepted the registrations and answers (until then requests are routed by load)."""
        sharing = self._routed.reasons() + (self._loads.route.reasons() if self._loads else [])
        if any(url in self._registered and not self._notices.failing(url) for url in self.urls):
            return sharing
        return [self._not_usable(url) for url in self.urls] + sharing

    def _not_usable(self, url: str) -> str:
        if url in self._registered:
            return f"conductor {url} does not answer"
        why = self._registration_errors.get(url, "registering")
        return f"conductor {url} has not accepted the registrations ({why})"

    async def _post(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        session = self._session if path in LANE_ROUTES else self._control
        async with session.post(
            url + path,
            data=msgpack.packb(body),
            headers=self._headers if headers is None else self._headers | headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            self._learn_progress(response.headers.get(INDEXED_UNTIL_HEADER))
            if path == "/query" and self._loads is not None and response.status == 200:
                self._loads.learn(
                    response.headers.get(LOADS_HEADER), response.headers.get(OTHERS_HEADER)
                )
            raw = await response.read()
            try:
                return response.status, msgpack.unpackb(raw)
            except Exception:
                return response.status, raw[:200]

    async def _ask(self, what: str, call: Callable[[str], Awaitable[T]]) -> T:
        """``call`` on the current conductor, failing over to the next; raises
        ConductorUnavailable when none answered."""
        reasons = []
        for step in range(len(self.urls)):
            index = (self._current + step) % len(self.urls)
            url = self.urls[index]
            try:
                answer = await call(url)
            except ConductorUnavailable as error:
                self._down(url, f"{what}: {error}")
                reasons.append(f"{url}: {error}")
                continue
            self._up(url)
            self._current = index
            return answer
        raise ConductorUnavailable("; ".join(reasons))

    def _down(self, url: str, reason: str) -> None:
        self._notices.fault(
            url, "conductor %s unavailable (%s): routing by load until it answers", url, reason
        )

    def _up(self, url: str) -> None:
        self._notices.recovered(url, "conductor %s answers again", url)

    # -- registrations -------------------------------------------------------------------
    async def register(self, models: Sequence[ModelSection]) -> bool:
        """Register every stream with every conductor (idempotent: a repeat answers 200),
        each retrying with backoff until it is up or the registration timeout ends. Logged
        at INFO when it changed something (a conductor registered anew), else at DEBUG; a
        conductor that cannot be reached at its first failure (once, then as a reminder).
        True when every conductor has every stream."""
        bodies = [body for model in models for body in registration_bodies(model)]
        results = await asyncio.gather(*(self._register_all(url, bodies) for url in self.urls))
        return all(results)

    async def _register_all(self, url: str, bodies: list[dict[str, Any]]) -> bool:
        deadline = time.monotonic() + self._section.registration_timeout_seconds
        try:
            for body in bodies:
                await self._register_one(url, body, deadline)
        except RegistrationRefused as error:
            self._registered.discard(url)
            self._registration_errors[url] = "refused"
            self._notices.fault(f"register {url}", "%s", error, level=logging.ERROR)
            return False
        except ConductorUnavailable:  # logged at its first failure (_register_one)
            self._registered.discard(url)
            return False
        self._registration_errors.pop(url, None)
        self._routed.retry(url)  # it answers: its next reports will say
        if self._loads is not None:
            self._loads.retry(url)
        self._notices.recovered(f"register {url}", "conductor %s accepts the registrations", url)
        self._up(url)
        level = logging.DEBUG if url in self._registered else logging.INFO
        log.log(level, "registered %d streams with conductor %s", len(bodies), url)
        self._registered.add(url)
        return True

    async def _register_one(self, url: str, body: dict[str, Any], deadline: float) -> None:
        delay = 0.1
        while True:
            try:
                status, answer = await self._post(url, "/register", body, timeout=2.0)
            except (aiohttp.ClientError, TimeoutError) as error:
                reason = self._registration_errors[url] = describe(error)
                self._down(url, f"registration: {reason}")
                if time.monotonic() + delay > deadline:
                    raise ConductorUnavailable(reason) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if status == 200:
                return
            raise RegistrationRefused(
                f"conductor {url} refused the registration of instance={body['instance_id']} "
                f"rank={body['dp_rank']} endpoint={body['endpoint']}: "
                f"{status} {answer_text(answer)}"
            )

    # -- dead engines ----------------------------------------------------------------------
    async def report_instance(
        self, instance_id: str, tenant_id: str, down: bool, ttl_s: float, reason: str
    ) -> None:
        """``/instance_down`` (for ``ttl_s``) or ``/instance_up`` to every conductor. Never
        raises: a failure is logged once per conductor and state, and the caller re-sends."""
        path = "/instance_down" if down else "/instance_up"
        body: dict[str, Any] = {"instance_id": instance_id, "tenant_id": tenant_id}
        if down:
            body.update(reason=reason, ttl_s=ttl_s)
        await asyncio.gather(*(self._report(url, path, body) for url in self.urls))

    async def _report(self, url: str, path: str, body: dict[str, Any]) -> None:
        key = f"{path} {url}"
        try:
            status, answer = await self._post(url, path, body, timeout=self._control_timeout())
        except (aiohttp.ClientError, TimeoutError) as error:
            status, answer = 0, describe(error)
        if status == 200 or status == 404:  # 404: not registered there, nothing to mark
            self._notices.recovered(key, "conductor %s takes %s again", url, path)
            return
        self._notices.fault(
            key, "conductor %s %s instance=%s failed: %s %s", url, path, body["instance_id"],
            status or "unreachable", answer_text(answer),
        )  # fmt: skip

    # -- routed prompts, for the other replicas ------------------------------------------
    def report_routed(self, prompt: PromptBlocks, instance_id: str) -> None:
        """Queue the report that ``prompt`` went to ``instance_id`` (``/routed`` on every
        conductor, in the background); never waits."""
        if not self._section.share_routed:
            return
        if len(self._reports) >= MAX_REPORTS_QUEUED:
            self._reports.popleft()
            self.replica_metrics.dropped.inc()
        self._reports.append((prompt, instance_id))
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.get_running_loop().create_task(self._send_reports())

    async def _send_reports(self) -> None:
        """Report the queued prompts, ``REPORTS_AT_ONCE`` at a time, until none is left."""
        while self._reports:
            batch = [
                self._reports.popleft() for _ in range(min(REPORTS_AT_ONCE, len(self._reports)))
            ]
            urls = self._routed.urls(self.urls)
            await asyncio.gather(
                *(self._send_report(url, *routed) for routed in batch for url in urls)
            )

    async def _send_report(self, url: str, prompt: PromptBlocks, instance_id: str) -> None:
        context = prompt.context
        body: dict[str, Any] = {
            "model": context.model,
            "block_size": context.block_size,
            "token_ids": prompt.packed,
            "tenant_id": context.tenant_id,
            "lora_name": context.lora_name,
            "instance_id": instance_id,
            "ttl_s": self._section.share_routed_ttl_seconds,
        }
        if prompt.cache_salt:
            body["cache_salt"] = prompt.cache_salt
        await self._routed.send(self._post, url, body, self._control_timeout())

    def _control_timeout(self) -> float:
        return max(self._section.query_timeout_seconds, 1.0)

    async def _post_within(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """``_post`` awaited for ``timeout``; past it TimeoutError, while the call goes on
        in the background (within the control timeout) and keeps its connection. A
        conductor that answers nothing at all would pile such calls up: past
        ``MAX_LATE_CALLS`` they are cut."""
        call = asyncio.ensure_future(self._post(url, path, body, self._control_timeout(), headers))
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(call)
        except TimeoutError:
            if len(self._late) >= MAX_LATE_CALLS:
                call.cancel()
            else:
                self._late.add(call)
            call.add_done_callback(self._forget_late)
            raise

    def _forget_late(self, call: asyncio.Future[Any]) -> None:
        """A late answer nobody waits for: its outcome, failure included, is dropped."""
        self._late.discard(call)
        if not call.cancelled():
            call.exception()

    # -- questions -------------------------------------------------------------------------
    async def store_states(self, timeout: float) -> dict[str, StoreState]:
        """Each Mooncake store's state as the conductor's ``/health`` reports it (``up``,
        ``down`` or ``unchecked``); raises ConductorUnavailable without an answer."""

        async def health(url: str) -> Any:
            try:
                async with self._control.get(
                    url + "/health",
                    headers=self._auth,  # answered in JSON
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as response:
                    return await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                raise ConductorUnavailable(f"health failed: {describe(error)}") from None

        return parse_store_states(await self._ask("health", health))

    async def hits(self, prompt: PromptBlocks, progress_of: Collection[str]) -> Hits:
        """``query`` with the prompt's packed ids: the conductor hashes them itself. With
        load sharing the query takes a decision lease, ``decided`` ends it."""
        if self._loads is not None:
            prompt.lease = self._loads.next_lease()
        return await self.query(
            prompt.packed, prompt.context, prompt.cache_salt, progress_of, prompt.lease
        )

    def decided(self, prompt: PromptBlocks) -> None:
        if self._loads is not None and prompt.lease is not None:
            self._loads.decided(prompt.lease)

    async def query(
        self,
        packed: bytes,
        context: IndexContext,
        cache_salt: str | None = None,
        progress_of: Collection[str] = (),
        lease: int | None = None,
    ) -> Hits:
        """Cumulative (GPU, CPU, DISK) hit in tokens per instance of ``context``;
        ``packed``: the prompt as ``token_bytes`` gives it (int32, wrapped as the conductor
        hashes them); ``progress_of``: instances whose indexing progress to learn too;
        ``lease``: the decision lease the query takes (with load sharing)."""
        body: dict[str, Any] = {
            "model": context.model,
            "block_size": context.block_size,
            "token_ids": packed,
            "tenant_id": context.tenant_id,
            "lora_name": context.lora_name,
        }
        if cache_salt:
            body["cache_salt"] = cache_salt
        headers = {HITS_ONLY_HEADER: "1"}  # instances left out have no hit (Go: all listed)
        if self._loads is not None:
            headers |= self._loads.query_headers(lease)
        if asked := self._progress_turn(list(progress_of)):
            headers[PROGRESS_HEADER] = json.dumps(asked)

        async def ask(url: str) -> Hits:
            try:
                status, answer = await self._post_within(
                    url, "/query", body, self._section.query_timeout_seconds, headers
                )
            except (aiohttp.ClientError, TimeoutError) as error:
                raise ConductorUnavailable(f"query failed: {describe(error)}") from None
            if status != 200 or not isinstance(answer, dict):
                raise ConductorUnavailable(f"query answered {status}: {answer_text(answer)}")
            return parse_hits(answer, context.tenant_id)

        return await self._ask("query", ask)


def registration_bodies(model: ModelSection) -> list[dict[str, Any]]:
    """The ``/register`` body of every event stream of the model's prefill instances (their
    events name the adapter of each block: the index keeps adapters apart itself)."""
    bodies = []
    for instance in model.instances:
        for stream in instance.registrations:
            body = {
                "endpoint": stream.endpoint,
                "replay_endpoint": stream.replay_endpoint,
                "type": stream.type,
                "modelname": model.modelname,
                "lora_name": model.lora_name,
                "tenant_id": model.tenant_id,
                "instance_id": instance.instance_id,
                "block_size": model.block_size,
                "dp_rank": stream.dp_rank,
            }
            if instance.kv_store:  # our extension: absent for the Go conductor's sake
                body["kv_store"] = instance.kv_store
            bodies.append(body)
    return bodies


def _tokens(entry: dict[str, Any], *keys: str) -> int:
    """The first of ``keys`` that holds a token count in range (0..int32 max)."""
    for key in keys:
        value = entry.get(key)
        if type(value) is int and 0 <= value <= MAX_TOKENS:
            return value
    return 0


def parse_hits(answer: dict[str, Any], tenant_id: str) -> Hits:
    """Both conductor answer shapes -> {instance: (gpu, cpu, disk)}; junk entries skipped."""
    instances = answer.get("instances")
    if not isinstance(instances, dict):
        instances = answer.get(tenant_id, {})
    hits: Hits = {}
    for name, entry in instances.items() if isinstance(instances, dict) else ():
        if isinstance(entry, dict):
            gpu = _tokens(entry, "GPU", "gpu")
            cpu = max(gpu, _tokens(entry, "CPU", "cpu"))
            disk = max(cpu, _tokens(entry, "DISK", "disk", "longest_matched"))
            hits[str(name)] = (gpu, cpu, disk)
    return hits


def parse_store_states(health: Any) -> dict[str, StoreState]:
    """``{master: state}`` from a ``/health`` answer's ``kv_stores``
    (``{master: {"blocks", "state", "checked_s_ago"}}``). A store without a state this
    router knows (an older conductor lists only block counts) is ``unchecked``."""
    stores = health.get("kv_stores") if isinstance(health, dict) else None
    states: dict[str, StoreState] = {}
    for master, entry in stores.items() if isinstance(stores, dict) else ():
        state = entry.get("state") if isinstance(entry, dict) else None
        states[str(master)] = _store_state(state)
    return states


def _store_state(value: Any) -> StoreState:
    """The state ``value`` names; ``unchecked`` for anything else."""
    try:
        return StoreState(value)
    except ValueError:
        return StoreState.UNCHECKED
