"""The simulator's engine loop: runs the pure ``Scheduler`` in real time.

``EngineLoop`` is the asyncio shell around ``scheduler.Scheduler``: it runs ``plan_step``,
sleeps the step's duration times ``time_scale`` (so tests and demos run the same schedule
faster), applies the step, wakes the requests' token streams and publishes the step's KV
events as one batch, as vLLM does. With a KV connector (``store_tier.StoreTier``) a request
is looked up and loaded from the store before it is queued, and its prompt saved after its
prefill, announced in a batch of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from ..encoding import WireEvent
from .block_manager import BlockManager
from .scheduler import EngineRequest, Scheduler, StepPlan

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request the engine rejected (finish_reason "error": it can never fit the pool) or
    dropped (finish_reason "abort": shutdown)."""


class RequestStream:
    """A request's generated token ids as an async iterator, fed by ``EngineLoop``."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self._changed = asyncio.Event()
        self._delivered = 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> int:
        """The next token; raises EngineError if the engine rejected or dropped the request."""
        while True:
            outputs = self.request.output_token_ids
            if self._delivered < len(outputs):
                self._delivered += 1
                return outputs[self._delivered - 1]
            if self.request.finished:
                if self.request.error is not None:
                    raise EngineError(self.request.error)
                raise StopAsyncIteration
            self._changed.clear()
            await self._changed.wait()

    @property
    def drained(self) -> bool:
        """Finished, and every token it produced was taken from the stream."""
        return self.request.finished and self._delivered == len(self.request.output_token_ids)

    def notify(self) -> None:
        self._changed.set()


class StepObserver(Protocol):
    """Told about every step and every request that ends outside one (the metrics)."""

    def step(self, plan: StepPlan, changed: Iterable[EngineRequest], clock: float) -> None: ...

    def finished(self, request: EngineRequest) -> None: ...


class EventPublisher(Protocol):
    """Where a step's KV events go (``publisher.KVEventPublisher``: vLLM's ZMQ wire)."""

    def publish(self, events: Sequence[WireEvent]) -> object: ...


class KVConnector(Protocol):
    """A KV store shared by engines (``store_tier.StoreTier``)."""

    async def prefetch(self, request: EngineRequest, blocks: BlockManager) -> range: ...

    async def save(self, request: EngineRequest, blocks: BlockManager) -> list[WireEvent]: ...


class EngineLoop:
    """Runs a ``Scheduler`` in real time and publishes its KV events (one batch per step).

    The publisher and the connector are borrowed: whoever created them closes them after
    ``close``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        publisher: EventPublisher | None = None,
        *,
        time_scale: float = 1.0,
        kv_transfer_timeout: float = 480.0,
        observer: StepObserver | None = None,
        connector: KVConnector | None = None,
    ) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.scheduler = scheduler
        self.publisher = publisher
        self.observer = observer
        self.connector = connector
        self.time_scale = time_scale
        self.kv_transfer_timeout = kv_transfer_timeout  # wall seconds: a safety net, unscaled
        self.num_batches_published = 0
        self._streams: dict[str, RequestStream] = {}
        self._hold_timers: dict[str, asyncio.TimerHandle] = {}
        self._lookups: dict[str, asyncio.Task[None]] = {}  # requests not queued yet
        self._saves: set[asyncio.Task[None]] = set()
        self._work = asyncio.Event()
        self._step: StepPlan | None = None
        self._step_started = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Publish what the cache announced at creation (SGLang: AllBlocksCleared), then run."""
        self._publish()
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        self._task.add_done_callback(self._died)

    def _died(self, task: asyncio.Task[None]) -> None:
        """A crashed loop must not leave every request waiting forever: fail them, loudly."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("engine loop crashed", exc_info=task.exception())
        for stream in list(self._streams.values()):
            if self.scheduler.finish(stream.request, "error"):
                stream.request.error = "engine loop crashed"
        self._wake_streams(list(self._streams))

    async def close(self) -> None:
        """Stop stepping and end every request's stream (held prefills are dropped)."""
        tasks = [*self._saves, *self._lookups.values()]
        if self._task is not None:
            tasks.append(self._task)
        for stream in list(self._streams.values()):
            request = stream.request
            if self._end_lookup(request, "abort"):
                request.error = "engine shut down"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in list(self._streams.values()):
            request = stream.request
            if self.scheduler.finish(request, "abort"):
                request.error = "engine shut down"
        self._wake_streams(list(self._streams))
        for timer in self._hold_timers.values():
            timer.cancel()
        self._hold_timers.clear()

    def submit(self, request: EngineRequest) -> RequestStream:
        """Queue a request, after its store lookup when there is a connector (a remote
        prefill's KV comes from its prefill engine instead; a request that reads no cache
        loads nothing either)."""
        stream = RequestStream(request)
        self._streams[request.request_id] = stream
        arrival = self._model_now()
        if self.connector is None or request.remote_prefill or not request.read_cache:
            self._queue(request, arrival)
        else:
            request.arrival_time = arrival  # also for an abort before it is queued
            task = asyncio.create_task(self._look_up(request, arrival))
            self._lookups[request.request_id] = task
        return stream

    def _queue(self, request: EngineRequest, arrival: float) -> None:
        self.scheduler.add(request, arrival)
        self._work.set()

    async def _look_up(self, request: EngineRequest, arrival: float) -> None:
        assert self.connector is not None
        try:
            request.store_blocks = await self.connector.prefetch(request, self.scheduler.blocks)
        except Exception:  # a fault in the tier must cost a recomputation, not the request
            log.exception("store lookup failed request_id=%s", request.request_id)
        finally:
            self._lookups.pop(request.request_id, None)
        self._queue(request, arrival)

    def _end_lookup(self, request: EngineRequest, reason: str) -> bool:
        """End a request still being looked up in the store: it never reaches the queue."""
        task = self._lookups.pop(request.request_id, None)
        if task is None:
            return False
        task.cancel()
        request.finish_reason = reason
        request.finish_time = self.scheduler.clock
        return True

    def abort(self, request: EngineRequest, reason: str = "abort") -> None:
        """End a request that is still waiting or running (no-op once it finished)."""
        if self.scheduler.finish(request, reason) or self._end_lookup(request, reason):
            if self.observer is not None:
                self.observer.finished(request)
            self._wake_streams([request.request_id])
            self._work.set()  # its blocks may admit a waiting request

    def release(self, request_id: str) -> bool:
        """The decode side pulled a held prefill's KV: free its blocks."""
        timer = self._hold_timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        released = self.scheduler.release(request_id)
        if released:
            self._work.set()
        return released

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        if reset:  # a refused reset changed nothing: the running step publishes its own batch
            self._publish()
        return reset

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            plan = self.scheduler.plan_step()
            if plan is None:
                self._work.clear()
                await self._work.wait()
                continue
            self._step, self._step_started = plan, loop.time()
            await asyncio.sleep(plan.duration * self.time_scale)
            self._step = None
            changed = self.scheduler.complete_step(plan)
            self._publish()
            self._save_prefilled(changed)
            if self.observer is not None:
                self.observer.step(plan, changed, self.scheduler.clock)
            for request in changed:
                if request.request_id in self.scheduler.held:
                    self._hold_timers[request.request_id] = loop.call_later(
                        self.kv_transfer_timeout, self._expire, request.request_id
                    )
            self._wake_streams(request.request_id for request in changed)

    def _save_prefilled(self, changed: Iterable[EngineRequest]) -> None:
        """Save the prompts whose prefill this step finished (their first token)."""
        if self.connector is None:
            return
        for request in changed:
            if len(request.output_token_ids) == 1 and not request.remote_prefill:
                task = asyncio.create_task(self._save(request))
                self._saves.add(task)
                task.add_done_callback(self._saves.discard)

    async def _save(self, request: EngineRequest) -> None:
        assert self.connector is not None
        try:
            events = await self.connector.save(request, self.scheduler.blocks)
        except Exception:  # a fault in the tier must not end the engine loop
            log.exception("store save failed request_id=%s", request.request_id)
            return
        if events and self.publisher is not None:
            self.publisher.publish(events)
            self.num_batches_published += 1

    def _expire(self, request_id: str) -> None:
        if self.release(request_id):
            log.warning("kv transfer not pulled, blocks freed request_id=%s", request_id)

    def _model_now(self) -> float:
        """The model clock now: into an in-flight step by the wall time it has run."""
        step = self._step
        if step is None or self.time_scale == 0:
            return self.scheduler.clock
        elapsed = (asyncio.get_running_loop().time() - self._step_started) / self.time_scale
        return self.scheduler.clock + min(elapsed, step.duration)

    def _publish(self) -> None:
        events = self.scheduler.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)
            self.num_batches_published += 1

    def _wake_streams(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            stream.notify()
            if stream.request.finished:
                del self._streams[request_id]
