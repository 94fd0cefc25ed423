"""One real vLLM engine at block size 64, outside any fleet so that it can crash: the index
still equals vLLM's hits, and a killed engine's blocks leave the index within the bound
documented in docs/fleet.md (its connection drops with the process)."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest

from tests.real.checks import (
    MODEL,
    assert_hits_match_engine,
    conductor_hit,
    sharing_prompts,
    tokenizer,
)
from tests.real.conftest import RealEngine
from tests.support.api import eventually
from tests.support.processes import ConductorProcess, RouterProcess

pytestmark = pytest.mark.needs("vllm")

BLOCK = 64
FORGET_BOUND_S = 1.0  # a crashed process closes its sockets: the conductor hears it at once


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    run_dir = tmp_path_factory.mktemp("solo")
    engine = RealEngine(run_dir, model_dir, BLOCK)
    engine.start()
    # the engine publishes on a unix socket in run_dir: allowed next to loopback
    allow = [f"ipc://{run_dir}/", "127.0.0.1"]
    conductor = ConductorProcess(run_dir, config={"register_allow": allow})
    conductor.wait_ready()
    router_config = {
        "conductor": {"address": conductor.url},
        "prefill": {
            "config": {"modelname": MODEL, "block_size": BLOCK},
            "instances": [
                {
                    "instance_id": "solo",
                    "http_endpoint": engine.url,
                    "registrations": [
                        {
                            "endpoint": engine.plan.events_endpoint,
                            "replay_endpoint": engine.plan.replay_endpoint,
                        }
                    ],
                }
            ],
        },
    }
    router = RouterProcess(run_dir, router_config)
    router.wait_ready()
    yield engine, conductor, router
    router.stop()
    engine.stop()
    conductor.stop()


async def test_query_equals_vllm_hits_at_block_size_64(stack, http, model_dir):
    engine, conductor, _ = stack
    await engine.wait_healthy(http)
    tok = tokenizer(model_dir)
    for salt in (None, "another-tenant"):
        prompts = sharing_prompts(tok, 12, seed=64 if salt is None else 65)
        total = await assert_hits_match_engine(
            http, conductor.url, engine.url, "solo", prompts, BLOCK, salt, kind="vllm"
        )
        assert total > 12 * BLOCK


async def _through_router(http: aiohttp.ClientSession, router: str, text: str) -> tuple[int, int]:
    """(x-conductor-cached-tokens, the engine's cached tokens) for one chat request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    async with http.post(f"{router}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
        claimed = int(response.headers["x-conductor-cached-tokens"])
    return claimed, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_killed_engine_is_forgotten_and_never_claimed_after_restart(stack, http, model_dir):
    engine, conductor, router = stack
    await engine.wait_healthy(http)
    text = "Restart check. " + " ".join(f"word{i}" for i in range(300))
    tokens = tokenizer(model_dir).encode(text).ids
    await _through_router(http, router.url, text)
    claimed, cached = await eventually(
        lambda: _through_router(http, router.url, text), lambda pair: pair[0] > 0
    )
    assert claimed == cached > 0

    engine.kill()
    killed = time.monotonic()
    hit = await eventually(
        lambda: conductor_hit(http, conductor.url, "solo", tokens, BLOCK),
        lambda h: h["GPU"] == 0,
        timeout=FORGET_BOUND_S,
        interval=0.01,
    )
    forgotten_after = time.monotonic() - killed
    assert hit["DISK"] == 0 and forgotten_after < FORGET_BOUND_S
    print(f"blocks of the killed engine left the index after {forgotten_after * 1000:.0f} ms")

    engine.start()  # same ports, empty cache
    await engine.wait_healthy(http)
    assert (await conductor_hit(http, conductor.url, "solo", tokens, BLOCK))["GPU"] == 0
    assert await _through_router(http, router.url, text) == (0, 0)
    claimed, cached = await eventually(
        lambda: _through_router(http, router.url, text), lambda pair: pair[0] > 0
    )
    assert claimed == cached > 0
