"""One real vLLM engine serving the tiny model and its LoRA adapter (``--enable-lora``),
its one event stream registered with a conductor for the base model, as the router
registers it: the adapter's context answers what vLLM reuses for adapter requests, and
neither the base model nor the adapter is credited with the other's blocks, in the index
as in vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleet.tiny_model import LORA_NAME, LORA_RANK, lora_adapter_dir
from tests.real.checks import (
    MODEL,
    REGISTRATION_TYPE,
    assert_hits_match_engine,
    complete_tokens,
    conductor_hit,
    indexed,
    served,
    sharing_prompts,
    tokenizer,
)
from tests.real.conftest import RealEngine
from tests.support.api import get, post
from tests.support.processes import ConductorProcess, RouterProcess

pytestmark = pytest.mark.needs("vllm")

BLOCK = 32
INSTANCE = "lora"


def lora_engine(run_dir: Path, model_dir: Path, name: str) -> RealEngine:
    """A vLLM engine serving the tiny model and its adapter, started."""
    adapter = lora_adapter_dir(model_dir)
    lora_args = ["--enable-lora", "--lora-modules", f"{LORA_NAME}={adapter}"]
    args = [*lora_args, "--max-lora-rank", str(LORA_RANK)]
    engine = RealEngine(run_dir, model_dir, BLOCK, name, args=args)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    run_dir = tmp_path_factory.mktemp("lora")
    engine = lora_engine(run_dir, model_dir, INSTANCE)
    # the engine publishes on a unix socket in run_dir: allowed next to loopback
    conductor = ConductorProcess(
        run_dir, config={"register_allow": [f"ipc://{run_dir}/", "127.0.0.1"]}
    )
    try:
        conductor.wait_ready()
        yield engine, conductor
    finally:
        engine.stop()
        conductor.stop()


@pytest.fixture
async def registered(stack, http: aiohttp.ClientSession) -> tuple[str, str]:
    """(engine URL, conductor URL) once vLLM is up and its stream registered for the base
    model (``lora_name`` ""): the adapter's events name the adapter themselves."""
    engine, conductor = stack
    await engine.wait_healthy(http)
    body = {
        "endpoint": engine.plan.events_endpoint,
        "replay_endpoint": engine.plan.replay_endpoint,
        "type": REGISTRATION_TYPE["vllm"],
        "modelname": MODEL,
        "block_size": BLOCK,
        "instance_id": INSTANCE,
        "lora_name": "",
    }
    status, answer = await post(http, f"{conductor.url}/register", body)
    assert status == 200, answer
    return engine.url, conductor.url


async def first_logprob(http: aiohttp.ClientSession, engine: str, model: str) -> float:
    body: dict[str, Any] = {"model": model, "prompt": "SELECT name FROM", "max_tokens": 1}
    async with http.post(f"{engine}/v1/completions", json=body | {"logprobs": 1}) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["choices"][0]["logprobs"]["token_logprobs"][0]


async def test_vllm_serves_the_tiny_adapter(registered, http):
    """/v1/models lists the adapter with the base model as its parent, and its answers are
    not the base model's (its weights are not PEFT's initial zeros)."""
    engine, _ = registered
    _, models = await get(http, f"{engine}/v1/models")
    parents = {model["id"]: model.get("parent") for model in models["data"]}
    assert parents == {MODEL: None, LORA_NAME: MODEL}
    assert await first_logprob(http, engine, LORA_NAME) != await first_logprob(http, engine, MODEL)


async def test_the_adapters_context_equals_vllms_hits_and_the_base_model_shares_none(
    registered, http, model_dir
):
    """Adapter requests: each prompt's hit in the adapter's context equals the tokens vLLM
    reused. Those blocks are no hit for the base model, in the index or in vLLM; the base
    model's own requests then hit as vLLM says, and its blocks are no hit for the adapter."""
    engine, conductor = registered
    tok = tokenizer(model_dir)
    prompts = sharing_prompts(tok, 5, seed=27)
    adapter_hits = await assert_hits_match_engine(
        http, conductor, engine, INSTANCE, prompts, BLOCK, kind="vllm", lora=LORA_NAME
    )
    assert adapter_hits > 2 * 200  # two of the five prompts repeat an earlier document
    for tokens in prompts:
        assert (await conductor_hit(http, conductor, INSTANCE, tokens, BLOCK))["GPU"] == 0

    base_only = sharing_prompts(tok, 2, seed=28)  # other documents: no block in common
    base_hits = await assert_hits_match_engine(
        http, conductor, engine, INSTANCE, [prompts[0], *base_only], BLOCK, kind="vllm"
    )
    assert base_hits > 200  # the second base-only prompt shares its document with the first
    hit = await conductor_hit(http, conductor, INSTANCE, base_only[0], BLOCK, lora=LORA_NAME)
    assert hit["GPU"] == 0
    assert await complete_tokens(http, engine, base_only[0], lora=LORA_NAME) == 0


# -- the router in front of two engines --------------------------------------------------------
@pytest.fixture
async def routed_pair(
    stack, registered, tmp_path_factory: pytest.TempPathFactory, model_dir: Path, http
):
    """The module's engine and a second one, both serving the adapter, behind a router
    (with a conductor of its own) serving the base model and the adapter, the streams
    registered for the base model. Two engines at once, the most the real suite runs."""
    first, _ = stack
    run_dir = tmp_path_factory.mktemp("pair")  # short: vLLM's unix sockets live under it
    second = lora_engine(run_dir, model_dir, f"{INSTANCE}-b")
    engines = (first, second)
    allow = [*(engine.plan.events_endpoint for engine in engines), "127.0.0.1"]
    conductor = ConductorProcess(run_dir, config={"register_allow": allow})
    router = None
    try:
        conductor.wait_ready()
        await second.wait_healthy(http)
        config = {
            "conductor": {"address": conductor.url},
            "models": [
                {
                    "modelname": MODEL,
                    "block_size": BLOCK,
                    "adapters": [LORA_NAME],
                    "instances": [instance_entry(engine) for engine in engines],
                }
            ],
        }
        router = RouterProcess(run_dir, config)
        router.wait_ready()
        yield router.url, conductor.url, {engine.name: engine.url for engine in engines}
    finally:
        if router is not None:
            router.stop()
        second.stop()
        conductor.stop()


def instance_entry(engine: RealEngine) -> dict[str, Any]:
    registration = {
        "endpoint": engine.plan.events_endpoint,
        "replay_endpoint": engine.plan.replay_endpoint,
    }
    return {
        "instance_id": engine.name,
        "http_endpoint": engine.url,
        "registrations": [registration],
    }


async def test_the_router_sends_a_repeated_adapter_prompt_to_the_engine_holding_it(
    routed_pair, http, model_dir
):
    """An adapter prompt computed on the second engine: a follow-up sharing its document,
    sent through the router, goes there, and the router's cached tokens equal vLLM's."""
    router, conductor, engines = routed_pair
    holder = f"{INSTANCE}-b"
    # seed 31: both prompts ask about one document (no other test sends its prompts)
    first, follow_up = sharing_prompts(tokenizer(model_dir), 2, seed=31)
    await complete_tokens(http, engines[holder], first, lora=LORA_NAME)
    await indexed(http, conductor, holder, first, BLOCK, lora=LORA_NAME)
    body = {"model": LORA_NAME, "prompt": follow_up, "max_tokens": 1}
    holders = {holder}
    for _ in range(3):  # two real engines share the CPU: a query may miss its timeout
        headers, cached = await served(http, router, "/v1/completions", body)
        if "x-conductor-fallback" not in headers:
            break
        holders.add(headers["x-conductor-prefill-instance"])  # it computed the prompt too
    decision = {k: v for k, v in headers.items() if k.lower().startswith("x-conductor-")}
    assert headers["x-conductor-prefill-instance"] in holders, decision
    assert int(headers["x-conductor-cached-tokens"]) == cached > 200
    # the base model's same prompt: the adapter's blocks count for nothing, here or in vLLM
    headers, cached = await served(http, router, "/v1/completions", {**body, "model": MODEL})
    assert (int(headers["x-conductor-cached-tokens"]), cached) == (0, 0)
