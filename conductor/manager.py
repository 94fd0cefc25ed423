"""Registrations <-> subscribers <-> index: the one place that changes who is indexed."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from .config import Registration
from .index import PrefixCacheTable
from .kv_store_watch import StoreWatch
from .metrics import ConductorMetrics
from .subscriber import StreamCallbacks, StreamSubscriber
from .wire import DecodeError, Message, decode_batch

log = logging.getLogger(__name__)


class RegistrationConflict(Exception):
    """The key or the endpoint is already registered with a different configuration."""


class RegistrationFailed(Exception):
    """ZMQ refused the endpoint (malformed address, unknown host)."""


class ServiceNotFound(KeyError):
    pass


_EVENT_COUNTERS = {
    "gap": "gaps",
    "gap_unrepaired": "gaps_unrepaired",
    "replay_requested": "replays_requested",
    "replay_failed": "replays_failed",
    "restart": "restarts",
    "lost": "publishers_lost",
}


class ServiceManager:
    def __init__(
        self,
        table: PrefixCacheTable,
        metrics: ConductorMetrics,
        stores: StoreWatch,
        replay_timeout: float = 2.0,
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.stores = stores  # checks each kv_store a registration names
        self.registrations: dict[str, Registration] = {}
        # service key -> why its stream is not indexed as registered (shown by /health)
        self.degraded: dict[str, str] = {}
        self._subscribers: dict[str, StreamSubscriber] = {}
        self._context = zmq.asyncio.Context()
        self._replay_timeout = replay_timeout
        self._lock = asyncio.Lock()

    def state_of(self, key: str) -> str:
        subscriber = self._subscribers.get(key)
        return subscriber.state if subscriber else "stopped"

    async def register(self, registration: Registration) -> bool:
        """Start indexing a stream; False when the identical registration already exists."""
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
            subscriber = StreamSubscriber(
                self._context,
                key,
                registration.endpoint,
                registration.replay_endpoint,
                self._callbacks(registration),
                first_sequence=registration.first_sequence,
                replay_timeout=self._replay_timeout,
            )
            self.table.add_stream(registration.source())
            try:
                subscriber.start()
            except zmq.ZMQError as error:
                self.table.remove_stream(key)
                self.metrics.forget_stream(key)
                raise RegistrationFailed(f"cannot subscribe to {key}: {error}") from None
            self.registrations[key] = registration
            self._subscribers[key] = subscriber
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

    async def unregister(self, key: str) -> int:
        """Stop the stream and drop its owners' blocks; returns how many were dropped."""
        async with self._lock:
            if key not in self.registrations:
                raise ServiceNotFound(key)
            subscriber = self._subscribers.pop(key)
            kv_store = self.registrations.pop(key).kv_store
            self.degraded.pop(key, None)
            await subscriber.stop()
            dropped = self.table.remove_stream(key)
            if kv_store and all(r.kv_store != kv_store for r in self.registrations.values()):
                await self.stores.forget(kv_store)
            self.metrics.forget_stream(key)
            self.metrics.services.set(len(self.registrations))
            log.info("unregistered stream=%s blocks_dropped=%d", key, dropped)
            return dropped

    async def close(self) -> None:
        await self.stores.close()
        await asyncio.gather(*(s.stop() for s in self._subscribers.values()))
        self._subscribers.clear()
        self._context.term()

    # -- ingestion -----------------------------------------------------------------------
    def _callbacks(self, registration: Registration) -> StreamCallbacks:
        metrics = self.metrics
        key = registration.key

        def on_message(message: Message, replayed: bool) -> None:
            self._ingest(registration, message, replayed)

        def on_restart() -> None:
            self.table.clear_stream(key)
            self.degraded.pop(key, None)  # a restarted engine may have been reconfigured

        def on_lost() -> None:  # the same engine may come back: it stays degraded
            self.table.clear_stream(key)

        def on_state(state: str) -> None:
            metrics.subscriber_state.labels(key).state(state)

        def on_event(name: str) -> None:
            if name == "bad_frame":
                metrics.decode_errors.labels(key, "frame").inc()
            else:
                getattr(metrics, _EVENT_COUNTERS[name]).labels(key).inc()

        return StreamCallbacks(on_message, on_restart, on_state, on_event, on_lost)

    def _ingest(self, registration: Registration, message: Message, replayed: bool) -> None:
        """Decode and apply one batch synchronously: no await between its events."""
        key = registration.key
        try:
            batch = decode_batch(message.payload, message.topic)
        except DecodeError as error:
            self.metrics.decode_errors.labels(key, "batch").inc()
            log.warning("stream=%s seq=%d undecodable batch: %s", key, message.seq, error)
            return
        if batch.rejected:
            self.metrics.decode_errors.labels(key, "event").inc(len(batch.rejected))
            log.warning("stream=%s seq=%d skipped %s", key, message.seq, "; ".join(batch.rejected))
        try:
            stats = self.table.apply(key, batch)
        except Exception:  # a bug must cost one batch, never the stream's reader task
            self.metrics.decode_errors.labels(key, "apply").inc()
            log.exception("stream=%s seq=%d batch could not be applied", key, message.seq)
            return
        self.metrics.record_apply(key, stats, replayed)
        if stats.foreign_block_size is not None:
            self._flag_block_size(registration, stats.foreign_block_size)

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
