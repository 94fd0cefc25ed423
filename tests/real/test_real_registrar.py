"""``mooncake-register`` next to one real vLLM engine: it learns everything from vLLM itself
(``/v1/models``, ``vllm:cache_config_info``'s block size, ``/kv_event_sources``), and keeps
the engine registered through a conductor restart (the conductor keeps no state file), so
that the index equals vLLM's cache hits before and after; at SIGTERM it unregisters."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tests.real.checks import (
    assert_hits_match_engine,
    conductor_hit,
    indexed,
    sharing_prompts,
    tokenizer,
)
from tests.real.conftest import RealEngine
from tests.registrar.registrar_process import RegistrarProcess
from tests.support.api import eventually, get
from tests.support.processes import ConductorProcess

pytestmark = pytest.mark.needs("vllm")

BLOCK = 32
INTERVAL_S = 2.0
INSTANCE = "solo"


def start_conductor(run_dir: Path, port: int | None = None) -> ConductorProcess:
    # the engine publishes on a unix socket in run_dir (the fleet's layout), replays on
    # loopback; no state file: a restart forgets every registration
    allow = [f"ipc://{run_dir}/", "127.0.0.1"]
    conductor = ConductorProcess(
        run_dir, "--state-file", "", config={"register_allow": allow}, port=port
    )
    conductor.wait_ready()
    return conductor


async def services(http: aiohttp.ClientSession, conductor: ConductorProcess) -> list[dict]:
    status, answer = await get(http, f"{conductor.url}/services")
    assert status == 200, answer
    return answer["services"]


async def test_the_registrar_keeps_vllm_registered_through_a_conductor_restart(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, http: aiohttp.ClientSession
) -> None:
    tmp_path = tmp_path_factory.mktemp("reg")  # short: vLLM's ipc paths must fit 107 bytes
    engine = RealEngine(tmp_path, model_dir, BLOCK, name=INSTANCE)
    engine.start()
    conductor = start_conductor(tmp_path)
    registrar = RegistrarProcess(
        tmp_path,
        "--conductor", conductor.url,
        "--engine-url", engine.url,
        "--instance-id", INSTANCE,
        "--interval-s", str(INTERVAL_S),
    )  # fmt: skip
    try:
        await engine.wait_healthy(http)
        _, view = await eventually(
            lambda: registrar.health(http), lambda answer: answer[0] == 200, timeout=30
        )
        assert (view["model"], view["block_size"]) == ("tiny-llama", BLOCK)
        [service] = await services(http, conductor)
        assert service["Endpoint"] == engine.plan.events_endpoint
        assert service["ReplayEndpoint"] == engine.plan.replay_endpoint

        tok = tokenizer(model_dir)
        before = sharing_prompts(tok, 6, seed=29)
        await assert_hits_match_engine(
            http, conductor.url, engine.url, INSTANCE, before, BLOCK, kind="vllm"
        )

        conductor.kill()
        conductor = start_conductor(tmp_path, port=conductor.port)
        assert await services(http, conductor) == []
        await eventually(lambda: services(http, conductor), bool, timeout=INTERVAL_S + 5)
        # the blocks vLLM computed before come back from its replay buffer ...
        for tokens in before:
            await indexed(http, conductor.url, INSTANCE, tokens, BLOCK)
        # ... and the index keeps equalling vLLM's hits on new prompts that share them
        after = sharing_prompts(tok, 6, seed=29)[::-1] + sharing_prompts(tok, 4, seed=30)
        total = await assert_hits_match_engine(
            http, conductor.url, engine.url, INSTANCE, after, BLOCK, kind="vllm"
        )
        assert total > 0

        assert registrar.terminate() == 0, registrar.log_tail()
        assert await services(http, conductor) == []
        assert (await conductor_hit(http, conductor.url, INSTANCE, before[0], BLOCK))["GPU"] == 0
    finally:
        registrar.terminate()
        engine.stop()
        conductor.stop()
