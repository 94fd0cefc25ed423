"""What the real-engine tests ask of the conductor and of vLLM itself."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Tokenizer

from tests.support.api import eventually, metric

MODEL = "tiny-llama"
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
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "block_size": block_size,
        "token_ids": tokens,
        "instance_id": instance,
    }
    if salt is not None:
        body["cache_salt"] = salt
    async with http.post(f"{conductor}/query", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    return answer.get("default", {}).get(instance, {"GPU": 0, "CPU": 0, "DISK": 0})


async def complete_tokens(
    http: aiohttp.ClientSession, engine: str, tokens: list[int], salt: str | None = None
) -> int:
    """Sends a token-id prompt straight to the engine; returns vLLM's cached-token count."""
    body: dict[str, Any] = {"model": MODEL, "prompt": tokens, "max_tokens": 1}
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
) -> None:
    """Until the conductor holds every complete block of a prompt the engine computed."""
    full = len(tokens) // block_size * block_size
    await eventually(
        lambda: conductor_hit(http, conductor, instance, tokens, block_size, salt),
        lambda hit: hit["GPU"] == full,
    )


async def assert_hits_match_vllm(
    http: aiohttp.ClientSession,
    conductor: str,
    engine: str,
    instance: str,
    prompts: list[list[int]],
    block_size: int,
    salt: str | None = None,
) -> int:
    """For each prompt: the conductor's GPU hit (less the block vLLM recomputes at a full
    hit) equals the cached tokens vLLM reports; the sum equals vLLM's own hit counter.
    Returns the tokens hit."""
    hits_before = await metric(http, engine, "vllm:prefix_cache_hits_total")
    total = 0
    for tokens in prompts:
        hit = await conductor_hit(http, conductor, instance, tokens, block_size, salt)
        predicted = min(hit["GPU"], (len(tokens) - 1) // block_size * block_size)
        cached = await complete_tokens(http, engine, tokens, salt)
        assert cached == predicted, f"vLLM reused {cached}, the conductor said {predicted}"
        total += cached
        await indexed(http, conductor, instance, tokens, block_size, salt)
    hits = await metric(http, engine, "vllm:prefix_cache_hits_total") - hits_before
    assert hits == total
    return total
