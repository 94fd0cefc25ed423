"""The simulator's continuous-batching scheduler: a pure step planner on a model clock.

``Scheduler`` decides, like vLLM V1's scheduler, what one engine step does — which requests
compute how many tokens, who is admitted, who is preempted when the pool runs dry — and how
long the step takes on the timing model. It never sleeps and keeps its own *model clock*
(seconds of simulated GPU time), so tests can drive it step by step and read TTFTs that
include queueing. It knows nothing of asyncio or sockets: ``loop.EngineLoop`` runs it in real
time and publishes its events.

vLLM's rules: a step has a budget of ``max_num_batched_tokens`` computed tokens. Running
requests are served first, in admission order — a decode computes the one token it sampled
last, an unfinished prefill its next chunk — then waiting requests are admitted in order,
each computing as much of its uncached prompt as the budget has left (chunked prefill; with
it off, a prompt waits until its whole remainder fits). A request samples a token in the
step that computes the last token it has, so a long prompt's TTFT spans several steps and
its blocks are cached (and announced) chunk by chunk.

Token bookkeeping follows vLLM: each step after the prompt computes the KV of the last
sampled token and samples the next one. So a request's blocks hold every token but the last
sampled one, and a ``max_tokens=1`` request (a disaggregated prefill) caches exactly its
prompt.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from ..encoding import WireEvent
from .block_hash import LoraAdapter
from .block_manager import Allocation, BlockManager
from .timing import TimingModel

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default on GPUs
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's API-server default (CPU and most GPUs)


def sample_token(seed: int, index: int, num_ordinary: int) -> int:
    """The ``index``-th generated token: a pure function of the prompt (via ``seed``), so
    every engine answers a prompt identically, as greedy decoding of one model would."""
    return xxhash.xxh3_64_intdigest(index.to_bytes(8, "little"), seed=seed) % num_ordinary


def sampling_seed(
    prompt_token_ids: Sequence[int], lora: LoraAdapter | None, sample_index: int
) -> int:
    """What a request's tokens are drawn from: its prompt, its adapter (another model
    answers differently) and which of the request's ``n`` samples it is (0: the answer a
    request with n = 1 gets)."""
    adapter = b"" if lora is None else lora.name.encode()
    data = array("q", prompt_token_ids).tobytes() + adapter
    return xxhash.xxh3_64_intdigest(data, seed=sample_index)


@dataclass(eq=False, slots=True)
class SampleGroup:
    """The ``n`` samples of one prompt (vLLM's ``ParentRequest``): vLLM's ``request_params_n``
    and ``request_max_num_generation_tokens`` are observed once, when the last one ends."""

    n: int
    remaining: int = field(init=False)
    max_generated: int = 0

    def __post_init__(self) -> None:
        self.remaining = self.n

    def finish(self, num_generated: int) -> bool:
        """One sample ended; True when it was the last."""
        self.remaining -= 1
        self.max_generated = max(self.max_generated, num_generated)
        return self.remaining == 0


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One request's state in the scheduler; the shell only reads it.

    ``remote_prefill``: the prompt's KV arrives from a prefill engine (vLLM's
    ``do_remote_prefill``), so its first admission loads instead of computing it.
    ``keep_blocks``: a prefill for a remote decode (``do_remote_decode``): when finished its
    blocks stay allocated until the decode side has pulled them (``Scheduler.release``).
    ``store_blocks``: the prompt blocks (by index) loaded from a KV store before the request
    was queued; None when the engine has no store. ``lora``: the adapter it runs with (its
    blocks are the adapter's, never the base model's). ``read_cache`` False: the prompt is
    computed whole, as vLLM does for a request wanting prompt logprobs
    (``skip_reading_prefix_cache``); its blocks are still cached. ``sample_index`` and
    ``group``: which of a prompt's ``n`` samples it is. Times are on the model clock.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    cache_salt: str | None = None
    remote_prefill: bool = False
    keep_blocks: bool = False
    store_blocks: range | None = None
    lora: LoraAdapter | None = None
    read_cache: bool = True
    sample_index: int = 0
    group: SampleGroup | None = None
    output_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    scheduled_time: float | None = None  # first admission: the end of its queueing
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # not computed at the first admission (vLLM's cached_tokens)
    num_external_cached_tokens: int = 0  # of them, loaded from the KV store
    num_computed_tokens: int = 0  # tokens with KV, including this step's (vLLM's name)
    num_block_tokens: int = 0  # tokens the block manager knows (prompt, then outputs)
    num_preemptions: int = 0
    block_hashes: tuple[int, ...] = ()  # the prompt's complete blocks, as published
    finish_reason: str | None = None  # "length", "stop", "abort" or "error"
    error: str | None = None
    seed: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or self.max_tokens < 1:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        self.seed = sampling_seed(self.prompt_token_ids, self.lora, self.sample_index)

    @property
    def token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs, without copying them."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
class Chunk:
    """What one request does in a step: load ``num_loaded`` tokens of KV (CPU tier or
    remote prefill), then compute ``num_computed`` (from the budget) after ``context``
    tokens it has by then."""

    request: EngineRequest
    num_computed: int
    num_loaded: int = 0
    context: int = 0
    decode: bool = False  # computes the token it sampled last
    samples: bool = True  # reaches the end of the sequence: a token is sampled after it


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step does; ``complete_step`` applies it once ``duration`` has passed."""

    chunks: tuple[Chunk, ...]  # running requests first, then the admitted ones
    admitted: tuple[EngineRequest, ...]  # moved from waiting to running this step
    preempted: tuple[EngineRequest, ...]  # blocks freed, back at the head of the queue
    rejected: tuple[EngineRequest, ...]  # can never fit the pool: finished with an error
    duration: float  # model seconds

    @property
    def num_computed_tokens(self) -> int:
        """Tokens of the batch (vLLM's ``iteration_tokens``), at most the budget."""
        return sum(chunk.num_computed for chunk in self.chunks)


class Scheduler:
    """vLLM's FCFS scheduler over one ``BlockManager`` (one engine, one DP rank)."""

    def __init__(
        self,
        blocks: BlockManager,
        timing: TimingModel,
        *,
        num_ordinary_tokens: int,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        enable_chunked_prefill: bool = True,
        max_loras: int | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or (max_loras or 1) < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_loras must be >= 1")
        self.blocks = blocks
        self.timing = timing
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras  # adapters one step may run (None: LoRA is off)
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

        Running requests get their tokens first, within the budget; when the pool is full
        the newest running request is preempted (recomputed later), and no request is
        admitted in that step — vLLM's rule. Then waiting requests are admitted in order
        until one does not fit (head-of-line blocking, as FCFS), the budget is spent or
        ``max_num_seqs`` run; one whose adapter would make the step run more than
        ``max_loras`` adapters is passed over, keeping its place in the queue.
        """
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        preempted: list[EngineRequest] = []
        for request in list(self.running):
            if budget == 0 or request not in self.running:  # spent, or preempted
                break
            chunk = self._schedule_running(request, budget, preempted)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.num_computed

        admitted: list[EngineRequest] = []
        rejected: list[EngineRequest] = []
        loras = {chunk.request.lora.adapter_id for chunk in chunks if chunk.request.lora}
        passed_over: list[EngineRequest] = []
        while self.waiting and not preempted and budget and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._exceeds_max_loras(request, loras):
                passed_over.append(self.waiting.popleft())
                continue
            problem = self.capacity_problem(len(request.prompt_token_ids), request.max_tokens)
            if problem is not None:  # covers the allocator's CapacityError, and growth
                self.waiting.popleft()
                request.finish_reason, request.error = "error", problem
                rejected.append(request)
                continue
            first_remote = request.remote_prefill and request.scheduled_time is None
            allocation = self.blocks.allocate(
                request.request_id,
                request.token_ids,
                lora=request.lora,
                cache_salt=request.cache_salt,
                read_cache=request.read_cache,
                token_budget=None if first_remote else budget,  # loading costs no budget
                chunked=self.enable_chunked_prefill,
                external=request.store_blocks if request.scheduled_time is None else None,
            )
            if allocation is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
            chunk = self._admit(request, allocation)
            chunks.append(chunk)
            budget -= chunk.num_computed
            if request.lora is not None:
                loras.add(request.lora.adapter_id)
        self.waiting.extendleft(reversed(passed_over))

        if not (chunks or preempted or rejected):
            return None
        return StepPlan(
            chunks=tuple(chunks),
            admitted=tuple(admitted),
            preempted=tuple(preempted),
            rejected=tuple(rejected),
            duration=self._price(chunks),
        )

    def _exceeds_max_loras(self, request: EngineRequest, loras: set[int]) -> bool:
        """vLLM's rule: a step runs at most ``max_loras`` adapters (the base model is free)."""
        lora = request.lora
        if lora is None or self.max_loras is None or lora.adapter_id in loras:
            return False
        return len(loras) >= self.max_loras

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
        while the step ran are skipped: their blocks are already free. A chunk that does
        not reach the end of its prompt samples nothing. Computed prefill chunks are
        checkpointed (the block manager caches them now if its engine does, as SGLang).
        """
        self.clock += plan.duration
        changed = list(plan.rejected)
        for chunk in plan.chunks:
            request = chunk.request
            if request.finished:
                continue
            if chunk.samples:
                self._sample(request)
                changed.append(request)
            if not (chunk.decode or request.finished):  # a finished one was cached as freed
                self.blocks.checkpoint(request.request_id)
        return changed

    def _sample(self, request: EngineRequest) -> None:
        index = len(request.output_token_ids)
        token = sample_token(request.seed, index, self.num_ordinary_tokens)
        request.output_token_ids.append(token)
        self.num_generated_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = self.clock
        if len(request.output_token_ids) >= request.max_tokens:
            self._finish(request, "length")

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
        request.finish_time = self.clock
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

    def _schedule_running(
        self, request: EngineRequest, budget: int, preempted: list[EngineRequest]
    ) -> Chunk | None:
        """Its next tokens within ``budget``, preempting the newest requests for blocks;
        None when even preempting itself did not make room (the step stops there)."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        missing = request.num_tokens - request.num_block_tokens  # sampled since scheduled
        sampled = request.output_token_ids[-missing:] if missing else []
        while not self.blocks.append_tokens(request.request_id, sampled, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None
        request.num_block_tokens += missing
        return self._advance(request, num_new, decode=missing > 0)

    def _admit(self, request: EngineRequest, allocation: Allocation) -> Chunk:
        """Its first chunk; a first admission records its cache hit and queueing.

        CPU and store hits are loaded, not computed; so is every prompt token a remote-prefill
        request did not have at its first admission. A preempted request readmitted later
        recomputes what it lost like any other.
        """
        computed, loaded = allocation.num_scheduled_tokens, allocation.num_loaded_tokens
        if request.scheduled_time is None:
            request.scheduled_time = self.clock
            request.block_hashes = allocation.block_hashes
            request.num_cached_tokens = allocation.num_cached_tokens
            request.num_external_cached_tokens = allocation.num_external_loaded_tokens
            if request.remote_prefill:
                loaded, computed = loaded + computed, 0
                request.num_cached_tokens = allocation.num_prompt_tokens
        request.num_block_tokens = allocation.num_prompt_tokens
        gpu_hit = allocation.num_cached_tokens - allocation.num_loaded_tokens
        request.num_computed_tokens = gpu_hit
        return self._advance(request, computed, loaded=loaded)

    def _advance(
        self, request: EngineRequest, computed: int, *, loaded: int = 0, decode: bool = False
    ) -> Chunk:
        """Count the chunk's tokens as computed (vLLM does at scheduling time)."""
        request.num_computed_tokens += loaded
        context = request.num_computed_tokens
        request.num_computed_tokens += computed
        samples = request.num_computed_tokens == request.num_tokens
        return Chunk(request, computed, loaded, context, decode=decode, samples=samples)

    def _price(self, chunks: Sequence[Chunk]) -> float:
        """The step's model seconds, from the tokens it computes and loads."""
        decodes = [chunk for chunk in chunks if chunk.decode]
        return self.timing.step_seconds(
            prefills=[(c.num_computed, c.context) for c in chunks if not c.decode],
            loaded_tokens=sum(chunk.num_loaded for chunk in chunks),
            num_decodes=len(decodes),
            decode_context=sum(chunk.context for chunk in decodes),
        )

    def _finish(self, request: EngineRequest, reason: str) -> None:
        self.running.remove(request)
        request.finish_reason = reason
        request.finish_time = self.clock
        if request.keep_blocks:
            self.held[request.request_id] = request
        else:
            self.blocks.free(request.request_id)

    def _preempt(self, request: EngineRequest) -> None:
        """Free the request's blocks and requeue it first; it recomputes what it lost."""
        self.blocks.free(request.request_id, finished=False)
        request.num_computed_tokens = request.num_block_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1
