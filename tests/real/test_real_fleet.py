"""Two real vLLM engines behind ``mooncake-fleet up``: the index equals vLLM's own prefix
cache, the router follows it, a late conductor learns it from the replay buffers, and the
router's own tokenizer makes vLLM's ids (one fleet for all: an engine start is ~1 min)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from publishers.engine.block_hash import BlockHasher, event_hash
from tests.real.checks import (
    MODEL,
    assert_a_late_conductor_learns_the_buffer,
    assert_hits_match_engine,
    assert_router_follows_the_prefix,
    documents,
    engine_tokens,
    indexed,
    sharing_prompts,
    tokenizer,
    url,
)
from tests.real.tokenizer_cases import CHATS, COMPLETIONS
from tests.support.api import eventually, metric
from tests.support.vllm_shapes import NOT_COMPARED, ROUTES, answer, assert_answers_like_vllm
from tokenization.tokenizer import LocalTokenizer

pytestmark = pytest.mark.needs("vllm")

BLOCK = 32


async def test_a_chat_request_is_served_by_real_vllm_through_the_router(real_fleet, http):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": documents(1, 150, seed=1)[0]}],
        "max_tokens": 4,
    }
    router, conductor = url(real_fleet, "router"), url(real_fleet, "conductor")

    async def chat() -> tuple[Any, dict[str, Any]]:
        async with http.post(f"{router}/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            return response.headers, await response.json()

    first_headers, first = await chat()
    owner = first_headers["x-conductor-prefill-instance"]
    # the engine's events reach the conductor a moment after its answer
    tokens = await engine_tokens(http, url(real_fleet, owner), body)
    await indexed(http, conductor, owner, tokens, BLOCK)
    headers, second = await chat()
    assert second["system_fingerprint"].startswith("vllm-0.32")
    assert headers["x-conductor-policy"] == "ttft"
    assert headers["x-conductor-prefill-instance"] == first_headers["x-conductor-prefill-instance"]
    assert headers["x-conductor-prefill-instance"] in {"vllm-a", "vllm-b"}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and int(headers["x-conductor-cached-tokens"]) == cached
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("salt", [None, "tenant-salt"])
@pytest.mark.parametrize("instance", ["vllm-a", "vllm-b"])
async def test_query_equals_vllm_prefix_cache_hits(real_fleet, http, model_dir, instance, salt):
    """vllm-b runs without PYTHONHASHSEED: /query rehashes token ids, so it stays right."""
    prompts = sharing_prompts(tokenizer(model_dir), 14, seed=hash((instance, salt)) % 1000)
    total = await assert_hits_match_engine(
        http,
        url(real_fleet, "conductor"),
        url(real_fleet, instance),
        instance,
        prompts,
        BLOCK,
        salt,
        kind="vllm",
    )
    assert total > 14 * BLOCK  # the prompts did share: most of them hit


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_router_sends_shared_prefixes_to_the_engine_holding_them(
    real_fleet, http, path, stream
):
    document = documents(1, 300, seed=len(path) * 10 + stream)[0]
    await assert_router_follows_the_prefix(http, real_fleet, path, stream, document, BLOCK)


async def test_a_conductor_started_after_the_engines_learns_their_buffers(
    real_fleet, http, model_dir, tmp_path: Path
):
    prompts = sharing_prompts(tokenizer(model_dir), 3, seed=77)
    await assert_hits_match_engine(
        http,
        url(real_fleet, "conductor"),
        url(real_fleet, "vllm-a"),
        "vllm-a",
        prompts,
        BLOCK,
        kind="vllm",
    )
    # no request is sent: only the engine's replay buffer can fill this index
    await assert_a_late_conductor_learns_the_buffer(
        http, real_fleet, "vllm-a", prompts, BLOCK, tmp_path
    )


async def test_query_by_hash_needs_the_engines_hash_seed(real_fleet, http, model_dir):
    """Engine block hashes depend on the hash seed (PYTHONHASHSEED): hashes a client made
    with a seed that an engine of the context uses resolve to the shared prefix, so every
    instance holding it answers; hashes made with any other seed match nothing, while
    /query, which rehashes token ids, is right whatever the engines' seeds."""
    tokens = sharing_prompts(tokenizer(model_dir), 1, seed=5)[0]
    conductor = url(real_fleet, "conductor")
    for instance in ("vllm-a", "vllm-b"):
        await assert_hits_match_engine(
            http, conductor, url(real_fleet, instance), instance, [tokens], BLOCK, kind="vllm"
        )
    full = len(tokens) // BLOCK * BLOCK
    # vllm-a runs with PYTHONHASHSEED=0, vllm-b without (vLLM's fixed sha256 default)
    for seed, expected in (("0", full), (None, full), ("4242", 0)):
        digests = BlockHasher("sha256", seed).block_digests(tokens, BLOCK)
        body = {"model": MODEL, "block_size": BLOCK, "seq_hashes": [event_hash(d) for d in digests]}
        async with http.post(f"{conductor}/query_by_hash", json=body) as response:
            answer = (await response.json())["default"]
        assert {name: hit["GPU"] for name, hit in answer.items()} == {
            "vllm-a": expected,
            "vllm-b": expected,
        }, seed


async def test_drift_shows_when_the_cache_is_reset_behind_the_conductors_back(real_fleet, http):
    """vLLM announces a reset only with its next step, after the router has already asked
    the conductor: that request is promised cache the engine no longer has, and the
    router's drift metrics show it; the next one is right again."""
    router, conductor = url(real_fleet, "router"), url(real_fleet, "conductor")
    body = {"model": MODEL, "prompt": documents(1, 200, seed=9)[0], "max_tokens": 2}

    async def send() -> tuple[str, int, int]:
        async with http.post(f"{router}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
            claimed = int(response.headers["x-conductor-cached-tokens"])
            owner = response.headers["x-conductor-prefill-instance"]
        return owner, claimed, answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def drift() -> float:
        predicted = await metric(http, router, "router_cache_predicted_tokens_total")
        return predicted - await metric(http, router, "router_cache_realized_tokens_total")

    owner = "vllm-b"  # the engine in dev mode: its prefix goes there first, straight
    async with http.post(f"{url(real_fleet, owner)}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
    tokens = await engine_tokens(http, url(real_fleet, owner), body)
    await indexed(http, conductor, owner, tokens, BLOCK)
    routed_to, claimed, cached = await send()
    assert routed_to == owner and claimed == cached > 0
    before = await drift()
    async with http.post(f"{url(real_fleet, owner)}/reset_prefix_cache") as response:
        assert response.status == 200, await response.text()
    assert await send() == (owner, claimed, 0)  # promised, not there
    assert await drift() - before == claimed
    await eventually(send, lambda answer: answer == (owner, claimed, claimed))


@pytest.mark.parametrize(
    "case",
    [c for c in ROUTES if c["name"] not in NOT_COMPARED],
    ids=[f"{c['name']}-{c['scale_out']}" for c in ROUTES if c["name"] not in NOT_COMPARED],
)
async def test_the_captured_vllm_answers_still_hold(real_fleet, http, case):
    """The capture the simulator's parity tests compare against is still what the installed
    vLLM answers (vllm-a serves the scale-out routes, vllm-b does not)."""
    engine = url(real_fleet, "vllm-a" if case["scale_out"] else "vllm-b")
    body = case["body"]
    if "sse" in case:
        # greedy and to max_tokens: a sampled end-of-sequence token would end a stream with
        # fewer chunks than the capture (the tiny model's random weights sample it at times)
        case = {**case, "body": {**body, "temperature": 0, "ignore_eos": True}}
    assert_answers_like_vllm(await answer(http, engine, case, model=MODEL), case)


# -- the router's own tokenizer --------------------------------------------------------------
async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


# For every prompt its ids equal vLLM's ``/tokenize`` and the ids vLLM's serving path computed
# (``return_token_ids``), for completions and chat; the fleet's router, given the model
# directory, tokenizes in-process once the engine agreed. (The simulator's ``--tokenizer``
# runs this same code.)
async def test_completion_ids_equal_vllm(real_fleet, http, model_dir):
    engine = url(real_fleet, "vllm-a")
    local = LocalTokenizer.load(model_dir)
    for prompt in COMPLETIONS:
        for add_special_tokens in (True, False):
            body = {"model": MODEL, "prompt": prompt, "add_special_tokens": add_special_tokens}
            ours = local.prompt_ids(False, body)
            assert ours == (await _post(http, f"{engine}/tokenize", body))["tokens"]
            served = await _post(
                http,
                f"{engine}/v1/completions",
                body | {"max_tokens": 1, "return_token_ids": True},
            )
            assert ours == served["choices"][0]["prompt_token_ids"], prompt[:40]
    assert local.encoder is not None and local.encoder.fast is not None  # through tiktoken


async def test_chat_ids_equal_vllm(real_fleet, http, model_dir):
    engine = url(real_fleet, "vllm-a")
    local = LocalTokenizer.load(model_dir)
    for chat in CHATS:
        body = {"model": MODEL, **chat}
        ours = local.prompt_ids(True, body)
        assert ours == (await _post(http, f"{engine}/tokenize", body))["tokens"], chat
        served = await _post(
            http,
            f"{engine}/v1/chat/completions",
            body | {"max_tokens": 1, "return_token_ids": True},
        )
        assert ours == served["prompt_token_ids"], chat
    # the ids above came through tiktoken and the chunk cache, not HF
    assert local.encoder is not None and local.encoder.fast is not None
    assert local.encoder.stats.reused_tokens > 300


async def test_the_router_tokenizes_in_process_once_the_engine_agreed(real_fleet, http):
    router = url(real_fleet, "router")
    for path in ("completions", "chat"):
        gauge = f'router_local_tokenizer_active{{path="{path}"}}'
        await eventually(lambda g=gauge: metric(http, router, g), lambda v: v == 1)
    requests = [
        ("/v1/completions", {"prompt": COMPLETIONS[2]}),
        ("/v1/chat/completions", CHATS[1]),
    ]
    for path, body in requests:
        async with http.post(
            f"{router}{path}", json={"model": MODEL, "max_tokens": 1, **body}
        ) as response:
            assert response.status == 200, await response.text()
            assert response.headers["x-conductor-tokenized-by"] == "local"
            assert "x-conductor-fallback" not in response.headers


async def test_vllm_serves_the_routers_ids_as_it_serves_the_text(real_fleet, http):
    """``tokenizer.forward_token_ids``: a completion reaches vLLM as the router's ids, and
    vLLM sees the same prompt it makes of the text (ids, usage); with ``echo`` the text goes
    on as sent and comes back as sent."""
    router, engine = url(real_fleet, "router"), url(real_fleet, "vllm-a")
    gauge = 'router_local_tokenizer_active{path="completions"}'
    await eventually(lambda: metric(http, router, gauge), lambda v: v == 1)
    for prompt in (COMPLETIONS[3], COMPLETIONS[4]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "return_token_ids": True}
        routed = await _post(http, f"{router}/v1/completions", body)
        direct = await _post(http, f"{engine}/v1/completions", body)
        assert routed["choices"][0]["prompt_token_ids"] == direct["choices"][0]["prompt_token_ids"]
        assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    body = {"model": MODEL, "prompt": COMPLETIONS[1], "max_tokens": 1, "echo": True}
    echoed = await _post(http, f"{router}/v1/completions", body)
    assert echoed["choices"][0]["text"].startswith(COMPLETIONS[1])
