"""Our conductor driven as upstream Mooncake's example cache-aware P/D proxy drives its C++
conductor (``mooncake-conductor/example/cache_aware_disagg_proxy.py``, its sample
``cache_aware_proxy_config.json`` and README; branch ``dev/conductor``, commit 19ffa6e4a):
msgpack ``/register`` per stream with a hash profile, ``/tokenize`` on a prefill engine, a
msgpack ``/query`` with the tokens packed as int32, and the prefill chosen from the answer's
``instances`` (``tests.support.upstream_proxy`` behaves as that proxy does).

Two engine simulators publish vLLM KV events hashed as the profile says (``sha256_cbor``,
PYTHONHASHSEED=0). The conductor starts from an upstream-style config file: either empty,
as upstream's README runs it (the proxy registers every stream), or listing the same streams
with their hash profile and a null cache group, beside an ``rpc_server_port`` (the proxy
then registers them again, which must succeed). Either way a prompt whose prefix one engine
holds is sent there by cache, not by a fallback, and that engine's own usage confirms the
hit."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.api import eventually, get
from tests.support.processes import ConductorProcess, EngineSim, free_port
from tests.support.upstream_proxy import (
    HASH_PROFILE,
    Choice,
    Prefill,
    PrefillPool,
    UpstreamProxy,
)

MODEL = "m"
BLOCK_SIZE = 16  # the sample config's
POOL = PrefillPool(MODEL, BLOCK_SIZE)
A, B = "prefill-a", "prefill-b"
# prompts of one family share ~90 tokens (5 blocks), then differ; families share nothing
FAMILIES = {
    A: "Plan a three day walking tour of Kyoto for a family with two young children. " * 4,
    B: "Summarize the quarterly revenue report and list every risk the auditors named. " * 4,
    "both": "Translate each of the following sentences into formal German, keeping names. " * 4,
}


def request_id() -> str:
    return str(uuid.uuid4())  # as the proxy makes one per request


def completion(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}


@pytest.fixture
def prefills(tmp_path: Path) -> Iterator[list[Prefill]]:
    """Two engine simulators hashing blocks as the profile says, each binding its KV-event
    PUB on a port of its own (no replay endpoint: the proxy registers none)."""
    engines: list[EngineSim] = []
    prefills = []
    try:
        for name in (A, B):
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            events = {"enable_kv_cache_events": True, "endpoint": endpoint}
            engine = EngineSim(
                tmp_path,
                name,
                "--kv-events-config",
                json.dumps(events),
                "--sim-kv-bind",
                "--prefix-caching-hash-algo",
                HASH_PROFILE["algorithm"],
                "--num-gpu-blocks-override",
                "512",
                model=MODEL,
                block_size=BLOCK_SIZE,
                env={"PYTHONHASHSEED": HASH_PROFILE["python_hash_seed"]},
            )
            engines.append(engine)
            engine.wait_ready()
            prefills.append(Prefill(name, engine.url, ((endpoint, 0),)))
        yield prefills
    finally:
        for engine in engines:
            engine.stop()


def upstream_config(port: int, prefills: list[Prefill]) -> dict[str, Any]:
    """A ``conductor_config.json`` in the C++ conductor's layout, listing ``prefills``'
    streams as the proxy registers them (so its registrations repeat these exactly)."""
    entries = {
        f"{prefill.instance_id}-rank{dp_rank}": {
            "endpoint": endpoint,
            "type": "vLLM",
            "modelname": MODEL,
            "lora_name": "",
            "tenant_id": "default",
            "instance_id": prefill.instance_id,
            "block_size": BLOCK_SIZE,
            "dp_rank": dp_rank,
            "cache_group": None,
            "hash_profile": HASH_PROFILE,
        }
        for prefill in prefills
        for endpoint, dp_rank in prefill.registrations
    }
    return {"http_server_port": port, "rpc_server_port": free_port(), "kvevent_instance": entries}


@pytest.fixture(params=["streams_registered_by_proxy", "streams_in_config_file"])
def conductor(
    request: pytest.FixtureRequest, tmp_path: Path, prefills: list[Prefill]
) -> Iterator[ConductorProcess]:
    port = free_port()
    listed = prefills if request.param == "streams_in_config_file" else []
    process = ConductorProcess(tmp_path, config=upstream_config(port, listed), port=port)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


async def wait_connected(
    http: aiohttp.ClientSession, conductor: ConductorProcess, prefills: list[Prefill]
) -> None:
    """Until the conductor's SUB socket reaches every stream (events sent before are lost:
    the proxy registers no replay endpoint)."""
    endpoints = {endpoint for prefill in prefills for endpoint, _ in prefill.registrations}

    async def states() -> dict[str, str]:
        _, answer = await get(http, f"{conductor.url}/services")
        return {service["Endpoint"]: service["State"] for service in answer["services"]}

    await eventually(states, lambda found: found == dict.fromkeys(endpoints, "connected"))


async def shared_tokens(proxy: UpstreamProxy, first: str, then: str) -> int:
    """The tokens of whole blocks that prompt ``then`` shares with ``first``."""
    prefill = next(iter(proxy.prefills.values()))
    a, b = [await proxy.tokenize(prefill, completion(p), request_id()) for p in (first, then)]
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return common // BLOCK_SIZE * BLOCK_SIZE


async def serve_directly(http: aiohttp.ClientSession, prefill: Prefill, prompt: str) -> None:
    """The prompt computed on one engine, bypassing the proxy (its blocks become events)."""
    body = completion(prompt) | {"stream": False}
    async with http.post(f"{prefill.http_endpoint}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


async def wait_indexed(proxy: UpstreamProxy, prompt: str, holders: dict[str, int]) -> None:
    """Until the conductor's msgpack ``/query`` for ``prompt`` answers ``longest_matched``
    as ``holders`` says, for each instance named."""
    prefill = next(iter(proxy.prefills.values()))

    async def matched() -> dict[str, Any]:
        request = completion(prompt)
        tokens = await proxy.tokenize(prefill, request, request_id())
        instances = (await proxy.query(request, tokens, request_id())).get("instances", {})
        return {name: instances.get(name, {}).get("longest_matched") for name in holders}

    await eventually(matched, lambda found: found == holders)


async def test_the_proxy_routes_each_prompt_to_the_engine_holding_its_prefix(
    conductor: ConductorProcess, prefills: list[Prefill], http: aiohttp.ClientSession
) -> None:
    proxy = UpstreamProxy(http, conductor.url, POOL, prefills)
    by_id = {prefill.instance_id: prefill for prefill in prefills}
    await proxy.register_all()  # raises unless each answer is the C++ conductor's success
    await wait_connected(http, conductor, prefills)

    # nothing cached yet: every instance answers 0, and the proxy falls back
    cold = await proxy.choose_prefill(completion(FAMILIES[A]), request_id())
    assert cold == Choice(A, "all_cache_hits_zero", {A: 0, B: 0})

    for owner, other in ((A, B), (B, A)):
        first, then = FAMILIES[owner] + "First question?", FAMILIES[owner] + "Second one!"
        shared = await shared_tokens(proxy, first, then)
        assert shared >= 4 * BLOCK_SIZE
        await serve_directly(http, by_id[owner], first)
        await wait_indexed(proxy, then, {owner: shared, other: 0})

        request = completion(then)
        choice = await proxy.choose_prefill(request, request_id())
        assert choice == Choice(owner, None, {owner: shared, other: 0})
        answer = await proxy.prefill(choice.instance_id, "/v1/completions", request, request_id())
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
        assert answer["kv_transfer_params"]["do_remote_prefill"] is True  # for the decode side

    # a prefix both engines hold: the proxy takes the leaders in turn
    first, then = FAMILIES["both"] + "Guten Tag.", FAMILIES["both"] + "Auf Wiedersehen."
    shared = await shared_tokens(proxy, first, then)
    for prefill in prefills:
        await serve_directly(http, prefill, first)
    await wait_indexed(proxy, then, {A: shared, B: shared})
    turns = [await proxy.choose_prefill(completion(then), request_id()) for _ in range(3)]
    assert [choice.instance_id for choice in turns] == [A, B, A]
    assert {choice.fallback for choice in turns} == {None}
