"""The simulator's continuous-batching engine: a pure step planner and the asyncio loop.

``Scheduler`` decides, like vLLM's FCFS scheduler, what one engine step does — which running
requests decode a token, which waiting ones are admitted and prefilled, who is preempted when
the pool runs dry — and how long the step takes on the timing model. It never sleeps and
keeps its own *model clock* (seconds of simulated GPU time), so tests can drive it step by
step and read TTFTs that include queueing, and the trace simulator can reuse it as is.

``EngineLoop`` is the thin shell: it runs ``plan_step``, sleeps the step's duration times
``time_scale`` (so tests and demos run the same schedule faster), applies the step, wakes the
requests' token streams and publishes the step's KV events as one batch, as vLLM does.

Token bookkeeping follows vLLM: a step that admits a request computes its whole prompt and
samples the first token; each later step computes the KV of the last sampled token and
samples the next one. So a request's blocks hold every token but the last sampled one, and
a ``max_tokens=1`` request (a disaggregated prefill) caches exactly its prompt.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import xxhash

from ..encoding import WireEvent
from ..publisher import KVEventPublisher
from .block_manager import Allocation, BlockManager
from .timing import TimingModel

log = logging.getLogger(__name__)

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default


class EngineError(RuntimeError):
    """A request the engine rejected (finish_reason "error": it can never fit the pool) or
    dropped (finish_reason "abort": shutdown)."""


def sample_token(seed: int, index: int, num_ordinary: int) -> int:
    """The ``index``-th generated token: a pure function of the prompt (via ``seed``), so
    every engine answers a prompt identically, as greedy decoding of one model would."""
    return xxhash.xxh3_64_intdigest(index.to_bytes(8, "little"), seed=seed) % num_ordinary


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One request's state in the scheduler; the shell only reads it.

    ``remote_prefill``: the prompt's KV arrives from a prefill engine (vLLM's
    ``do_remote_prefill``), so its first admission loads instead of computing it.
    ``keep_blocks``: a prefill for a remote decode (``do_remote_decode``): when finished its
    blocks stay allocated until the decode side has pulled them (``Scheduler.release``).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    cache_salt: str | None = None
    remote_prefill: bool = False
    keep_blocks: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0  # model clock
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # not computed at the first admission (vLLM's cached_tokens)
    block_hashes: tuple[int, ...] = ()  # the prompt's complete blocks, as published
    finish_reason: str | None = None  # "length", "stop", "abort" or "error"
    error: str | None = None
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or self.max_tokens < 1:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        self.seed = xxhash.xxh3_64_intdigest(array("q", self.prompt_token_ids).tobytes())

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        """Model seconds from arrival to the first token (queueing included)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step does; ``complete_step`` applies it once ``duration`` has passed."""

    admitted: tuple[EngineRequest, ...]  # prefilled this step, sample a token at its end
    decoded: tuple[EngineRequest, ...]  # running requests that sample one more token
    preempted: tuple[EngineRequest, ...]  # blocks freed, back at the head of the queue
    rejected: tuple[EngineRequest, ...]  # can never fit the pool: finished with an error
    duration: float  # model seconds


class Scheduler:
    """FCFS continuous batching over one ``BlockManager`` (one engine, one DP rank)."""

    def __init__(
        self,
        blocks: BlockManager,
        timing: TimingModel,
        *,
        num_ordinary_tokens: int,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        self.blocks = blocks
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.num_ordinary_tokens = num_ordinary_tokens
        self.clock = 0.0
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # admission order: the newest is preempted first
        self.held: dict[str, EngineRequest] = {}  # finished prefills awaiting their decode side
        self.num_preemptions = 0
        self.num_generated_tokens = 0

    def add(self, request: EngineRequest, arrival: float | None = None) -> None:
        """Queue a request; ``arrival`` defaults to the model clock."""
        request.arrival_time = self.clock if arrival is None else arrival
        self.waiting.append(request)

    def plan_step(self) -> StepPlan | None:
        """Reserve the blocks of the next step and price it; None when there is nothing to do.

        Running requests first get room for the token they compute; when the pool is full
        the newest running request is preempted (recomputed later), and no request is
        admitted in that step — vLLM's rule. Then waiting requests are admitted in order
        until one does not fit (head-of-line blocking, as FCFS) or ``max_num_seqs`` run.
        """
        decoded: list[EngineRequest] = []
        preempted: list[EngineRequest] = []
        for request in list(self.running):
            if request not in self.running:  # preempted for an older request
                continue
            while not self.blocks.append_tokens(request.request_id, request.output_token_ids[-1:]):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                decoded.append(request)

        admitted: list[tuple[EngineRequest, Allocation]] = []
        rejected: list[EngineRequest] = []
        while self.waiting and not preempted and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            problem = self.capacity_problem(len(request.prompt_token_ids), request.max_tokens)
            if problem is not None:  # covers the allocator's CapacityError, and growth
                self.waiting.popleft()
                request.finish_reason, request.error = "error", problem
                rejected.append(request)
                continue
            allocation = self.blocks.allocate(
                request.request_id, request.token_ids, cache_salt=request.cache_salt
            )
            if allocation is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            admitted.append((request, allocation))

        if not (decoded or admitted or preempted or rejected):
            return None
        duration = sum(self._admit(request, allocation) for request, allocation in admitted)
        context = sum(
            len(request.prompt_token_ids) + len(request.output_token_ids) for request in decoded
        )  # lengths only: ``token_ids`` copies the whole sequence
        duration += self.timing.decode_step_seconds(len(decoded), context)
        return StepPlan(
            admitted=tuple(request for request, _ in admitted),
            decoded=tuple(decoded),
            preempted=tuple(preempted),
            rejected=tuple(rejected),
            duration=duration,
        )

    def capacity_problem(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request could never run here, or None: its KV at the end (all its tokens but
        the last) must fit the whole pool, or it would be preempted forever."""
        num_tokens = num_prompt_tokens + max_tokens - 1
        block_size, num_blocks = self.blocks.block_size, self.blocks.num_gpu_blocks
        if num_tokens <= num_blocks * block_size:
            return None
        return (
            f"{num_prompt_tokens} prompt tokens + {max_tokens} max_tokens need the KV of "
            f"{num_tokens} tokens; the pool holds {num_blocks} blocks of {block_size}"
        )

    def complete_step(self, plan: StepPlan) -> list[EngineRequest]:
        """Advance the clock, sample the step's tokens and finish requests that are done.

        Returns every request whose state changed, for the shell to wake. Requests aborted
        while the step ran are skipped: their blocks are already free.
        """
        self.clock += plan.duration
        changed = list(plan.rejected)
        for request in (*plan.admitted, *plan.decoded):
            if request.finished:
                continue
            index = len(request.output_token_ids)
            token = sample_token(request.seed, index, self.num_ordinary_tokens)
            request.output_token_ids.append(token)
            self.num_generated_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = self.clock
            if len(request.output_token_ids) >= request.max_tokens:
                self.running.remove(request)
                request.finish_reason = "length"
                if request.keep_blocks:
                    self.held[request.request_id] = request
                else:
                    self.blocks.free(request.request_id)
            changed.append(request)
        return changed

    def finish(self, request: EngineRequest, reason: str = "abort") -> bool:
        """End a waiting or running request early (client gone, stop string); frees blocks.

        Finished requests, held prefills included, are left alone: False.
        """
        if request.finished:
            return False
        if request in self.running:
            self.running.remove(request)
            self.blocks.free(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return False
        request.finish_reason = reason
        return True

    def release(self, request_id: str) -> bool:
        """Free a finished prefill's blocks once its decode side has them (or gave up)."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self.blocks.free(request_id)
        return True

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: False while any request (or held prefill) has blocks."""
        return self.blocks.reset()

    def take_events(self) -> list[WireEvent]:
        return self.blocks.take_events()

    def _admit(self, request: EngineRequest, allocation: Allocation) -> float:
        """Record a first admission's cache hit; return the admission's model seconds.

        That is the prefill of the uncached tokens plus loading the CPU hits — or, for the
        first admission of a remote-prefill request, loading every token it did not have.
        A preempted request readmitted later recomputes what it lost like any other.
        """
        computed = allocation.num_new_tokens
        loaded = allocation.num_cpu_loaded_tokens
        first = request.first_token_time is None
        if request.remote_prefill and first:
            loaded, computed = loaded + computed, 0
        if first:
            request.num_cached_tokens = allocation.num_prompt_tokens - computed
            request.block_hashes = allocation.block_hashes
        compute = self.timing.prefill_seconds(computed, allocation.num_cached_tokens)
        return compute + self.timing.kv_load_seconds(loaded)

    def _preempt(self, request: EngineRequest) -> None:
        """Free the request's blocks and requeue it first; it recomputes what it lost."""
        self.blocks.free(request.request_id)
        self.waiting.appendleft(request)
        self.num_preemptions += 1


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


class EngineLoop:
    """Runs a ``Scheduler`` in real time and publishes its KV events (one batch per step).

    The publisher is borrowed: whoever created it closes it after ``close``.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        publisher: KVEventPublisher | None = None,
        *,
        time_scale: float = 1.0,
        kv_transfer_timeout: float = 480.0,
    ) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.scheduler = scheduler
        self.publisher = publisher
        self.time_scale = time_scale
        self.kv_transfer_timeout = kv_transfer_timeout  # wall seconds: a safety net, unscaled
        self.num_batches_published = 0
        self._streams: dict[str, RequestStream] = {}
        self._hold_timers: dict[str, asyncio.TimerHandle] = {}
        self._work = asyncio.Event()
        self._step: StepPlan | None = None
        self._step_started = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for stream in list(self._streams.values()):
            request = stream.request
            if self.scheduler.finish(request, "abort"):
                request.error = "engine shut down"
        self._wake_streams(list(self._streams))
        for timer in self._hold_timers.values():
            timer.cancel()
        self._hold_timers.clear()

    def submit(self, request: EngineRequest) -> RequestStream:
        stream = RequestStream(request)
        self._streams[request.request_id] = stream
        self.scheduler.add(request, self._model_now())
        self._work.set()
        return stream

    def abort(self, request: EngineRequest, reason: str = "abort") -> None:
        """End a request that is still waiting or running (no-op once it finished)."""
        if self.scheduler.finish(request, reason):
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
            for request in changed:
                if request.request_id in self.scheduler.held:
                    self._hold_timers[request.request_id] = loop.call_later(
                        self.kv_transfer_timeout, self._expire, request.request_id
                    )
            self._wake_streams(request.request_id for request in changed)

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
