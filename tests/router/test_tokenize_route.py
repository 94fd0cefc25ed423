"""The router's ``POST /tokenize``: vLLM's request and answer, from the router's own tokenizer
once an engine agreed with it (else passed on to an engine), compared over HTTP with the
engine simulator serving the same model directory, and with real vLLM's pinned answers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.router.inprocess import MODEL, layout
from tests.support.api import eventually, metric
from tests.support.processes import EngineSim
from tests.support.vllm_shapes import ROUTES, shape

VLLM_TOKENIZE = next(case for case in ROUTES if case["name"] == "tokenize")
BODIES = [
    {"model": MODEL, "prompt": "Hello world"},
    {"prompt": "  two  spaces,\ttab and ünïcödé 🙂"},  # no model: the served one
    {"model": MODEL, "messages": [{"role": "user", "content": "Hello world"}]},
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "one"}]},
        ],
        "add_generation_prompt": False,
    },
]


@pytest.fixture
def engine(tmp_path: Path, model_dir: Path) -> Iterator[EngineSim]:
    """The simulator tokenizing with the tiny model, as vLLM serving it does."""
    process = EngineSim(tmp_path, "e0", "--tokenizer", str(model_dir), model=MODEL)
    process.wait_ready()
    yield process
    process.stop()


async def tokenize(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any, str | None]:
    """The status, JSON answer and ``x-conductor-tokenized-by`` of one ``/tokenize``."""
    options = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(f"{url}/tokenize", **options) as response:
        answer = await response.json(content_type=None)
        return response.status, answer, response.headers.get("x-conductor-tokenized-by")


async def trusted_router(serve, engine: EngineSim, model_dir: Path, http) -> str:
    """A router with the tiny model's tokenizer, once the engine agreed on both paths and
    the router knows the model's max_model_len (its /tokenize answers itself)."""
    _, url = await serve(layout([engine.url], tokenizer={"path": str(model_dir)}))
    gauge = "router_local_tokenizer_active"
    await eventually(lambda: metric(http, url, gauge), lambda active: active == 2)
    await eventually(lambda: tokenize(http, url, BODIES[0]), lambda got: got[2] == "local")
    return url


async def test_the_routers_tokenize_answers_as_the_engine_does(serve, engine, model_dir, http):
    url = await trusted_router(serve, engine, model_dir, http)
    for body in BODIES:
        status, answer, tokenized_by = await tokenize(http, url, body)
        assert (status, tokenized_by) == (200, "local"), answer
        assert (status, answer) == (await tokenize(http, engine.url, body))[:2], body
        assert shape(answer) == shape(VLLM_TOKENIZE["json"])
    # vLLM adds no BOS when told not to (test_tokenizer pins its ids); the simulator's
    # /tokenize ignores add_special_tokens
    _, with_bos, _ = await tokenize(http, url, BODIES[0])
    _, answer, _ = await tokenize(http, url, BODIES[0] | {"add_special_tokens": False})
    assert answer["tokens"] == with_bos["tokens"][1:] and answer["count"] == 4


async def test_token_strs_are_the_vocabulary_entries(serve, engine, model_dir, http):
    url = await trusted_router(serve, engine, model_dir, http)
    _, answer, _ = await tokenize(http, url, BODIES[0] | {"return_token_strs": True})
    strs = answer["token_strs"]
    assert len(strs) == answer["count"] and strs[0] == "<|begin_of_text|>"
    assert "".join(strs[1:]).replace("Ġ", " ") == "Hello world"  # byte-level BPE pieces


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "nope", "prompt": "Hello"}, 404),
        ({"model": MODEL}, 400),  # neither prompt nor messages
        ({"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400),
        ({"model": 7, "prompt": "a"}, 400),
        (b"{", 400),  # not JSON
    ],
)
async def test_bad_requests_are_vllms_errors(serve, engine, model_dir, http, body, status):
    url = await trusted_router(serve, engine, model_dir, http)
    got_status, answer, _ = await tokenize(http, url, body)
    engine_status, engine_answer, _ = await tokenize(http, engine.url, body)
    assert got_status == engine_status == status
    assert shape(answer) == shape(engine_answer)  # {"error": {message, type, param, code}}
    assert answer["error"]["code"] == status
    if status == 404:
        assert answer == engine_answer


async def test_without_a_trusted_tokenizer_an_engine_answers(serve, engine, http):
    _, url = await serve(layout([engine.url]))
    for body in (BODIES[0], BODIES[3], {"model": MODEL, "prompt": [5, 6, 7]}):
        status, answer, tokenized_by = await tokenize(http, url, body)
        assert tokenized_by == "engine"
        assert (status, answer) == (await tokenize(http, engine.url, body))[:2]
