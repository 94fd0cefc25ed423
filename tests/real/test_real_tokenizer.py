"""The router's own tokenizer against real vLLM serving the tiny model: for every prompt its
ids equal vLLM's ``/tokenize`` and the ids vLLM's serving path computed (``return_token_ids``),
for completions and chat; a router given the model directory tokenizes in-process once the
engine agreed. (The simulator's ``--tokenizer`` runs this same code.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.tokenizer import LocalTokenizer
from tests.real.checks import MODEL, documents
from tests.real.conftest import RealEngine
from tests.support.api import eventually, metric
from tests.support.processes import ConductorProcess, RouterProcess

BLOCK = 32
COMPLETIONS = [
    "Hello, world!",
    "  leading spaces, a\ttab and\n\nblank lines  ",
    "ünïcödé: 日本語のテキスト, emoji 🙂🚀, Ελληνικά, עברית, combining é",
    "<|begin_of_text|>a special token's text, then <|eot_id|> another",
    documents(1, 900, seed=7)[0],  # long: over a thousand tokens
]
LONG_TURN = [{"role": "user", "content": documents(1, 450, seed=9)[0]}]
CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse. ünï 字"},
            {"role": "user", "content": documents(1, 300, seed=8)[0]},
            {"role": "assistant", "content": "Noted."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "part one"},
                    {"type": "text", "text": "part two 🙂"},
                ],
            },
        ]
    },  # fmt: skip
    {"messages": [{"role": "user", "content": "no prompt"}], "add_generation_prompt": False},
    {
        "messages": [
            {"role": "user", "content": "Finish this"},
            {"role": "assistant", "content": "Once upon a"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "user", "content": "y", "name": "ann"},
        ]
    },
    # a long conversation, then its next turn: the router reuses the first one's chunks
    {"messages": LONG_TURN},
    {"messages": [*LONG_TURN, {"role": "assistant", "content": "Sure."}, *LONG_TURN]},
]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path):
    """One real engine, a conductor, and a router given the model directory."""
    run_dir = tmp_path_factory.mktemp("tokenizer")
    engine = RealEngine(run_dir, model_dir, BLOCK)
    engine.start()
    conductor = ConductorProcess(run_dir, config={"register_allow": [f"ipc://{run_dir}/"]})
    conductor.wait_ready()
    router = RouterProcess(
        run_dir,
        {
            "conductor": {"address": conductor.url},
            "prefill": {
                "config": {"modelname": MODEL, "block_size": BLOCK},
                "instances": [{"instance_id": "solo", "http_endpoint": engine.url}],
            },
            "tokenizer": {"path": str(model_dir)},
        },
    )
    router.wait_ready()
    yield engine, router
    router.stop()
    engine.stop()
    conductor.stop()


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_completion_ids_equal_vllm(stack, http, model_dir):
    engine, _ = stack
    await engine.wait_healthy(http)
    local = LocalTokenizer.load(model_dir)
    for prompt in COMPLETIONS:
        for add_special_tokens in (True, False):
            body = {"model": MODEL, "prompt": prompt, "add_special_tokens": add_special_tokens}
            ours = local.prompt_ids(False, body)
            assert ours == (await _post(http, f"{engine.url}/tokenize", body))["tokens"]
            served = await _post(
                http,
                f"{engine.url}/v1/completions",
                body | {"max_tokens": 1, "return_token_ids": True},
            )
            assert ours == served["choices"][0]["prompt_token_ids"], prompt[:40]


async def test_chat_ids_equal_vllm(stack, http, model_dir):
    engine, _ = stack
    await engine.wait_healthy(http)
    local = LocalTokenizer.load(model_dir)
    for chat in CHATS:
        body = {"model": MODEL, **chat}
        ours = local.prompt_ids(True, body)
        assert ours == (await _post(http, f"{engine.url}/tokenize", body))["tokens"], chat
        served = await _post(
            http,
            f"{engine.url}/v1/chat/completions",
            body | {"max_tokens": 1, "return_token_ids": True},
        )
        assert ours == served["prompt_token_ids"], chat
    assert local.chunks is not None and local.chunks.stats.reused_tokens > 300


async def test_the_router_tokenizes_in_process_once_the_engine_agreed(stack, http):
    engine, router = stack
    await engine.wait_healthy(http)
    for path in ("completions", "chat"):
        gauge = f'router_local_tokenizer_active{{path="{path}"}}'
        await eventually(lambda g=gauge: metric(http, router.url, g), lambda v: v == 1)
    requests = [
        ("/v1/completions", {"prompt": COMPLETIONS[2]}),
        ("/v1/chat/completions", CHATS[1]),
    ]
    for path, body in requests:
        async with http.post(
            f"{router.url}{path}", json={"model": MODEL, "max_tokens": 1, **body}
        ) as response:
            assert response.status == 200, await response.text()
            assert response.headers["x-conductor-tokenized-by"] == "local"
            assert "x-conductor-fallback" not in response.headers
