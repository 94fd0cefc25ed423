"""A LoRA adapter's KV events from real vLLM 0.32 (``tests/fixtures/vllm_lora_frames.json``,
``scripts/capture-vllm-lora-frames.py``), sent byte for byte over a real ZMQ PUB socket to
a conductor process.

vLLM serves the base model and its adapters from one engine, so one event stream carries
both; the router registers it once, for the base model (``lora_name`` ""). An adapter's
``BlockStored`` names the adapter (``lora_name``; ``extra_keys`` repeats it per block, with
a request's cache salt after it on block 0) and its hashes differ from the base model's for
the same tokens. The conductor files each event under the context its ``lora_name`` names,
so ``/query`` with the adapter's ``lora_name`` sees the adapter's blocks and a query
without one sees the base model's only. The hits asserted are the cached tokens vLLM itself
reported for the same requests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from conductor.vllm_hash import block_keys, low64_be, none_hash, pickled
from tests.conductor.test_cpp_dialect import mp_post, tokens
from tests.support.api import eventually, matched, register_and_connect
from tests.support.wire_publisher import WirePublisher, removed

FIXTURE = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "vllm_lora_frames.json").read_text()
)
ADAPTER, BASE = FIXTURE["lora"]["name"], FIXTURE["base_model"]
BLOCK_SIZE = FIXTURE["block_size"]
STEPS: list[dict[str, Any]] = FIXTURE["steps"]
ADAPTER_FIRST, ADAPTER_REPEAT, ADAPTER_EXTENDED, BASE_FIRST, BASE_REPEAT, ADAPTER_SALTED = STEPS
PROMPT, EXTENDED = ADAPTER_FIRST["prompt"], ADAPTER_EXTENDED["prompt"]
SALT = ADAPTER_SALTED["cache_salt"]
INSTANCE = "vllm-lora"


def cached(step: dict[str, Any]) -> int:
    """The prompt tokens vLLM served from its prefix cache for this step's request."""
    return step["usage"]["prompt_tokens_details"]["cached_tokens"]


def stored_hashes(step: dict[str, Any]) -> list[int]:
    return [
        block
        for frame in step["frames"]
        for event in frame["decoded"][1]
        if event["type"] == "BlockStored"
        for block in event["block_hashes"]
    ]


async def send_frames(publisher: WirePublisher, *steps: dict[str, Any]) -> None:
    """The steps' frames exactly as vLLM published them (topic, sequence, payload), kept in
    the publisher's replay buffer as vLLM keeps them."""
    for step in steps:
        for frame in step["frames"]:
            seq, payload = frame["seq"], bytes.fromhex(frame["payload"])
            publisher.buffer.append((seq, payload))
            publisher.next_seq = seq + 1
            await publisher.send_raw([frame["topic"].encode(), seq.to_bytes(8, "big"), payload])


async def hit(
    http: aiohttp.ClientSession, base: str, prompt: list[int], lora: str = "", **fields: Any
) -> int:
    """The instance's hit for ``prompt`` in the base model's context or the adapter's."""
    context = {"model": BASE, "block_size": BLOCK_SIZE, "lora_name": lora, **fields}
    return await matched(http, base, prompt, INSTANCE, **context)


async def registered_publisher(http, base: str, publisher_factory) -> WirePublisher:
    """vLLM's one stream, registered for the base model as the router registers it."""
    publisher = publisher_factory(topic=b"kv-events")
    await register_and_connect(
        http, base, publisher, INSTANCE, modelname=BASE, block_size=BLOCK_SIZE, lora_name=""
    )
    return publisher


def test_the_fixture_says_what_vllm_does_with_an_adapter() -> None:
    """What the tests below build on, as captured: the adapter's events name it (and its
    deprecated ``lora_id``), ``extra_keys`` holds its name per block (and the salt after it
    on block 0), and its hashes for the prompt differ from the base model's."""
    adapter_events = [e for f in ADAPTER_FIRST["frames"] for e in f["decoded"][1]]
    assert {(e["lora_name"], e["lora_id"]) for e in adapter_events} == {
        (ADAPTER, FIXTURE["lora"]["lora_id"])
    }
    assert [e["extra_keys"] for e in adapter_events] == [[[ADAPTER]] * 3]
    salted = ADAPTER_SALTED["frames"][0]["decoded"][1][0]["extra_keys"]
    assert salted == [[ADAPTER, SALT], [ADAPTER], [ADAPTER]]
    base_events = [e for f in BASE_FIRST["frames"] for e in f["decoded"][1]]
    assert {(e["lora_name"], e["lora_id"]) for e in base_events} == {(None, None)}
    assert not set(stored_hashes(ADAPTER_FIRST)) & set(stored_hashes(BASE_FIRST))
    assert cached(ADAPTER_REPEAT) == cached(BASE_REPEAT) == 96 and cached(BASE_FIRST) == 0


def test_an_adapters_hashes_chain_its_name_and_path() -> None:
    """vLLM 0.31+ hashes ``("lora", name, path)`` into every adapter block: the fixture's
    hashes are that chain (sha256 over pickle, PYTHONHASHSEED "0"). The name alone, which is
    all a query carries (upstream's untagged key, what a profiled context hashes a query
    with), gives other hashes: an adapter's blocks in a profiled context answer no query."""
    algorithm, seed = FIXTURE["hash_algorithm"], FIXTURE["python_hash_seed"]
    extras = (("lora", ADAPTER, FIXTURE["lora"]["path"]),)
    parent, chained = none_hash(algorithm, seed), []
    for start in range(0, len(EXTENDED) // BLOCK_SIZE * BLOCK_SIZE, BLOCK_SIZE):
        block = tuple(EXTENDED[start : start + BLOCK_SIZE])
        parent = hashlib.sha256(pickled((parent, block, extras))).digest()
        chained.append(low64_be(parent))
    assert chained == stored_hashes(ADAPTER_FIRST) + stored_hashes(ADAPTER_EXTENDED)
    by_name = block_keys(algorithm, seed, EXTENDED, BLOCK_SIZE, ADAPTER)
    assert not set(by_name) & set(chained)
    base = block_keys(algorithm, seed, PROMPT, BLOCK_SIZE)
    assert list(base) == stored_hashes(BASE_FIRST)


async def test_adapter_and_base_blocks_stay_in_their_own_contexts(
    conductor, http, publisher_factory
):
    """One stream registered for the base model: the adapter's events land in the
    adapter's context, the base model's in the base context, and neither counts the
    other's blocks. Each hit is what vLLM reported for the same prompt."""
    publisher = await registered_publisher(http, conductor.url, publisher_factory)
    await send_frames(publisher, ADAPTER_FIRST, ADAPTER_REPEAT, ADAPTER_EXTENDED)
    await eventually(lambda: hit(http, conductor.url, EXTENDED, ADAPTER), lambda n: n == 128)
    assert await hit(http, conductor.url, PROMPT, ADAPTER) == cached(ADAPTER_REPEAT)
    assert await hit(http, conductor.url, PROMPT) == cached(BASE_FIRST) == 0

    await send_frames(publisher, BASE_FIRST, BASE_REPEAT)
    await eventually(lambda: hit(http, conductor.url, PROMPT), lambda n: n == cached(BASE_REPEAT))
    assert await hit(http, conductor.url, EXTENDED) == 96  # the base model has three blocks
    assert await hit(http, conductor.url, EXTENDED, ADAPTER) == 128  # the adapter four
    assert await hit(http, conductor.url, PROMPT, "another-adapter") == 0


async def test_a_salted_adapter_request_is_its_own_namespace(conductor, http, publisher_factory):
    """Block 0's extra keys ``[adapter, salt]``: the salt is the salt, not the adapter's
    name; the salted blocks answer a query naming both, and only that."""
    publisher = await registered_publisher(http, conductor.url, publisher_factory)
    await send_frames(publisher, ADAPTER_FIRST, ADAPTER_REPEAT, ADAPTER_EXTENDED, BASE_FIRST)
    await send_frames(publisher, BASE_REPEAT, ADAPTER_SALTED)
    salted = {"cache_salt": SALT}
    await eventually(lambda: hit(http, conductor.url, PROMPT, ADAPTER, **salted), lambda n: n == 96)
    assert await hit(http, conductor.url, PROMPT, **salted) == 0  # the base model's: unsalted
    assert await hit(http, conductor.url, PROMPT, ADAPTER) == 96  # the unsalted blocks


async def test_an_evicted_adapter_block_leaves_the_adapters_context(
    conductor, http, publisher_factory
):
    """vLLM's ``BlockRemoved`` names no adapter, only hashes: removing the adapter's fourth
    block takes it from the adapter's context and leaves the base model's blocks alone."""
    publisher = await registered_publisher(http, conductor.url, publisher_factory)
    await send_frames(publisher, *STEPS[:5])
    await eventually(lambda: hit(http, conductor.url, PROMPT), lambda n: n == 96)
    await publisher.publish([removed(stored_hashes(ADAPTER_EXTENDED))])
    await eventually(lambda: hit(http, conductor.url, EXTENDED, ADAPTER), lambda n: n == 96)
    assert await hit(http, conductor.url, PROMPT) == 96


@pytest.mark.parametrize(
    ("lora", "expected"), [(ADAPTER, 128), ("", 96)], ids=["adapter", "base_model"]
)
async def test_a_msgpack_query_names_the_adapter_as_json_does(
    conductor, http, publisher_factory, lora, expected
):
    """Upstream C++'s dialect: the same ``lora_name`` field picks the context."""
    publisher = await registered_publisher(http, conductor.url, publisher_factory)
    await send_frames(publisher, *STEPS[:5])
    await eventually(lambda: hit(http, conductor.url, PROMPT), lambda n: n == 96)
    body = {
        "model": BASE,
        "block_size": BLOCK_SIZE,
        "token_ids": tokens(EXTENDED),
        "tenant_id": "default",
        "lora_name": lora,
    }
    status, answer, _ = await mp_post(http, f"{conductor.url}/query", body)
    assert status == 200, answer
    assert answer["instances"][INSTANCE]["longest_matched"] == expected
