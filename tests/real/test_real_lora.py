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
    sharing_prompts,
    tokenizer,
)
from tests.real.conftest import RealEngine
from tests.support.api import get, post
from tests.support.processes import ConductorProcess

pytestmark = pytest.mark.needs("vllm")

BLOCK = 32
INSTANCE = "lora"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    run_dir = tmp_path_factory.mktemp("lora")
    adapter = lora_adapter_dir(model_dir)
    lora_args = ["--enable-lora", "--lora-modules", f"{LORA_NAME}={adapter}"]
    engine = RealEngine(
        run_dir, model_dir, BLOCK, INSTANCE, args=[*lora_args, "--max-lora-rank", str(LORA_RANK)]
    )
    engine.start()
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
    assert await complete_tokens(http, engine, base_only[0], lora=LORA_NAME) == 0
    hit = await conductor_hit(http, conductor, INSTANCE, base_only[1], BLOCK, lora=LORA_NAME)
    assert hit["GPU"] == 0
