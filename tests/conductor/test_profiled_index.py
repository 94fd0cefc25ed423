"""A stream registered with a hash profile is indexed by the engine's own block hashes and
matched by hashing the query's tokens as the profile says, as upstream Mooncake's C++
conductor does (``mooncake-conductor/src/prefixindex/prefix_indexer.cpp`` and
``src/kvevent/event_handler.cpp``, branch ``dev/conductor``, 19ffa6e4a: event hashes taken
as given, an int as is, a byte string's last eight bytes big-endian; token ids and parents
not read). So an engine whose events carry no token ids is indexed. Real conductor
processes, real ZMQ publishers, real HTTP."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from conductor.api import MSGPACK
from conductor.dialect import TIERS_HEADER
from conductor.hash_profile import HashProfile
from conductor.sglang_hash import signed64
from tests.conductor.test_cpp_dialect import (
    PROFILE,
    PROMPT,
    mp_post,
    query_body,
    register_connected,
    tokens,
)
from tests.support.api import eventually, get, post
from tests.support.processes import ConductorProcess, EngineSim, free_port
from tests.support.wire_publisher import cleared, removed, stored

FIRST, SECOND, THIRD = HashProfile.model_validate(PROFILE).block_keys(PROMPT, 4)


def tokenless(event: dict[str, Any]) -> dict[str, Any]:
    """A BlockStored without its ``token_ids`` key, as upstream lets an engine send it."""
    return {key: value for key, value in event.items() if key != "token_ids"}


def as_digest(key: int) -> bytes:
    """A 32-byte digest whose last eight bytes, big-endian, are ``key``."""
    return os.urandom(24) + key.to_bytes(8, "big")


def hit(longest: int, ranks: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    """Upstream's per-instance answer, from each rank's cumulative (gpu, cpu, disk)."""
    tiers = [max(rank[tier] for rank in ranks.values()) for tier in range(3)]
    return {
        "longest_matched": longest,
        "dp": {rank: gpu for rank, (gpu, _, _) in ranks.items()},
        "rank_matches": {
            rank: dict(zip(("gpu", "cpu", "disk"), tiers_of, strict=True))
            for rank, tiers_of in ranks.items()
        },
        "gpu": tiers[0],
        "cpu": tiers[1],
        "disk": tiers[2],
    }


TIP_TIERS = {TIERS_HEADER: "gpu,cpu,disk"}  # the C++ tip's shape, as ``hit`` writes it


async def instances(http: aiohttp.ClientSession, base: str, **changes: Any) -> dict[str, Any]:
    status, answer, _ = await mp_post(http, f"{base}/query", query_body(**changes), TIP_TIERS)
    assert status == 200, answer
    return answer["instances"]


async def test_events_without_token_ids_index_and_queries_hash_the_tokens(
    conductor, http, publisher_factory
):
    """Instance ``a`` rank 0 stores blocks 0-1 on GPU (empty token ids) and block 2 on CPU
    (no token ids key); rank 1 stores block 0, its hash a 32-byte digest; ``b`` nothing.
    The msgpack /query with the prompt's tokens, the JSON one and /query_by_hash with the
    engine hashes all find it; removals and AllBlocksCleared take blocks away."""
    base = conductor.url
    rank0, rank1, idle = publisher_factory(), publisher_factory(), publisher_factory()
    await register_connected(http, base, rank0, "a")
    await register_connected(http, base, rank1, "a", dp_rank=1)
    await register_connected(http, base, idle, "b")
    await rank0.publish(
        [
            stored([FIRST, SECOND], []),
            tokenless(stored([THIRD], [], parent=SECOND, medium="CPU")),
        ]
    )
    await rank1.publish([tokenless(stored([as_digest(FIRST)], []))], dp_rank=1)

    expected = {
        "a": hit(12, {"0": (8, 12, 12), "1": (4, 4, 4)}),
        "b": hit(0, {"0": (0, 0, 0)}),
    }
    await eventually(lambda: instances(http, base), lambda found: found == expected)
    diverging = tokens([*PROMPT[:4], 99, 99, 99, 99, *PROMPT[8:]])
    assert (await instances(http, base, token_ids=diverging))["a"]["longest_matched"] == 4

    go_query = {"model": "m", "block_size": 4, "token_ids": PROMPT}
    status, go_answer = await post(http, f"{base}/query", go_query)
    assert status == 200
    assert go_answer["default"]["a"] == {
        "longest_matched": 12,
        "DP": {"0": 12, "1": 4},
        "GPU": 8,
        "CPU": 12,
        "DISK": 12,
    }
    by_hash = {"model": "m", "block_size": 4, "seq_hashes": [FIRST, SECOND, THIRD]}
    status, hash_answer, _ = await mp_post(http, f"{base}/query_by_hash", by_hash, TIP_TIERS)
    assert (status, hash_answer["instances"]) == (200, expected)

    await rank0.publish([removed([SECOND])])  # block 1 leaves rank 0's GPU: CPU can't bridge
    after_removal = {"a": hit(4, {"0": (4, 4, 4), "1": (4, 4, 4)}), "b": expected["b"]}
    await eventually(lambda: instances(http, base), lambda found: found == after_removal)

    await rank1.publish([cleared()], dp_rank=1)
    after_clear = {"a": hit(4, {"0": (4, 4, 4), "1": (0, 0, 0)}), "b": expected["b"]}
    await eventually(lambda: instances(http, base), lambda found: found == after_clear)
    await rank0.publish([cleared()])
    nothing = {"a": hit(0, {"0": (0, 0, 0), "1": (0, 0, 0)}), "b": expected["b"]}
    await eventually(lambda: instances(http, base), lambda found: found == nothing)


SGLANG_PROFILE = {"strategy": "sglang", "algorithm": "sha256_raw", "index_projection": "first64_be"}


def sglang_stored(keys: list[int], token_ids: list[int]) -> dict[str, Any]:
    """A BlockStored exactly as SGLang 0.5.23 publishes it: its keys as signed int64."""
    return {
        "type": "BlockStored",
        "block_hashes": [signed64(key) for key in keys],
        "parent_block_hash": None,
        "token_ids": token_ids,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
    }


async def test_an_sglang_profile_indexes_sglangs_own_hashes(conductor, http, publisher_factory):
    """Upstream's later revision lets an SGLang engine register ``strategy: "sglang"``: its
    events' hashes are the keys (token ids unread: here they are wrong on purpose), and a
    query's tokens are hashed with SGLang's chain, in either dialect."""
    base = conductor.url
    engine, idle = publisher_factory(), publisher_factory()
    sglang = {"type": "SGLang", "hash_profile": SGLANG_PROFILE}
    await register_connected(http, base, engine, "sgl-a", **sglang)
    await register_connected(http, base, idle, "sgl-b", **sglang)
    keys = list(HashProfile.model_validate(SGLANG_PROFILE).block_keys(PROMPT, 4))
    await engine.publish([sglang_stored(keys[:2], [7] * 8), sglang_stored(keys[2:], [7] * 4)])
    expected = {"sgl-a": hit(12, {"0": (12, 12, 12)}), "sgl-b": hit(0, {"0": (0, 0, 0)})}
    await eventually(lambda: instances(http, base), lambda found: found == expected)
    go_query = {"model": "m", "block_size": 4, "token_ids": PROMPT[:8]}
    status, answer = await post(http, f"{base}/query", go_query)
    assert (status, answer["default"]["sgl-a"]["longest_matched"]) == (200, 8)
    _, services = await get(http, f"{base}/services")
    profiles = {s["InstanceID"]: s["HashProfile"] for s in services["services"]}
    assert profiles["sgl-a"] == {**SGLANG_PROFILE, "python_hash_seed": "0", "root_digest": "0" * 64}


# -- against the engine simulator ------------------------------------------------------------
MODEL, BLOCK_SIZE = "m", 16
ENGINE_PROFILE = {**PROFILE, "algorithm": "sha256"}  # the other algorithm than above
FAMILY = "Plan a three day walking tour of Kyoto for a family with two young children. " * 4


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[EngineSim, str]]:
    """An engine simulator hashing as ``ENGINE_PROFILE`` says, binding its KV-event PUB."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    events = {"enable_kv_cache_events": True, "endpoint": endpoint}
    process = EngineSim(
        tmp_path,
        "engine-a",
        "--kv-events-config",
        json.dumps(events),
        "--sim-kv-bind",
        "--prefix-caching-hash-algo",
        ENGINE_PROFILE["algorithm"],
        model=MODEL,
        block_size=BLOCK_SIZE,
        env={"PYTHONHASHSEED": ENGINE_PROFILE["python_hash_seed"]},
    )
    try:
        process.wait_ready()
        yield process, endpoint
    finally:
        process.stop()


@pytest.fixture
def conductors(
    tmp_path: Path, engine: tuple[EngineSim, str]
) -> Iterator[dict[str, ConductorProcess]]:
    """Two conductors subscribed to the same engine: one with its hash profile, one without
    (indexing the Go way, by the events' token ids)."""
    _, endpoint = engine
    started: dict[str, ConductorProcess] = {}
    try:
        for name, profile in (("profiled", ENGINE_PROFILE), ("plain", None)):
            entry = {
                "endpoint": endpoint,
                "type": "vLLM",
                "modelname": MODEL,
                "instance_id": "engine-a",
                "block_size": BLOCK_SIZE,
                "dp_rank": 0,
                "hash_profile": profile,
            }
            config = {"kvevent_instance": {"engine-a": entry}}
            directory = tmp_path / name
            directory.mkdir()
            started[name] = ConductorProcess(directory, config=config)
            started[name].wait_ready()
        yield started
    finally:
        for process in started.values():
            process.stop()


async def connected(http: aiohttp.ClientSession, conductor: ConductorProcess) -> None:
    async def states() -> list[str]:
        _, answer = await get(http, f"{conductor.url}/services")
        return [service["State"] for service in answer["services"]]

    await eventually(states, lambda found: found == ["connected"])


async def engine_tokens(http: aiohttp.ClientSession, engine: EngineSim, prompt: str) -> list[int]:
    body = {"model": MODEL, "prompt": prompt}
    async with http.post(f"{engine.url}/tokenize", json=body) as response:
        assert response.status == 200
        return list((await response.json())["tokens"])


async def complete(http: aiohttp.ClientSession, engine: EngineSim, prompt: str) -> int:
    """Serve ``prompt`` on the engine; its own count of cached prompt tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    async with http.post(f"{engine.url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return int((await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"])


async def both_answers(
    http: aiohttp.ClientSession, conductors: dict[str, ConductorProcess], prompt: list[int]
) -> dict[str, Any]:
    """Each conductor's msgpack and JSON answers for ``prompt``."""
    answers: dict[str, Any] = {}
    packed = msgpack.packb({"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": tokens(prompt)})
    for name, conductor in conductors.items():
        async with http.post(
            f"{conductor.url}/query", data=packed, headers={"Content-Type": MSGPACK}
        ) as response:
            answers[f"{name} msgpack"] = msgpack.unpackb(await response.read())
        body = {"model": MODEL, "block_size": BLOCK_SIZE, "token_ids": prompt}
        answers[f"{name} json"] = (await post(http, f"{conductor.url}/query", body))[1]
    return answers


async def test_a_profiled_context_answers_as_the_token_indexed_one_and_the_engine(
    engine, conductors, http
):
    """The same engine's events indexed by its hashes (profiled) and by its token ids
    (plain) give equal answers in both dialects, and the hit is what the engine then finds
    cached for that prompt."""
    process, _ = engine
    for conductor in conductors.values():
        await connected(http, conductor)
    first, then = FAMILY + "First question?", FAMILY + "Second one, longer."
    first_tokens, then_tokens = [await engine_tokens(http, process, p) for p in (first, then)]
    common = next(
        i for i, (x, y) in enumerate(zip(first_tokens, then_tokens, strict=False)) if x != y
    )
    shared = common // BLOCK_SIZE * BLOCK_SIZE
    assert shared >= 4 * BLOCK_SIZE
    await complete(http, process, first)

    def agree(answers: dict[str, Any]) -> bool:
        msgpack_hits = {answers[f"{n} msgpack"]["instances"]["engine-a"]["gpu"] for n in conductors}
        json_hits = {answers[f"{n} json"]["default"]["engine-a"]["GPU"] for n in conductors}
        return msgpack_hits == json_hits == {shared}

    answers = await eventually(lambda: both_answers(http, conductors, then_tokens), agree)
    assert answers["profiled msgpack"] == answers["plain msgpack"]
    assert answers["profiled json"] == answers["plain json"]
    assert await complete(http, process, then) == shared
