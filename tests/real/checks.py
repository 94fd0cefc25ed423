"""What the real-engine tests ask of the conductor, the router and the engines themselves
(vLLM or SGLang: both report a prompt's cached tokens in ``usage.prompt_tokens_details``)."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy
from tokenizers import Tokenizer

from tests.support.api import eventually, metric
from tests.support.processes import ConductorProcess

MODEL = "tiny-llama"
# each kind's counter of the prompt tokens it served from its prefix cache
HITS_METRIC = {"vllm": "vllm:prefix_cache_hits_total", "sglang": "sglang:cached_tokens_total"}
REGISTRATION_TYPE = {"vllm": "vLLM", "sglang": "SGLang"}  # what /register calls each kind
WORDS = (
    "cache prefix token block engine router latency memory tensor batch request model "
    "attention layer decode prefill index conductor store transfer fleet queue"
).split()


def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def documents(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Document {seed}-{d}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        for d in range(count)
    ]


def sharing_prompts(tok: Tokenizer, count: int, seed: int) -> list[list[int]]:
    """Token-id prompts that share long prefixes in varied ways (documents, then questions
    of varied length), so hits fall on and between block boundaries."""
    rng = random.Random(seed)
    docs = documents(3, 220, seed)
    prompts = []
    for i in range(count):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        prompts.append(tok.encode(f"{rng.choice(docs)}\nQuestion {i}: {question}?").ids)
    return prompts


async def conductor_hit(
    http: aiohttp.ClientSession,
    conductor: str,
    instance: str,
    tokens: list[int],
    block_size: int,
    salt: str | None = None,
    lora: str = "",
) -> dict[str, Any]:
    """The instance's hit in the base model's context, or in LoRA adapter ``lora``'s."""
    body: dict[str, Any] = {
        "model": MODEL,
        "block_size": block_size,
        "token_ids": tokens,
        "instance_id": instance,
        "lora_name": lora,
    }
    if salt is not None:
        body["cache_salt"] = salt
    async with http.post(f"{conductor}/query", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    return answer.get("default", {}).get(instance, {"GPU": 0, "CPU": 0, "DISK": 0})


async def complete_tokens(
    http: aiohttp.ClientSession,
    engine: str,
    tokens: list[int],
    salt: str | None = None,
    lora: str = "",
) -> int:
    """Sends a token-id prompt straight to the engine (to LoRA adapter ``lora`` if named);
    returns its cached-token count."""
    body: dict[str, Any] = {"model": lora or MODEL, "prompt": tokens, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    async with http.post(f"{engine}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def indexed(
    http: aiohttp.ClientSession,
    conductor: str,
    instance: str,
    tokens: list[int],
    block_size: int,
    salt: str | None = None,
    lora: str = "",
) -> None:
    """Until the conductor holds every complete block of a prompt the engine computed."""
    full = len(tokens) // block_size * block_size
    await eventually(
        lambda: conductor_hit(http, conductor, instance, tokens, block_size, salt, lora),
        lambda hit: hit["GPU"] == full,
    )


async def assert_hits_match_engine(
    http: aiohttp.ClientSession,
    conductor: str,
    engine: str,
    instance: str,
    prompts: list[list[int]],
    block_size: int,
    salt: str | None = None,
    *,
    kind: str,
    lora: str = "",
) -> int:
    """For each prompt: the conductor's GPU hit (less the block an engine recomputes at a
    full hit: vLLM and SGLang both compute a prompt's last token) equals the cached tokens
    the engine reports; the sum equals the engine's own hit counter. Returns the tokens
    hit. With ``lora``, the prompts go to that adapter and the hits are its context's."""
    hits_before = await metric(http, engine, HITS_METRIC[kind])
    total = 0
    for tokens in prompts:
        hit = await conductor_hit(http, conductor, instance, tokens, block_size, salt, lora)
        predicted = min(hit["GPU"], (len(tokens) - 1) // block_size * block_size)
        cached = await complete_tokens(http, engine, tokens, salt, lora)
        assert cached == predicted, f"{kind} reused {cached}, the conductor said {predicted}"
        total += cached
        await indexed(http, conductor, instance, tokens, block_size, salt, lora)
    await eventually(  # SGLang counts a request a moment after its answer
        lambda: metric(http, engine, HITS_METRIC[kind]), lambda hits: hits - hits_before == total
    )
    return total


async def assert_fleet_hits_match(
    http: aiohttp.ClientSession,
    fleet: Mapping[str, Any],
    instance: str,
    prompts: list[list[int]],
    block_size: int,
) -> int:
    """``assert_hits_match_engine`` for one engine of a running fleet, by its name."""
    return await assert_hits_match_engine(
        http,
        url(fleet, "conductor"),
        url(fleet, instance),
        instance,
        prompts,
        block_size,
        kind=fleet[instance]["kind"],
    )


def url(services: Mapping[str, Any], name: str) -> str:
    return services[name]["url"]


async def engine_tokens(
    http: aiohttp.ClientSession, engine: str, body: dict[str, Any]
) -> list[int]:
    """The prompt's token ids as the engine itself makes them (chat template included)."""
    request = {"model": body["model"]}
    if "messages" in body:
        request |= {"messages": body["messages"], "add_generation_prompt": True}
    else:
        request["prompt"] = body["prompt"]
    async with http.post(f"{engine}/tokenize", json=request) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["tokens"]


async def served(
    http: aiohttp.ClientSession, base: str, path: str, body: dict[str, Any]
) -> tuple[CIMultiDictProxy[str], int]:
    """(headers, cached tokens the engine reported), streamed or not; ``base`` is the
    router or an engine."""
    async with http.post(f"{base}{path}", json=body) as response:
        assert response.status == 200, await response.text()
        if not body.get("stream"):
            answer = await response.json()
            return response.headers, answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        usage = None
        async for line in response.content:
            text = line.decode().strip()
            if text.startswith("data: {") and '"usage"' in text:
                usage = json.loads(text[6:]).get("usage") or usage
        assert usage is not None, "no usage in the stream"
        return response.headers, usage["prompt_tokens_details"]["cached_tokens"]


def question_body(path: str, document: str, question: str, stream: bool) -> dict[str, Any]:
    """A completion or chat request: the shared document, then the question."""
    text = f"{document}\n{question}"
    payload: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    if path == "/v1/completions":
        return payload | {"prompt": text}
    return payload | {"messages": [{"role": "user", "content": text}]}


async def assert_router_follows_the_prefix(
    http: aiohttp.ClientSession,
    services: Mapping[str, Any],
    path: str,
    stream: bool,
    document: str,
    block_size: int,
    first_engine: str | None = None,
) -> str:
    """The document's first question goes through the router (or straight to
    ``first_engine``); once its blocks are indexed, the router sends each follow-up to the
    engine holding them, and its ``x-conductor-cached-tokens`` equals the cached tokens that
    engine reports. Returns that engine's name."""
    router, conductor = url(services, "router"), url(services, "conductor")
    first = question_body(path, document, "First question?", stream)
    headers, cached = await served(http, url(services, first_engine or "router"), path, first)
    owner = first_engine or headers["x-conductor-prefill-instance"]
    assert cached == 0
    if first_engine is None:
        assert headers["x-conductor-cached-tokens"] == "0"
    # the owner's events reach the conductor a moment after its answer; wait for this very
    # prompt's blocks (a count of all blocks may grow with another test's late events)
    tokens = await engine_tokens(http, url(services, owner), first)
    await indexed(http, conductor, owner, tokens, block_size)
    holders = {owner}
    for question in ("Second question?", "A third, rather longer question about caches?"):
        body = question_body(path, document, question, stream)
        for _ in range(3):  # two real engines share the CPU: a query may miss its timeout
            headers, cached = await served(http, router, path, body)
            if "x-conductor-fallback" not in headers:
                break
            holders.add(headers["x-conductor-prefill-instance"])  # it computed the prefix too
        decision = {k: v for k, v in headers.items() if k.lower().startswith("x-conductor-")}
        assert headers["x-conductor-prefill-instance"] in holders, decision  # why it went there
        assert int(headers["x-conductor-cached-tokens"]) == cached > 256
    return owner


async def assert_a_late_conductor_learns_the_buffer(
    http: aiohttp.ClientSession,
    services: Mapping[str, Any],
    instance: str,
    prompts: list[list[int]],
    block_size: int,
    run_dir: Path,
) -> None:
    """A second conductor, started after the engine computed ``prompts`` and sent no request
    since, registered to the engine's stream, fills its index from the engine's replay
    buffer alone, and answers as the fleet's conductor does."""
    engine = services[instance]
    allow = [engine["events_endpoint"], "127.0.0.1"]
    late = ConductorProcess(run_dir, config={"register_allow": allow})
    late.wait_ready()
    try:
        registration = {
            "endpoint": engine["events_endpoint"],
            "replay_endpoint": engine["replay_endpoint"],
            "type": REGISTRATION_TYPE[engine["kind"]],
            "modelname": MODEL,
            "block_size": block_size,
            "instance_id": instance,
        }
        async with http.post(f"{late.url}/register", json=registration) as response:
            assert response.status == 200, await response.text()
        fleet_conductor = url(services, "conductor")
        for tokens in prompts:
            await indexed(http, late.url, instance, tokens, block_size)
            assert await conductor_hit(http, late.url, instance, tokens, block_size) == (
                await conductor_hit(http, fleet_conductor, instance, tokens, block_size)
            )
    finally:
        late.stop()
