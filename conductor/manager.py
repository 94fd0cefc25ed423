"""Registrations <-> subscribers <-> index: the one place that changes who is indexed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import time
from bisect import insort
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import zmq
import zmq.asyncio

from ._native import PackedBatch
from .config import Registration
from .hash_profile import HashProfile
from .index import ApplyStats, ContextKey, PrefixCacheTable, count_packed
from .ingest_thread import Applied, IngestLane
from .kv_store_watch import StoreWatch
from .metrics import ConductorMetrics
from .runtime import LoopShare
from .states import SubscriberState, TaskState
from .stream_limits import StreamLimits
from .subscriber import StreamCallbacks, StreamSubscriber
from .wire import DecodeError, EventBatch, Message, decode_batch, pack_batch

log = logging.getLogger(__name__)


def _owner(registration: Registration) -> tuple[str, str]:
    """The (instance, tenant) a stream belongs to, as /instance_down names it."""
    return registration.source().instance_id, registration.tenant_id


def _profile_text(registration: Registration) -> str:
    profile = registration.hash_profile
    return profile.describe() if profile is not None else "none"


# a stream's ZMQ sockets: SUB, the monitor's PAIR pair (libzmq opens one of them), a DEALER
SOCKETS_PER_STREAM = 3
SOCKETS_PER_REPLAY = 1
# and file descriptors: a mailbox per socket, a TCP connection per SUB and DEALER
FDS_PER_STREAM = 4
FDS_PER_REPLAY = 2


class RegistrationConflict(Exception):
    """The key or the endpoint is already registered with a different configuration."""


class RegistrationFailed(Exception):
    """ZMQ refused the endpoint (malformed address, unknown host)."""


class CapacityExceeded(Exception):
    """One more stream would pass a socket or file-descriptor limit (the API says 503)."""


class ServiceNotFound(KeyError):
    pass


@dataclass(slots=True)
class DownMark:
    """An instance the router reported dead: its streams drop events until ``until``."""

    reason: str
    until: float  # time.time()
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (each stream needs descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as error:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, error)
    return soft


_EVENT_COUNTERS = {
    "gap": "gaps",
    "gap_unrepaired": "gaps_unrepaired",
    "replay_requested": "replays_requested",
    "replay_failed": "replays_failed",
    "restart": "restarts",
    "lost": "publishers_lost",
}
CAPPED_REASONS = ("dp_rank_limit", "lora_limit")
EVENTS_PER_CLOCK_READ = 4  # decoded events applied between two looks at a step's time
BLOCKS_PER_CLOCK_READ = 512  # the same for the C lane (by blocks: an event may hold 10,000)
QUERIED_BLOCKS_PER_CLOCK_READ = 64  # ... while queries come (LoopShare.queried): ~50 µs


class ServiceManager:
    def __init__(
        self,
        table: PrefixCacheTable,
        metrics: ConductorMetrics,
        stores: StoreWatch,
        limits: StreamLimits | None = None,
        ingest_thread: bool = False,
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.stores = stores  # checks each kv_store a registration names
        self.limits = limits or StreamLimits()
        table.max_dp_ranks = self.limits.max_dp_ranks
        table.max_lora_contexts = self.limits.max_lora_contexts
        self.registrations: dict[str, Registration] = {}
        # service key -> why its stream is not indexed as registered (shown by /health)
        self.degraded: dict[str, str] = {}
        # (instance, tenant) -> its stream keys, sorted (a query may ask about dozens)
        self._streams_of: dict[tuple[str, str], list[str]] = {}
        # stream -> the publish time of the latest batch applied from it (engine clock)
        self._applied_until: dict[str, float] = {}
        self._subscribers: dict[str, StreamSubscriber] = {}
        self._down: dict[tuple[str, str], DownMark] = {}  # (instance, tenant) -> mark
        self._capped: set[tuple[str, str]] = set()  # (stream, reason) warned about once
        self._expiring: set[asyncio.Task[None]] = set()  # marks ending (tasks kept alive)
        self.fd_limit = raise_fd_limit()
        self._fd_baseline = psutil.Process().num_fds()  # before any stream
        self.context = zmq.asyncio.Context()
        self.loop_share = LoopShare()  # every stream's batches take turns, one step per round
        self.context.set(zmq.MAX_SOCKETS, self.limits.max_sockets)
        self._lock = asyncio.Lock()
        # batches are applied only while it is set: a snapshot or a recovery closes it
        self.ingest_gate = asyncio.Event()
        self.ingest_gate.set()
        self._applying = 0  # batches being applied (in steps) right now
        # the C lane's batches applied beside the loop (conductor.ingest_thread), made at
        # the first; off (the default): the loop applies them in steps
        self.ingest_thread = ingest_thread
        self._lane: IngestLane | None = None
        # service key -> the batches a resumed stream's publisher no longer held (/health)
        self.resume_gaps: dict[str, str] = {}

    def state_of(self, key: str) -> SubscriberState:
        subscriber = self._subscribers.get(key)
        return subscriber.state if subscriber else SubscriberState.STOPPED

    def stream_view(self, key: str) -> dict[str, Any]:
        """What /services and /health show of a stream: its state, its task failures (the
        last one's error) and, while its instance is marked down, until when and why."""
        subscriber = self._subscribers.get(key)
        if subscriber is None:
            return {"state": SubscriberState.STOPPED, "failures": 0, "last_error": ""}
        tasks = subscriber.supervised()
        view: dict[str, Any] = {
            "state": subscriber.state,
            "failures": sum(task.restarts for task in tasks),
            "last_error": next((t.last_error for t in tasks if t.state is TaskState.FAILED), ""),
        }
        registration = self.registrations[key]
        mark = self._down.get(_owner(registration))
        if mark is not None:
            view["down_until"] = mark.until
            view["down_reason"] = mark.reason
        return view

    async def register(self, registration: Registration, resume_after: int | None = None) -> bool:
        """Start indexing a stream; False when the identical registration already exists.
        ``resume_after``: the index holds its batches up to this one (a snapshot's), so its
        catch-up replays from the next one."""
        key = registration.key
        async with self._lock:
            existing = self.registrations.get(key)
            if existing is not None:
                if existing == registration:
                    return False
                raise RegistrationConflict(
                    f"service {key} is already registered with a different configuration"
                )
            for other in self.registrations.values():
                if other.endpoint == registration.endpoint:
                    raise RegistrationConflict(
                        f"endpoint {registration.endpoint} is already registered as {other.key}"
                    )
            self._check_profile(registration)
            self._check_capacity(registration)
            subscriber = StreamSubscriber(
                self.context,
                key,
                registration.endpoint,
                registration.replay_endpoint,
                self._callbacks(registration),
                self.limits,
                self.metrics.stream_task_failures,
                self.loop_share,
                first_sequence=registration.first_sequence,
                resume_after=resume_after,
                gate=self.ingest_gate,
            )
            self.table.add_stream(registration.source())
            try:
                subscriber.start()
            except zmq.ZMQError as error:
                self.table.remove_stream(key)
                self.metrics.forget_stream(key)
                raise RegistrationFailed(f"cannot subscribe to {key}: {error}") from None
            self.registrations[key] = registration
            insort(self._streams_of.setdefault(_owner(registration), []), key)
            self._subscribers[key] = subscriber
            if _owner(registration) in self._down:
                await subscriber.mark_down()
            if registration.kv_store:
                self.stores.watch(registration.kv_store)
            self.metrics.services.set(len(self.registrations))
            log.info(
                "registered stream=%s endpoint=%s replay=%s type=%s",
                key,
                registration.endpoint,
                registration.replay_endpoint or "-",
                registration.type,
            )
            return True

    def _check_profile(self, registration: Registration) -> None:
        """One context, one hash profile (none is a profile too): its registrations must
        agree, as upstream's C++ conductor binds a context to the first one's profile."""
        context = registration.context_key()
        for other in self.registrations.values():
            if other.context_key() == context and other.hash_profile != registration.hash_profile:
                raise RegistrationConflict(
                    f"{registration.key} has hash profile {_profile_text(registration)}, but "
                    f"its context (model={context.model_name} lora_name={context.lora_name!r} "
                    f"block_size={context.block_size} tenant_id={context.tenant_id}) is "
                    f"registered with {_profile_text(other)} by {other.key}"
                )

    def context_profiles(self) -> dict[ContextKey, HashProfile | None]:
        """The hash profile of each registered context (its registrations agree)."""
        return {r.context_key(): r.hash_profile for r in self.registrations.values()}

    def _check_capacity(self, registration: Registration) -> None:
        """Refuse a stream that would pass the context's sockets or the process's file
        descriptors: reaching either later would break streams that work now."""
        replay = bool(registration.replay_endpoint)
        sockets = SOCKETS_PER_STREAM + SOCKETS_PER_REPLAY * replay
        used = sum(
            SOCKETS_PER_STREAM + SOCKETS_PER_REPLAY * bool(r.replay_endpoint)
            for r in self.registrations.values()
        )
        count = len(self.registrations)
        if used + sockets > self.limits.max_sockets:
            raise CapacityExceeded(
                f"cannot register {registration.key}: {count} registrations use {used} of the "
                f"{self.limits.max_sockets} ZMQ sockets (max_sockets) and it needs {sockets}; "
                "raise max_sockets or unregister streams"
            )
        fds = FDS_PER_STREAM + FDS_PER_REPLAY * replay
        estimate = self._fd_baseline + sum(
            FDS_PER_STREAM + FDS_PER_REPLAY * bool(r.replay_endpoint)
            for r in self.registrations.values()
        )
        if estimate + fds + 2 * self.limits.reserved_fds <= self.fd_limit:
            return  # far from the limit: listing /proc/self/fd (ms at 1,000 streams) can wait
        open_fds = psutil.Process().num_fds()
        if open_fds + fds + self.limits.reserved_fds > self.fd_limit:
            raise CapacityExceeded(
                f"cannot register {registration.key}: {count} registrations and the service "
                f"hold {open_fds} of the {self.fd_limit} file descriptors (RLIMIT_NOFILE) and "
                f"it needs {fds} while {self.limits.reserved_fds} stay free (reserved_fds); "
                "raise the hard limit (ulimit -Hn, LimitNOFILE=) or unregister streams"
            )

    async def unregister(self, key: str) -> int:
        """Stop the stream and drop its owners' blocks; returns how many were dropped."""
        async with self._lock:
            if key not in self.registrations:
                raise ServiceNotFound(key)
            subscriber = self._subscribers.pop(key)
            registration = self.registrations.pop(key)
            kv_store = registration.kv_store
            streams = self._streams_of[_owner(registration)]
            streams.remove(key)
            if not streams:
                del self._streams_of[_owner(registration)]
            self.degraded.pop(key, None)
            self.resume_gaps.pop(key, None)
            self._applied_until.pop(key, None)
            self._capped -= {(key, reason) for reason in CAPPED_REASONS}
            await subscriber.stop()
            dropped = self.table.remove_stream(key)
            if kv_store and all(r.kv_store != kv_store for r in self.registrations.values()):
                await self.stores.forget(kv_store)
            self.metrics.forget_stream(key)
            self.metrics.services.set(len(self.registrations))
            log.info("unregistered stream=%s blocks_dropped=%d", key, dropped)
            return dropped

    def applied_sequences(self) -> dict[str, int]:
        """Each stream's last applied batch (streams that applied none are left out)."""
        sequences = {key: s.applied_sequence for key, s in self._subscribers.items()}
        return {key: seq for key, seq in sequences.items() if seq is not None}

    @contextlib.asynccontextmanager
    async def ingest_paused(self, timeout_s: float) -> AsyncIterator[None]:
        """No batch is applied inside: new ones wait, the ones being applied finish first
        (within ``timeout_s``, else TimeoutError), so the index and ``applied_sequences``
        agree. Queries go on."""
        self.ingest_gate.clear()
        try:
            async with asyncio.timeout(timeout_s):
                while self._applying:
                    await asyncio.sleep(0.001)
            yield
        finally:
            self.ingest_gate.set()

    def indexed_until(self, instance_id: str, tenant_id: str) -> float | None:
        """The index holds everything the instance published up to this time (its engine's
        clock): the publish time of the latest batch applied from each of its streams, the
        oldest of them (events of a stream are applied in order). None: some stream has
        applied nothing yet, or the instance has none."""
        times = [
            self._applied_until.get(k) for k in self._streams_of.get((instance_id, tenant_id), ())
        ]
        if not times or None in times:
            return None
        return min(t for t in times if t is not None)

    # -- dead instances ------------------------------------------------------------------
    def _instance_streams(self, instance_id: str, tenant_id: str) -> list[str]:
        streams = self._streams_of.get((instance_id, tenant_id))
        if not streams:
            raise ServiceNotFound(instance_id)
        return list(streams)  # a copy: the caller awaits while registrations may change

    async def instance_down(
        self, instance_id: str, tenant_id: str = "default", reason: str = "", ttl_s: float = 60.0
    ) -> tuple[list[str], int]:
        """Stop counting every stream (DP rank) of an instance the router saw die, for
        ``ttl_s`` (a repeat extends it). Returns the streams and the blocks dropped."""
        async with self._lock:
            streams = self._instance_streams(instance_id, tenant_id)
            dropped = await self._mark_down((instance_id, tenant_id), reason, ttl_s, streams)
        return streams, dropped

    async def _mark_down(
        self, instance: tuple[str, str], reason: str, ttl_s: float, streams: list[str]
    ) -> int:
        instance_id, tenant_id = instance
        mark = self._down.get(instance)
        if mark is not None and mark.timer is not None:
            mark.timer.cancel()
        else:
            log.warning(
                "instance_id=%s tenant_id=%s marked down for %.0fs: %s",
                instance_id,
                tenant_id,
                ttl_s,
                reason or "no reason given",
            )
        loop = asyncio.get_running_loop()
        timer = loop.call_later(ttl_s, self._expire, instance)
        self._down[instance] = DownMark(reason, time.time() + ttl_s, timer)
        dropped = 0
        for key in streams:
            dropped += self.table.clear_stream(key)
            await self._subscribers[key].mark_down()
        return dropped

    async def instance_up(self, instance_id: str, tenant_id: str = "default") -> list[str]:
        """Count the instance again: its streams catch up from their replay buffers now."""
        async with self._lock:
            streams = self._instance_streams(instance_id, tenant_id)
            mark = self._down.pop((instance_id, tenant_id), None)
            if mark is not None:
                if mark.timer is not None:
                    mark.timer.cancel()
                log.warning("instance_id=%s tenant_id=%s marked up", instance_id, tenant_id)
            for key in streams:
                await self._subscribers[key].mark_up()
        return streams

    def _expire(self, instance: tuple[str, str]) -> None:
        """A mark the router stopped renewing ends like an instance_up."""
        mark = self._down.get(instance)
        if mark is not None:
            mark.timer = None  # it fired
        task = asyncio.create_task(self._expire_mark(*instance), name="instance-up")
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    async def _expire_mark(self, instance_id: str, tenant_id: str) -> None:
        try:
            await self.instance_up(instance_id, tenant_id)
        except ServiceNotFound:  # every stream of it was unregistered meanwhile
            self._down.pop((instance_id, tenant_id), None)

    async def close(self) -> None:
        for mark in self._down.values():
            if mark.timer is not None:
                mark.timer.cancel()
        await self.stores.close()
        await asyncio.gather(*(s.stop() for s in self._subscribers.values()))
        self._subscribers.clear()
        if self._lane is not None:
            self.loop_share.on_answering = None
            self._lane.close()
            self._lane = None
        self.context.destroy(linger=0)  # term() would wait forever for a socket left open

    # -- ingestion -----------------------------------------------------------------------
    def _callbacks(self, registration: Registration) -> StreamCallbacks:
        metrics = self.metrics
        key = registration.key

        def on_message(message: Message, replayed: bool) -> Iterator[asyncio.Future[None] | None]:
            return self._ingest(registration, message, replayed)

        def on_restart() -> None:
            self.table.clear_stream(key)
            self.degraded.pop(key, None)  # a restarted engine may have been reconfigured
            self.resume_gaps.pop(key, None)  # its blocks are gone, the gap's with them

        def on_lost() -> None:  # the same engine may come back: it stays degraded
            self.table.clear_stream(key)
            self.resume_gaps.pop(key, None)

        def on_state(state: SubscriberState) -> None:
            metrics.set_subscriber_state(key, state)

        def on_event(name: str) -> None:
            if name == "bad_frame":
                metrics.streams.inc("decode_errors", key, label="frame")
            else:
                metrics.streams.inc(_EVENT_COUNTERS[name], key)

        def on_resume_gap(expected: int, first: int) -> None:
            self.resume_gaps[key] = (
                f"resumed at seq {expected} but the publisher's buffer starts at {first}: "
                f"{first - expected} batches not indexed"
            )

        def on_dropped(message: Message) -> None:
            try:
                events = len(decode_batch(message.payload, message.topic).events)
            except DecodeError:
                events = 0
            metrics.streams.inc("dropped", key, events, "instance_down")

        return StreamCallbacks(
            on_message, on_restart, on_state, on_event, on_lost, on_dropped, on_resume_gap
        )

    def _ingest(
        self, registration: Registration, message: Message, replayed: bool
    ) -> Iterator[asyncio.Future[None] | None]:
        """Apply one batch in steps of about ``loop_share.step_now()``, yielding between them:
        a query waits for one step, not for a whole batch of hundreds of blocks (and may
        see part of a batch, as if it had come a moment earlier). The stream's batches stay
        in order: its reader awaits every step.

        The C lane takes the batch if it can; what it does not take (the batch, or the
        rest of it once the stream's state leaves what the lane covers) is decoded. With
        the ingest thread the lane's batch is given there whole, and applied while the
        stream reads on; a step yields a future to wait for only while the thread's
        backlog is full."""
        self._applying += 1
        try:
            yield from self._apply_batch(registration, message, replayed)
        finally:
            self._applying -= 1

    def _apply_batch(
        self, registration: Registration, message: Message, replayed: bool
    ) -> Iterator[asyncio.Future[None] | None]:
        key = registration.key
        stats = ApplyStats()
        applied: int | None = 0
        packed = None
        if self.table.lane_takes(key):
            packed = pack_batch(message.payload, message.topic, registration.block_size)
        lane = (
            None if packed is None else self._give_thread(registration, message, replayed, packed)
        )
        if lane is not None:
            if lane.full:
                yield lane.room()
            return
        if packed is not None:

            def apply_packed(start: int) -> int | None:
                blocks = (
                    QUERIED_BLOCKS_PER_CLOCK_READ
                    if self.loop_share.queried
                    else BLOCKS_PER_CLOCK_READ
                )
                return self.table.apply_packed(key, packed, start, stats, blocks)

            applied = yield from self._in_steps(key, message, len(packed), apply_packed)
            timestamp = packed.timestamp
        if packed is None or applied is not None and applied < len(packed):
            batch = self._decode(key, message)
            if batch is None:
                return
            self.metrics.decoded_batches.inc()

            def apply_events(start: int) -> int:
                stop = start + EVENTS_PER_CLOCK_READ
                self.table.apply_events(key, batch.events[start:stop], batch.dp_rank, stats)
                return min(stop, len(batch.events))

            applied = yield from self._in_steps(
                key, message, len(batch.events), apply_events, applied or 0
            )
            timestamp = batch.timestamp
        if applied is not None:
            self._count_batch(registration, stats, replayed, timestamp)

    def _count_batch(
        self, registration: Registration, stats: ApplyStats, replayed: bool, timestamp: float
    ) -> None:
        """What an applied batch did, into the metrics, the stream's progress and warnings."""
        key = registration.key
        self.metrics.record_apply(key, stats, replayed)
        # a publisher's clock, not ours: an infinite or NaN time says nothing of progress
        if math.isfinite(timestamp) and timestamp > self._applied_until.get(key, 0):
            self._applied_until[key] = timestamp
        if stats.foreign_block_size is not None:
            self._flag_block_size(registration, stats.foreign_block_size)
        for reason in CAPPED_REASONS:
            if reason in stats.dropped and (key, reason) not in self._capped:
                self._capped.add((key, reason))
                log.warning(
                    "stream=%s drops events beyond its %s (max_dp_ranks=%d, "
                    "max_lora_contexts=%d); counted in conductor_dropped_events_total",
                    key,
                    reason,
                    self.limits.max_dp_ranks,
                    self.limits.max_lora_contexts,
                )

    def _give_thread(
        self, registration: Registration, message: Message, replayed: bool, packed: PackedBatch
    ) -> IngestLane | None:
        """Give the packed batch to the ingest thread (made at the first), counted once it
        is applied; returns the thread's lane, or None, nothing given, when the thread is
        off or the lane does not take the batch. The stream reads its next batch meanwhile."""
        if not self.ingest_thread:
            return None
        lane = self._lane
        if lane is None:
            lane = self._lane = IngestLane()
            self.loop_share.on_answering = lane.pause
        key, stats = registration.key, ApplyStats()

        def on_applied(answer: Applied | BaseException) -> None:
            self._applying -= 1
            if self.registrations.get(key) is not registration:
                return  # unregistered meanwhile: nothing left to count
            if isinstance(answer, BaseException):
                self._apply_failed(key, message, answer)
            else:
                count_packed(stats, 0, answer)
                self._count_batch(registration, stats, replayed, packed.timestamp)

        if not self.table.submit_packed(key, packed, lane, on_applied):
            return None
        self._applying += 1  # until applied: a snapshot waits for it (ingest_paused)
        return lane

    def _apply_failed(self, key: str, message: Message, error: BaseException) -> None:
        """A bug costs one batch, counted and logged, never the stream's reader task."""
        self.metrics.streams.inc("decode_errors", key, label="apply")
        log.error("stream=%s seq=%d batch could not be applied", key, message.seq, exc_info=error)

    def _decode(self, key: str, message: Message) -> EventBatch | None:
        """The batch decoded, its rejected events counted; None (counted) if undecodable."""
        try:
            batch = decode_batch(message.payload, message.topic)
        except DecodeError as error:
            self.metrics.streams.inc("decode_errors", key, label="batch")
            log.warning("stream=%s seq=%d undecodable batch: %s", key, message.seq, error)
            return None
        if batch.rejected:
            self.metrics.streams.inc("decode_errors", key, len(batch.rejected), "event")
            log.warning("stream=%s seq=%d skipped %s", key, message.seq, "; ".join(batch.rejected))
        return batch

    def _in_steps(
        self,
        key: str,
        message: Message,
        count: int,
        apply: Callable[[int], int | None],
        start: int = 0,
    ) -> Generator[None, None, int | None]:
        """Apply events [start, count): ``apply(position)`` applies some from ``position``
        on and returns where it stopped (None: it declined, nothing applied); a yield
        whenever a step has taken ``loop_share.step_now()``. Returns where the events stopped
        being applied (``count``: all of them), or None when ``apply`` raised: a bug must
        cost one batch, never the stream's reader task."""
        step_began, step_s = time.perf_counter(), self.loop_share.step_now()
        position = start
        while position < count:
            if position > start and time.perf_counter() - step_began >= step_s:
                yield
                step_began, step_s = time.perf_counter(), self.loop_share.step_now()
            try:
                reached = apply(position)
            except Exception as error:
                self._apply_failed(key, message, error)
                return None
            if reached is None:
                return position
            position = reached
        return count

    def _flag_block_size(self, registration: Registration, carried: int) -> None:
        """Warn once per stream: every stored block of it is dropped, so queries never hit
        that instance, which without this would only show as one counter among many."""
        key = registration.key
        if key in self.degraded:
            return
        reason = (
            f"block_size_mismatch: registered {registration.block_size}, events carry {carried}"
        )
        self.degraded[key] = reason
        log.warning(
            "stream=%s instance_id=%s dp_rank=%d endpoint=%s degraded: %s; "
            "its blocks are not indexed until it is registered with the engine's block size",
            key,
            registration.instance_id or registration.endpoint,
            registration.dp_rank,
            registration.endpoint,
            reason,
        )
