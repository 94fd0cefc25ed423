"""One real vLLM and one real SGLang engine serving the same tiny model at block size 32
behind one conductor and router: both kinds' blocks land in one context (the conductor
hashes token ids itself), so the router compares them and routes by cache across both,
though their own block hashes differ (docs/fleet.md, "A mixed fleet")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from conductor.sglang_hash import block_keys, signed64
from publishers.engine.block_hash import BlockHasher, event_hash
from tests.real.checks import (
    MODEL,
    assert_fleet_hits_match,
    assert_router_follows_the_prefix,
    documents,
    engine_tokens,
    sharing_prompts,
    tokenizer,
    url,
)
from tests.real.conftest import fleet_spec, running_fleet

pytestmark = [pytest.mark.needs("vllm"), pytest.mark.needs("sglang")]

BLOCK = 32  # vLLM on CPU needs a multiple of 32; SGLang takes it as its page size
ENGINES = ("vllm-m", "sglang-m")


@pytest.fixture(scope="module")
def mixed_fleet(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    engines = [{"name": "vllm-m", "kind": "vllm"}, {"name": "sglang-m", "kind": "sglang"}]
    spec = fleet_spec(engines, BLOCK, model={"name": MODEL, "path": str(model_dir)})
    with running_fleet(tmp_path_factory.mktemp("mixed-fleet"), spec) as services:
        yield services


@pytest.mark.parametrize("instance", ENGINES)
async def test_query_equals_each_engines_cached_tokens(mixed_fleet, http, model_dir, instance):
    prompts = sharing_prompts(tokenizer(model_dir), 8, seed=len(instance) * 13)
    assert await assert_fleet_hits_match(http, mixed_fleet, instance, prompts, BLOCK) > 8 * BLOCK


async def _answer(http: aiohttp.ClientSession, fleet: dict, route: str, body: dict) -> Any:
    async with http.post(f"{url(fleet, 'conductor')}{route}", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["default"]


async def test_both_kinds_share_one_context_and_either_kinds_block_hashes_find_both(
    mixed_fleet, http, model_dir
):
    """The same prompt on both engines: ``/query`` (token ids) finds it on both. Their block
    hashes differ (vLLM: sha256 with PYTHONHASHSEED=0; SGLang: SHA-256 over uint32 tokens, as
    its events carry them), yet ``/query_by_hash`` with either kind's finds both copies: the
    conductor maps an engine hash to its own prefix hash through the engine that published
    it. Hashes no engine of the context published (another seed) find nothing."""
    tokens = sharing_prompts(tokenizer(model_dir), 1, seed=5)[0]
    for instance in ENGINES:
        await assert_fleet_hits_match(http, mixed_fleet, instance, [tokens], BLOCK)
    full = len(tokens) // BLOCK * BLOCK
    body = {"model": MODEL, "block_size": BLOCK}
    by_tokens = await _answer(http, mixed_fleet, "/query", body | {"token_ids": tokens})
    assert {name: by_tokens[name]["GPU"] for name in ENGINES} == {"vllm-m": full, "sglang-m": full}

    def vllm_hashes(seed: str) -> list[int]:
        return [event_hash(d) for d in BlockHasher("sha256", seed).block_digests(tokens, BLOCK)]

    sglang = [signed64(key) for key in block_keys(tokens, BLOCK)]
    assert not set(sglang) & set(vllm_hashes("0"))
    for hashes, expected in ((vllm_hashes("0"), full), (sglang, full), (vllm_hashes("7"), 0)):
        answer = await _answer(http, mixed_fleet, "/query_by_hash", body | {"seq_hashes": hashes})
        assert {name: answer.get(name, {}).get("GPU", 0) for name in ENGINES} == {
            name: expected for name in ENGINES
        }


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("first_engine", ENGINES)
async def test_the_router_follows_each_prefix_to_the_engine_holding_it(
    mixed_fleet, http, first_engine, path, stream
):
    """A document first served by one engine: its follow-ups go there, whichever kind it
    is, and the router's claim equals that engine's own report."""
    seed = ENGINES.index(first_engine) * 100 + len(path) * 10 + stream
    document = documents(1, 300, seed=seed)[0]
    owner = await assert_router_follows_the_prefix(
        http, mixed_fleet, path, stream, document, BLOCK, first_engine=first_engine
    )
    assert owner == first_engine


async def test_the_kinds_tokenize_a_chat_of_text_parts_differently(mixed_fleet, http):
    """The chat template is the model's, but a message whose content is a list of text
    parts is joined before it: with a newline by vLLM, with a space by SGLang 0.5.23."""
    plain = {"role": "user", "content": "one two"}
    parts = {"role": "user", "content": [{"type": "text", "text": t} for t in ("one", "two")]}
    ids = {}
    for name in ENGINES:
        for message in (plain, parts):
            body = {"model": MODEL, "messages": [message]}
            ids[name, message is parts] = await engine_tokens(http, url(mixed_fleet, name), body)
    assert ids["vllm-m", False] == ids["sglang-m", False]
    assert ids["vllm-m", True] != ids["sglang-m", True]
    assert ids["sglang-m", True] == ids["sglang-m", False]  # "one two": joined with a space
