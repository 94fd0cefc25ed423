"""Two real SGLang engines behind ``mooncake-fleet up``: the index equals SGLang's own radix
cache (its cached tokens, as its usage report says) through repeats, extensions, evictions
and flushes, a late conductor learns it from the replay buffer, and the router follows it
(one fleet for all: two SGLang engines start in about a minute)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real.checks import (
    assert_a_late_conductor_learns_the_buffer,
    assert_fleet_hits_match,
    assert_router_follows_the_prefix,
    conductor_hit,
    documents,
    indexed,
    sharing_prompts,
    tokenizer,
    url,
)
from tests.real.conftest import fleet_spec, running_fleet
from tests.support.api import eventually

pytestmark = pytest.mark.needs("sglang")

BLOCK = 16  # SGLang's page size: any size (vLLM on CPU needs a multiple of 32)
SMALL_POOL = 1024  # sglang-b's KV pool in tokens: three of the documents below fill it


@pytest.fixture(scope="module")
def sglang_fleet(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    """Two SGLang engines, conductor and router. ``sglang-b`` holds few tokens, so that it
    evicts (a later flag wins over the fleet's own)."""
    engines = [
        {"name": "sglang-a", "kind": "sglang"},
        {"name": "sglang-b", "kind": "sglang", "args": ["--max-total-tokens", str(SMALL_POOL)]},
    ]
    spec = fleet_spec(engines, BLOCK, model={"name": "tiny-llama", "path": str(model_dir)})
    with running_fleet(tmp_path_factory.mktemp("sglang-fleet"), spec) as services:
        yield services


@pytest.mark.parametrize("instance", ["sglang-a", "sglang-b"])
async def test_query_equals_sglang_cached_tokens(sglang_fleet, http, model_dir, instance):
    """Prompts sharing documents, then one prompt sent again and extended twice."""
    tok = tokenizer(model_dir)
    prompts = sharing_prompts(tok, 10, seed=len(instance) * 7 + instance.endswith("b"))
    again = prompts[-1]
    longer = again + tok.encode(" and then some more words about the cache").ids
    prompts += [again, longer, longer + tok.encode(" once more").ids]
    assert await assert_fleet_hits_match(http, sglang_fleet, instance, prompts, BLOCK) > 10 * BLOCK


async def test_evicted_blocks_leave_the_index(sglang_fleet, http, model_dir):
    """Documents after one preamble, more than sglang-b's small pool holds: SGLang evicts
    the least recently used pages, the first document's own, and keeps the preamble that
    every later one used again. The conductor then holds of the first document what SGLang
    still has, which is what SGLang reuses when it comes again."""
    tok = tokenizer(model_dir)
    preamble = documents(1, 80, seed=30)[0]
    early, *later = [tok.encode(f"{preamble}\n{text}").ids for text in documents(5, 300, 31)]
    assert sum(len(tokens) for tokens in later) > SMALL_POOL
    await assert_fleet_hits_match(http, sglang_fleet, "sglang-b", [early, *later], BLOCK)
    held = await conductor_hit(http, url(sglang_fleet, "conductor"), "sglang-b", early, BLOCK)
    # its removals reached the index: only the pages it shares with the others are left
    shared = next(i for i, (a, b) in enumerate(zip(early, later[-1], strict=False)) if a != b)
    assert held["GPU"] == shared // BLOCK * BLOCK > 0, held
    assert (
        await assert_fleet_hits_match(http, sglang_fleet, "sglang-b", [early], BLOCK) == held["GPU"]
    )


async def test_flush_cache_empties_only_that_engines_part(sglang_fleet, http, model_dir):
    tokens = tokenizer(model_dir).encode(documents(1, 200, seed=41)[0]).ids
    conductor = url(sglang_fleet, "conductor")
    for instance in ("sglang-a", "sglang-b"):
        await assert_fleet_hits_match(http, sglang_fleet, instance, [tokens], BLOCK)
    async with http.post(f"{url(sglang_fleet, 'sglang-a')}/flush_cache") as response:
        assert response.status == 200, await response.text()
    await eventually(
        lambda: conductor_hit(http, conductor, "sglang-a", tokens, BLOCK),
        lambda hit: hit["GPU"] == 0,
    )
    await indexed(http, conductor, "sglang-b", tokens, BLOCK)  # still all of it
    assert await assert_fleet_hits_match(http, sglang_fleet, "sglang-a", [tokens], BLOCK) == 0


async def test_a_conductor_started_after_sglang_learns_its_buffer(
    sglang_fleet, http, model_dir, tmp_path: Path
):
    """SGLang's replay buffer begins with the AllBlocksCleared it publishes at start, which
    only a replay shows a late subscriber."""
    prompts = sharing_prompts(tokenizer(model_dir), 3, seed=77)
    await assert_fleet_hits_match(http, sglang_fleet, "sglang-a", prompts, BLOCK)
    await assert_a_late_conductor_learns_the_buffer(
        http, sglang_fleet, "sglang-a", prompts, BLOCK, tmp_path
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_router_sends_shared_prefixes_to_the_sglang_engine_holding_them(
    sglang_fleet, http, path, stream
):
    document = documents(1, 300, seed=len(path) * 10 + stream + 500)[0]
    owner = await assert_router_follows_the_prefix(
        http, sglang_fleet, path, stream, document, BLOCK
    )
    assert owner in {"sglang-a", "sglang-b"}
