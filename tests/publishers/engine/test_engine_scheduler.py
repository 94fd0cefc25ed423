"""The engine's step planner, driven step by step on its model clock (no sleeping).

What a router learns from an engine — its queue, its TTFT, which prefixes it caches — comes
from these decisions, so they are pinned down against vLLM's FCFS rules: FIFO admission with
head-of-line blocking, ``max_num_seqs``, preemption of the newest request, and blocks that
hold every token but the last sampled one.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq

from conductor.wire import EventBatch, decode_batch, parse_replay, replay_request
from conductor.wire.events import BlockStored
from publishers.engine.block_manager import BlockManager
from publishers.engine.loop import EngineError, EngineLoop, RequestStream
from publishers.engine.scheduler import EngineRequest, Scheduler, StepPlan, sample_token
from publishers.engine.timing import TimingModel
from publishers.publisher import KVEventPublisher

VOCAB = 1000
TIMING = TimingModel()


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, 4), TIMING, num_ordinary_tokens=VOCAB, max_num_seqs=max_num_seqs
    )


def request(
    name: str, length: int, max_tokens: int = 1, start: int = 0, **options
) -> EngineRequest:
    """A prompt of ``length`` consecutive ids from ``start`` (distinct starts: no shared prefix)."""
    return EngineRequest(name, list(range(start, start + length)), max_tokens, **options)


def run(engine: Scheduler, max_steps: int = 1000) -> list[StepPlan]:
    """Plan and complete steps until there is nothing to do."""
    plans = []
    while (plan := engine.plan_step()) is not None:
        engine.complete_step(plan)
        plans.append(plan)
        assert len(plans) < max_steps
    return plans


def stored_blocks(engine: Scheduler) -> int:
    return sum(
        len(wire.event.block_hashes)
        for wire in engine.take_events()
        if isinstance(wire.event, BlockStored)
    )


def test_waiting_requests_are_admitted_first_in_first_out() -> None:
    engine = scheduler(max_num_seqs=1)
    requests = [request(name, 8, 2, start=100 * i) for i, name in enumerate("abc")]
    for item in requests:
        engine.add(item)
    plans = run(engine)
    admitted = [item.request_id for plan in plans for item in plan.admitted]
    assert admitted == ["a", "b", "c"]
    first_tokens = [item.first_token_time for item in requests]
    assert first_tokens == sorted(first_tokens)
    assert all(item.finish_reason == "length" for item in requests)


def test_max_num_seqs_caps_the_batch() -> None:
    engine = scheduler(max_num_seqs=2)
    requests = [request(name, 8, 3, start=100 * i) for i, name in enumerate("abc")]
    for item in requests:
        engine.add(item)
    plans = run(engine)
    assert all(len(plan.chunks) <= 2 for plan in plans)
    assert [item.request_id for item in plans[0].admitted] == ["a", "b"]
    c_admitted = next(i for i, plan in enumerate(plans) if requests[2] in plan.admitted)
    assert c_admitted == 3  # after a and b produced their third token (steps 0..2)
    assert all(len(item.output_token_ids) == 3 for item in requests)


def test_a_request_waits_for_blocks_and_blocks_the_queue_behind_it() -> None:
    engine = scheduler(num_blocks=8)  # 32 tokens
    big = request("big", 24, max_tokens=4)  # grows to 27 tokens: 7 blocks
    blocked = request("blocked", 16, start=100)  # 4 blocks: fits only once big is done
    small = request("small", 4, start=200)  # 1 block would fit, but FCFS keeps it behind
    for item in (big, blocked, small):
        engine.add(item)
    plans = run(engine)
    assert plans[0].admitted == (big,)
    assert all(plan.admitted == () for plan in plans[1:4])
    assert plans[4].admitted == (blocked, small)  # the step after big's fourth token
    assert blocked.first_token_time == small.first_token_time
    assert engine.blocks.usage == 0


def test_a_request_larger_than_the_pool_is_rejected_without_stalling_the_queue() -> None:
    engine = scheduler(num_blocks=2)  # 8 tokens
    prompt_too_big, growing_too_big = request("prompt", 12), request("grows", 4, 6, start=50)
    fits = request("fits", 4, max_tokens=5, start=100)  # its last token needs no KV
    for item in (prompt_too_big, growing_too_big, fits):
        engine.add(item)
    plan = engine.plan_step()
    assert plan is not None
    assert plan.rejected == (prompt_too_big, growing_too_big) and plan.admitted == (fits,)
    assert all(item.finish_reason == "error" for item in plan.rejected)
    assert "2 blocks of 4" in (growing_too_big.error or "")
    run(engine)
    assert fits.finish_reason == "length"


def test_ttft_includes_the_time_spent_queueing() -> None:
    engine = scheduler(max_num_seqs=1)
    first, second = request("first", 64, max_tokens=3), request("second", 64, 1, start=1000)
    engine.add(first)
    engine.add(second)
    run(engine)
    prefill = TIMING.prefill_seconds(64)
    decodes = TIMING.decode_step_seconds(1, 65) + TIMING.decode_step_seconds(1, 66)
    assert first.ttft == pytest.approx(prefill)
    assert second.ttft == pytest.approx(prefill + decodes + prefill)


def test_a_late_arrival_counts_from_its_arrival() -> None:
    engine = scheduler()
    engine.add(request("early", 64, max_tokens=2))
    plan = engine.plan_step()
    assert plan is not None
    late = request("late", 64, start=1000)
    engine.add(late, arrival=plan.duration / 2)  # arrived half-way through the step
    engine.complete_step(plan)
    run(engine)
    # it waited for the rest of the in-flight step, then shared the next one with a decode
    step = TIMING.prefill_seconds(64) + TIMING.decode_step_seconds(1, 65)
    assert late.ttft == pytest.approx(plan.duration / 2 + step)


def test_a_cached_prefix_is_not_recomputed() -> None:
    engine = scheduler()
    engine.add(request("cold", 64))
    run(engine)
    warm = request("warm", 64)
    engine.add(warm)
    plan = engine.plan_step()
    assert plan is not None
    assert warm.num_cached_tokens == 60  # 15 blocks: at least one token is recomputed
    assert plan.duration == pytest.approx(TIMING.prefill_seconds(4, 60))


def test_blocks_hold_every_token_but_the_last_sampled_one() -> None:
    engine = scheduler()
    engine.add(request("prefill-only", 8, max_tokens=1))
    run(engine)
    assert stored_blocks(engine) == 2  # exactly the prompt, as a disaggregated prefill
    engine.add(request("generate", 8, max_tokens=6, start=100))
    run(engine)
    assert stored_blocks(engine) == 3  # 8 prompt + 5 computed outputs = 13 tokens


def test_generated_tokens_depend_on_the_prompt_only() -> None:
    engine = scheduler()
    one, two, other = request("1", 8, 5), request("2", 8, 5), request("3", 8, 5, start=1)
    for item in (one, two, other):
        engine.add(item)
    run(engine)
    assert one.output_token_ids == two.output_token_ids != other.output_token_ids
    assert one.output_token_ids == [sample_token(one.seed, i, VOCAB) for i in range(5)]


def test_a_full_pool_preempts_the_newest_request_which_resumes_later() -> None:
    engine = scheduler(num_blocks=4)  # 16 tokens
    older, newer = request("older", 7, max_tokens=6), request("newer", 7, 6, start=100)
    engine.add(older)
    engine.add(newer)
    plans = run(engine)
    preempting = [plan for plan in plans if plan.preempted]
    assert preempting and preempting[0].preempted == (newer,)
    assert all(plan.admitted == () for plan in preempting)  # vLLM admits nothing then
    assert engine.num_preemptions >= 1
    assert newer.output_token_ids == [sample_token(newer.seed, i, VOCAB) for i in range(6)]
    assert older.finish_reason == newer.finish_reason == "length"
    assert engine.blocks.usage == 0


def test_finishing_early_frees_blocks_and_leaves_finished_requests_alone() -> None:
    engine = scheduler(max_num_seqs=1)
    running, waiting = request("running", 8, 10), request("waiting", 8, 10, start=100)
    engine.add(running)
    engine.add(waiting)
    engine.complete_step(engine.plan_step())  # type: ignore[arg-type]
    assert engine.finish(waiting) and waiting.finish_reason == "abort"
    assert engine.finish(running, "stop") and running.finish_reason == "stop"
    assert not engine.finish(running)
    assert engine.blocks.usage == 0 and not engine.waiting and not engine.running


def test_a_request_finished_during_its_step_gets_no_token() -> None:
    engine = scheduler()
    item = request("gone", 8, 4)
    engine.add(item)
    plan = engine.plan_step()
    assert plan is not None
    engine.finish(item)
    assert engine.complete_step(plan) == []
    assert item.output_token_ids == [] and engine.blocks.usage == 0


def test_a_prefill_for_a_remote_decode_keeps_its_blocks_until_released() -> None:
    engine = scheduler()
    prefill = request("prefill", 8, keep_blocks=True)
    engine.add(prefill)
    run(engine)
    assert prefill.finish_reason == "length" and "prefill" in engine.held
    assert engine.blocks.usage > 0
    assert not engine.reset_prefix_cache()  # blocks are still in use
    assert engine.release("prefill") and not engine.release("prefill")
    assert engine.blocks.usage == 0 and engine.reset_prefix_cache()


def test_a_remote_prefill_loads_the_prompt_instead_of_computing_it() -> None:
    engine = scheduler()
    decode = request("decode", 64, max_tokens=2, remote_prefill=True)
    engine.add(decode)
    plan = engine.plan_step()
    assert plan is not None
    assert plan.duration == pytest.approx(TIMING.kv_load_seconds(64))
    assert plan.duration < TIMING.prefill_seconds(64) / 10
    assert decode.num_cached_tokens == 64  # vLLM counts transferred tokens as cached


def test_blocks_loaded_from_a_store_are_priced_as_loads_and_counted_as_cached() -> None:
    engine = scheduler()
    loaded = request("loaded", 65, store_blocks=range(0, 16))
    engine.add(loaded)
    plan = engine.plan_step()
    assert plan is not None and plan.chunks[0].num_loaded == 64
    assert plan.duration == pytest.approx(TIMING.step_seconds([(1, 64)], loaded_tokens=64))
    assert (loaded.num_cached_tokens, loaded.num_external_cached_tokens) == (64, 64)


def published_batches(publisher: KVEventPublisher) -> list[EventBatch]:
    """Every batch the real publisher sent, read back through its replay socket and the
    conductor's decoder, as a conductor would see them."""
    assert publisher.flush(5) and publisher.replay_endpoint is not None
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.replay_endpoint)
    try:
        dealer.send_multipart(replay_request(0))
        batches = []
        while (message := parse_replay(dealer.recv_multipart())) is not None:
            batches.append(decode_batch(message.payload))
        return batches
    finally:
        dealer.close()


async def test_the_loop_streams_tokens_and_publishes_one_batch_per_step_with_events() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", bind=True)
    engine = EngineLoop(scheduler(), publisher, time_scale=0)
    engine.start()
    try:
        done = engine.submit(request("done", 4, max_tokens=3))
        tokens = await asyncio.wait_for(_collect(done), 5)
        assert tokens == [sample_token(done.request.seed, i, VOCAB) for i in range(3)]
        # step 1 stores the prompt's block; the two decode steps complete no block
        batches = published_batches(publisher)
        assert [len(batch.events) for batch in batches] == [1]
        assert isinstance(batches[0].events[0], BlockStored) and not batches[0].rejected

        endless = engine.submit(request("endless", 4, max_tokens=250, start=100))
        await asyncio.wait_for(anext(endless), 5)
        engine.abort(endless.request)
        await asyncio.wait_for(_collect(endless), 5)  # the stream ends
        assert endless.request.finish_reason == "abort" and engine.scheduler.blocks.usage == 0
    finally:
        await engine.close()
        publisher.close()


async def test_closing_the_loop_ends_waiting_streams_with_an_error() -> None:
    engine = EngineLoop(scheduler(), time_scale=1.0)
    engine.start()
    stream = engine.submit(request("slow", 64, max_tokens=5))  # its first step takes ~25 ms
    await engine.close()
    with pytest.raises(EngineError, match="shut down"):
        await asyncio.wait_for(_collect(stream), 5)


async def _collect(stream: RequestStream) -> list[int]:
    return [token async for token in stream]


def budgeted(budget: int, chunked: bool = True) -> Scheduler:
    return Scheduler(
        BlockManager(512, 4),
        TIMING,
        num_ordinary_tokens=VOCAB,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
    )


def test_a_long_prompt_is_prefilled_in_chunks_over_several_steps() -> None:
    engine = budgeted(256)
    long = request("long", 1000)
    engine.add(long)
    plans = run(engine)
    assert [plan.num_computed_tokens for plan in plans] == [256, 256, 256, 232]
    assert [len(plan.chunks) for plan in plans] == [1, 1, 1, 1]
    # Eq. 1 chunk by chunk adds up to the whole prompt's, plus one overhead per step
    overheads = 3 * TIMING.prefill_overhead_s
    assert long.ttft == pytest.approx(TIMING.prefill_seconds(1000) + overheads)


def test_decodes_are_served_before_a_new_prompt_takes_the_rest_of_the_budget() -> None:
    engine = budgeted(64)
    first = request("first", 8, max_tokens=5)
    engine.add(first)
    engine.complete_step(engine.plan_step())  # type: ignore[arg-type]
    second = request("second", 200, start=1000)
    engine.add(second)
    plan = engine.plan_step()
    assert plan is not None
    assert [(c.request, c.num_computed, c.decode) for c in plan.chunks] == [
        (first, 1, True),
        (second, 63, False),
    ]
    assert plan.duration == pytest.approx(
        TIMING.step_seconds([(63, 0)], num_decodes=1, decode_context=8)
    )
    engine.complete_step(plan)
    assert second.output_token_ids == [] and len(first.output_token_ids) == 2


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget() -> None:
    engine = budgeted(64, chunked=False)
    small, big = request("small", 40, max_tokens=2), request("big", 60, start=1000)
    engine.add(small)
    engine.add(big)
    plan = engine.plan_step()
    assert plan is not None and plan.admitted == (small,)  # 40 + 60 > 64: big waits
    engine.complete_step(plan)
    plan = engine.plan_step()
    assert plan is not None and plan.admitted == (big,)  # 1 decode + 60 fit
