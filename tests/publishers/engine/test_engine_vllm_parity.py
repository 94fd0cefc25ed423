"""The simulator answers what real vLLM 0.32 answers, where routers and scrapers look.

``tests/fixtures/vllm_http_shapes.json`` holds a real vLLM CPU engine's answers (its origin is
in the fixtures' README): each route's status, media type and JSON body for a given request,
its ``/metrics`` families, and the KV-event batches it published for bursts of requests.
The simulator, started with the same model name, context length and block size, gets the
same requests; its answers must have the same keys and JSON types recursively (values such
as ids and generated text differ by nature), its ``vllm:`` metrics vLLM's types, labels and
buckets, and its scheduler the same steps and event batches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conductor.wire.events import BlockStored
from publishers.engine.block_manager import BlockManager
from publishers.engine.scheduler import EngineRequest, Scheduler
from publishers.engine.timing import TimingModel
from tests.support.processes import EngineSim
from tests.support.vllm_shapes import (
    FIXTURE,
    NOT_COMPARED,
    ROUTES,
    answer,
    assert_answers_like_vllm,
)

EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "topic": "kv-events"}
ENGINE_ARGS = (
    "--max-model-len",
    "2048",
    "--num-gpu-blocks-override",
    "512",
    "--kv-events-config",
    json.dumps(EVENTS | {"replay_endpoint": "tcp://127.0.0.1:0"}),
    "--sim-kv-bind",
)
# vLLM's commonly scraped metrics the simulator must export
REQUIRED_METRICS = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:iteration_tokens_total",
    "vllm:cache_config_info",
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, EngineSim]]:
    """Scale-out on and off, both serving ``tiny`` with the real engine's settings."""
    started = {
        scale_out: EngineSim(
            tmp_path_factory.mktemp("engine"),
            f"parity-{scale_out}",
            *ENGINE_ARGS,
            *(["--enable-scale-out"] if scale_out else []),
            model="tiny",
            block_size=32,
        )
        for scale_out in (True, False)
    }
    try:
        for engine in started.values():
            engine.wait_ready()
        yield started
    finally:
        for engine in started.values():
            engine.stop()


@pytest.mark.parametrize("case", ROUTES, ids=[f"{c['name']}-{c['scale_out']}" for c in ROUTES])
async def test_each_route_answers_with_vllms_status_and_shape(
    engines: dict[bool, EngineSim], http: aiohttp.ClientSession, case: dict[str, Any]
) -> None:
    if case["name"] in NOT_COMPARED:
        pytest.skip("a deliberate difference (see NOT_COMPARED)")
    assert_answers_like_vllm(await answer(http, engines[case["scale_out"]].url, case), case)


async def test_render_gives_the_tokens_generation_would_use(
    engines: dict[bool, EngineSim], http: aiohttp.ClientSession
) -> None:
    url = engines[True].url
    messages = [{"role": "user", "content": "Hello world"}]
    async with http.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}) as r:
        tokens = (await r.json())["tokens"]
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "cache_salt": "a"}
    async with http.post(f"{url}/v1/chat/completions/render", json=body) as response:
        rendered = await response.json()
    assert rendered["token_ids"] == tokens and rendered["cache_salt"] == "a"
    assert rendered["sampling_params"]["max_tokens"] == 5
    assert rendered["request_id"].startswith("chatcmpl-")


def families(text: str) -> dict[str, dict[str, Any]]:
    """The fixture's view of Prometheus text: type, label names, label values, buckets."""
    found = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.name.endswith("_created"):
            continue
        entry: dict[str, Any] = {
            "type": family.type,
            "labels": sorted({key for s in family.samples for key in s.labels if key != "le"}),
        }
        values: dict[str, set[str]] = {}
        for sample in family.samples:
            for key, value in sample.labels.items():
                if key not in ("le", "model_name", "engine"):
                    values.setdefault(key, set()).add(value)
        if values and family.name != "vllm:cache_config_info":
            entry["label_values"] = {key: sorted(value) for key, value in values.items()}
        if family.type == "histogram":
            entry["buckets"] = [
                float(s.labels["le"])
                for s in family.samples
                if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
            ]
        found[family.name] = entry
    return found


async def test_metrics_have_vllms_names_types_labels_and_buckets(
    engines: dict[bool, EngineSim], http: aiohttp.ClientSession
) -> None:
    url = engines[True].url
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4}
    for _ in range(2):  # the second one hits the prefix cache
        async with http.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    simulated = families(text)
    assert REQUIRED_METRICS <= set(simulated)
    for name, family in simulated.items():
        assert family == FIXTURE["metrics"][name], name

    samples = {
        (sample.name, sample.labels.get("finished_reason")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("vllm:request_success_total", "length")] >= 2
    assert samples[("vllm:e2e_request_latency_seconds_count", None)] >= 2
    assert samples[("vllm:inter_token_latency_seconds_count", None)] >= 6  # 3 per request
    assert samples[("vllm:prompt_tokens_total", None)] >= 2 * 4
    assert samples[("vllm:generation_tokens_total", None)] >= 8
    assert samples[("vllm:prefix_cache_hits_total", None)] > 0


# -- the scheduler's steps against the real engine's event batches --------------------------


def burst_batches(budget: int, requests: int, prompt_tokens: int, max_tokens: int) -> list:
    """(events, blocks stored) per step for a burst of distinct prompts arriving together."""
    engine = Scheduler(
        BlockManager(4096, 32),
        TimingModel(),
        num_ordinary_tokens=1000,
        max_num_seqs=128,  # vLLM's CPU default
        max_num_batched_tokens=budget,
    )
    for index in range(requests):
        start = 100_000 * (index + 1)
        prompt = list(range(start, start + prompt_tokens))
        engine.add(EngineRequest(str(index), prompt, max_tokens))
    batches = []
    while (plan := engine.plan_step()) is not None:
        engine.complete_step(plan)
        stored = [w.event for w in engine.take_events() if isinstance(w.event, BlockStored)]
        if stored:  # vLLM publishes a batch only for a step with events
            batches.append((len(stored), sum(len(event.block_hashes) for event in stored)))
    return batches


@pytest.mark.parametrize(
    "burst", [b for b in FIXTURE["kv_event_bursts"] if b["max_num_batched_tokens"] == 256]
)
def test_a_burst_publishes_vllms_batches_step_by_step(burst: dict[str, Any]) -> None:
    batches = burst_batches(
        burst["max_num_batched_tokens"],
        burst["requests"],
        burst["prompt_tokens"],
        burst["max_tokens"],
    )
    assert [events for events, _ in batches] == burst["events_per_batch"]
    assert [blocks for _, blocks in batches] == burst["blocks_per_batch"]


@pytest.mark.parametrize(
    "burst", [b for b in FIXTURE["kv_event_bursts"] if b["max_num_batched_tokens"] == 2048]
)
def test_a_burst_never_publishes_more_events_per_batch_than_vllm(burst: dict[str, Any]) -> None:
    """At vLLM's default budget the real engine's first steps depend on arrival races, so
    the largest batch is what must match, and the total stored."""
    batches = burst_batches(2048, burst["requests"], burst["prompt_tokens"], burst["max_tokens"])
    assert max(events for events, _ in batches) == max(burst["events_per_batch"])
    assert sum(events for events, _ in batches) >= burst["requests"]
