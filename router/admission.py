"""Admission: each key's and each model's limits, with bounded waiting in priority order
(docs/keys.md).

A request passes, in order: its key's request-rate bucket, its key's concurrency gate, then
its model's concurrency gate; once its prompt is tokenized its prompt tokens are charged to
its key's token bucket. The key's limits come first so that a key bursting past them waits
or is refused (429 with ``Retry-After``) before it can take the model's slots: the other
keys' requests find those free.

Waiting is bounded three ways: a key's waiting room (``max_queued``, every wait of the key's
counts: 0 refuses at once), a model's (``max_queued_requests``) and the key's
``max_queue_seconds`` for the whole admission. A rate wait longer than what is left of that
budget is refused at once, saying how long until the tokens are there. Waiters of a gate
are served by (priority, arrival); rate waits are reservations, served in arrival order. A
waiter that is cancelled (its client went away) leaves without holding anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .errors import ApiError
from .keys import ClientKey

QUEUE_SECONDS_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 1, 2.5, 5, 10, 30)
UNREGISTERED = "unregistered"  # the model label of requests for a model not registered


class RateLimited(ApiError):
    """A 429 (OpenAI's ``RateLimitError``) whose ``Retry-After`` says when to try again:
    whole seconds, rounded up, at least 1. ``reason``: ``concurrency``, ``request_rate``,
    ``token_rate`` (over the limit, no waiting allowed or a wait past the budget),
    ``queue_full``, ``queue_timeout`` or ``model_queue_full``; ``scope``: whose limit,
    ``key`` or ``model``."""

    def __init__(self, retry_after_s: float, reason: str, scope: str, message: str) -> None:
        self.retry_after_s, self.reason, self.scope = retry_after_s, reason, scope
        retry_after = max(1, math.ceil(retry_after_s))
        super().__init__(
            429,
            f"{message}: try again in {retry_after} s.",
            "RateLimitError",
            headers={"Retry-After": str(retry_after)},
        )


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up. A take larger than the level
    drives it below zero: the debt is repaid at ``rate`` before anyone's next take, so the
    long-run rate holds even for takes larger than ``burst`` (which wait for a full bucket
    rather than forever)."""

    def __init__(
        self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate, self.burst = rate, burst
        self._clock = clock
        self._level = burst
        self._at = clock()

    def level(self) -> float:
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def wait_for(self, n: float) -> float:
        """Seconds until ``n`` can be taken (``burst`` suffices for a larger ``n``)."""
        return max(0.0, (min(n, self.burst) - self.level()) / self.rate)

    def take(self, n: float) -> None:
        """Takes ``n`` now, into debt if need be: a reservation, once ``wait_for(n)``
        seconds have passed it is as if they were taken then."""
        self._level = self.level() - n

    def give_back(self, n: float) -> None:
        """Returns a reservation that was not used (its waiter left)."""
        self._level = min(self.burst, self.level() + n)


class WaitingRoom:
    """How many may wait at once (``None``: any number)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.count = 0

    def has_place(self) -> bool:
        return self.capacity is None or self.count < self.capacity

    @contextlib.contextmanager
    def place(self) -> Iterator[None]:
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


class PriorityGate:
    """At most ``limit`` holders (``None``: unlimited); the others wait, served by
    (priority, arrival). A released slot goes straight to the best waiter, so a newcomer
    never passes those waiting."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.in_use = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._live = 0  # waiters not yet served or gone (the heap also holds departed ones)
        self._arrivals = itertools.count()

    def try_take(self) -> bool:
        if self.limit is not None and (self.in_use >= self.limit or self._live):
            return False
        self.in_use += 1
        return True

    async def wait(self, priority: int, timeout: float) -> bool:
        """Waits at most ``timeout`` seconds for a slot: True when it holds one."""
        served: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._arrivals), served))
        self._live += 1
        try:
            async with asyncio.timeout(timeout):
                await served
        except TimeoutError:
            pass
        except BaseException:
            self._leave(served)
            raise
        if served.done() and not served.cancelled():
            return True  # served, even if the deadline came at the same moment
        self._leave(served)
        return False

    def release(self) -> None:
        while self._waiters:
            _, _, served = heapq.heappop(self._waiters)
            if not served.done():
                self._live -= 1
                served.set_result(None)  # the slot passes on: in_use stays
                return
        self.in_use -= 1

    def _leave(self, served: asyncio.Future[None]) -> None:
        """A waiter goes: a slot it was handed passes on; else it stops counting."""
        if served.done() and not served.cancelled():
            self.release()
            return
        served.cancel()
        self._live -= 1
        if len(self._waiters) > 2 * self._live + 16:  # drop the departed in one pass
            self._waiters = [w for w in self._waiters if not w[2].done()]
            heapq.heapify(self._waiters)


@dataclass(frozen=True)
class _Limit:
    """A limit a request may wait on, as a refusal names it: its reason with no waiting
    allowed, its reason with the waiting room full, whose limit (scope) and in words."""

    reason: str
    full_reason: str
    scope: str
    what: str


@dataclass(frozen=True)
class _Rate:
    """A key's rate: its bucket and how a refusal names it."""

    bucket: TokenBucket
    limit: _Limit


def _rate(
    key_id: str,
    reason: str,
    unit: str,
    rate: float | None,
    burst: float,
    clock: Callable[[], float],
) -> _Rate | None:
    if rate is None:
        return None
    what = f"Rate limit reached for key `{key_id}` on {unit} per second ({rate:g})"
    return _Rate(TokenBucket(rate, burst, clock), _Limit(reason, "queue_full", "key", what))


class _KeyState:
    """One key's gate, waiting room and rates, made once per key (and limits)."""

    def __init__(self, key: ClientKey, clock: Callable[[], float]) -> None:
        limits = self.limits = key.limits
        self.gate = PriorityGate(limits.max_concurrent)
        self.room = WaitingRoom(limits.max_queued)
        self.requests = _rate(
            key.id,
            "request_rate",
            "requests",
            limits.requests_per_second,
            limits.request_burst,
            clock,
        )
        self.tokens = _rate(
            key.id,
            "token_rate",
            "prompt tokens",
            limits.tokens_per_second,
            limits.token_burst,
            clock,
        )
        self.concurrency_limit = _Limit(
            "concurrency",
            "queue_full",
            "key",
            f"Too many concurrent requests for key `{key.id}` (limit {limits.max_concurrent})",
        )


class _ModelState:
    """One model's gate, waiting room and ``router_admission_queued`` series."""

    def __init__(
        self, name: str, max_concurrent: int | None, max_queued: int | None, queued: Gauge
    ) -> None:
        self.gate = PriorityGate(max_concurrent)
        self.room = WaitingRoom(max_queued)
        self.queued = queued
        self.limit = _Limit(
            "model_queue_full",
            "model_queue_full",
            "model",
            f"Too many concurrent requests for model `{name}` (limit {max_concurrent})",
        )


@dataclass(frozen=True)
class _Metrics:
    requests: Counter
    rejections: Counter
    queue_seconds: Histogram
    queued: Gauge

    def refused(self, refusal: RateLimited) -> None:
        self.rejections.labels(refusal.reason, refusal.scope).inc()


class Ticket:
    """An admitted request: it holds its key's and its model's slots until its ``admit``
    block ends. ``queued_seconds``: how long it waited in all, token charges included."""

    def __init__(
        self,
        key: _KeyState,
        model: _ModelState | None,
        queued: Gauge,
        priority: int,
        clock: Callable[[], float],
        metrics: _Metrics,
    ) -> None:
        self._key, self._model, self._priority = key, model, priority
        self._clock, self._metrics = clock, metrics
        self._deadline = 0.0  # of the waiting now going on: set as it starts
        self._queued_gauge = queued
        self._held: list[PriorityGate] = []
        self.queued_seconds = 0.0

    def remaining(self) -> float:
        """What is left of the key's budget (``max_queue_seconds`` of waiting in all)."""
        return max(0.0, self._deadline - self._clock())

    def _start_waiting(self) -> float:
        started = self._clock()
        self._deadline = started + self._key.limits.max_queue_seconds - self.queued_seconds
        return started

    async def charge_tokens(self, n: int) -> None:
        """Charges ``n`` prompt tokens to the key's token rate, waiting for them within the
        key's budget; past it raises ``RateLimited`` (``token_rate``)."""
        tokens = self._key.tokens
        if tokens is None or n <= 0:
            return
        started = self._start_waiting()
        try:
            await self._take_from(tokens, n)
        except RateLimited as refusal:
            self._metrics.refused(refusal)
            raise
        finally:
            self.queued_seconds += self._clock() - started

    async def enter(self) -> None:
        """Passes the key's request rate, the key's gate, the model's gate, in order; a
        refused or cancelled entry holds nothing and has taken no request from the rate."""
        key, started = self._key, self._start_waiting()
        try:
            if key.requests is not None:
                await self._take_from(key.requests, 1)
            try:
                await self._take_slot(key.gate, key.room, key.concurrency_limit)
                if self._model is not None:
                    await self._take_slot(self._model.gate, self._model.room, self._model.limit)
            except BaseException:
                self.release()
                if key.requests is not None:
                    key.requests.bucket.give_back(1)
                raise
        finally:
            self.queued_seconds = self._clock() - started

    def release(self) -> None:
        """Gives back every slot held, the model's first (idempotent)."""
        while self._held:
            self._held.pop().release()

    async def _take_from(self, rate: _Rate, n: int) -> None:
        """Takes ``n`` from the rate's bucket; when they are not there yet, waits for them
        in the key's waiting room if they are due within the budget."""
        bucket = rate.bucket
        wait = bucket.wait_for(n)
        if wait > 0:
            self._check_can_wait(self._key.room, rate.limit, wait, wait)
        bucket.take(n)
        if wait <= 0:
            return
        try:
            with self._key.room.place(), self._waiting():
                await asyncio.sleep(wait)
        except BaseException:
            bucket.give_back(n)
            raise

    async def _take_slot(self, gate: PriorityGate, room: WaitingRoom, limit: _Limit) -> None:
        if not gate.try_take():
            self._check_can_wait(room, limit, 0.0, 1.0)
            waited_from = self._clock()
            with room.place(), self._waiting():
                served = await gate.wait(self._priority, self.remaining())
            if not served:
                waited = self._clock() - waited_from
                what = f"{limit.what}; waited {waited:.1f} s, the most the key allows"
                raise RateLimited(1.0, "queue_timeout", limit.scope, what)
        self._held.append(gate)

    def _check_can_wait(
        self, room: WaitingRoom, limit: _Limit, wait: float, retry_after_s: float
    ) -> None:
        """Refuses a wait the key cannot afford: no room, a room full, or longer than the
        budget left (``wait``: how long it would be, when known)."""
        if room.capacity == 0 or wait > self.remaining() or self.remaining() <= 0:
            raise RateLimited(retry_after_s, limit.reason, limit.scope, limit.what)
        if not room.has_place():
            what = f"{limit.what}, and {room.capacity} requests wait already"
            raise RateLimited(retry_after_s, limit.full_reason, limit.scope, what)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        self._queued_gauge.inc()
        try:
            yield
        finally:
            self._queued_gauge.dec()


class Admission:
    """Every key's and model's limits, for the requests of one router.

    ``admit`` is the way in. Models are registered by name with their limits; requests for
    a name not registered pass no model gate and are labelled ``unregistered`` in the
    metrics (a client's model name never becomes a label). A key's state is looked up by
    its id in O(1); after a reload that changes a key's limits, the new ones count from its
    next request.
    """

    def __init__(
        self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._models: dict[str, _ModelState] = {}
        self._series: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._metrics = _Metrics(
            Counter(
                "router_admission_requests",
                "Admission decisions by key id, model and outcome (admitted, rejected); a "
                "request refused later for its prompt tokens counts in the rejections only",
                ["key", "model", "outcome"],
                registry=registry,
            ),
            Counter(
                "router_admission_rejections",
                "429s of the key and model limits, by reason and scope (key, model)",
                ["reason", "scope"],
                registry=registry,
            ),
            Histogram(
                "router_admission_queue_seconds",
                "How long admitted requests waited for their key's and model's limits",
                ["key", "model"],
                buckets=QUEUE_SECONDS_BUCKETS,
                registry=registry,
            ),
            Gauge(
                "router_admission_queued",
                "Requests waiting for admission now, by model",
                ["model"],
                registry=registry,
            ),
        )

    def register_model(
        self,
        name: str,
        max_concurrent_requests: int | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        """A served model's limits (``None``: unlimited), for requests naming it."""
        queued = self._metrics.queued.labels(name)
        self._models[name] = _ModelState(name, max_concurrent_requests, max_queued_requests, queued)

    @contextlib.asynccontextmanager
    async def admit(self, key: ClientKey, model: str, priority: int) -> AsyncIterator[Ticket]:
        """Waits for the request's turn or raises ``RateLimited``; the request holds its
        slots for the block: ``async with admission.admit(key, model, priority) as t:``."""
        model_state = self._models.get(model)
        if model_state is not None:
            label, queued = model, model_state.queued
        else:
            label = UNREGISTERED
            queued = self._metrics.queued.labels(label)
        ticket = Ticket(
            self._key_state(key), model_state, queued, priority, self._clock, self._metrics
        )
        try:
            await ticket.enter()
        except RateLimited as refusal:
            self._metrics.requests.labels(key.id, label, "rejected").inc()
            self._metrics.refused(refusal)
            raise
        admitted, queue_seconds = self._admitted_series(key.id, label)
        admitted.inc()
        queue_seconds.observe(ticket.queued_seconds)
        try:
            yield ticket
        finally:
            ticket.release()

    def _admitted_series(self, key_id: str, model: str) -> tuple[Counter, Histogram]:
        """The key's and model's admitted count and queue time, each looked up once:
        ``labels()`` costs a third of an admission (``bench.gateway_overhead``)."""
        series = self._series.get((key_id, model))
        if series is None:
            metrics = self._metrics
            series = self._series[(key_id, model)] = (
                metrics.requests.labels(key_id, model, "admitted"),
                metrics.queue_seconds.labels(key_id, model),
            )
        return series

    def _key_state(self, key: ClientKey) -> _KeyState:
        """The key's state; new for a new key or new limits."""
        state = self._keys.get(key.id)
        if state is None or state.limits != key.limits:
            state = self._keys[key.id] = _KeyState(key, self._clock)
        return state
