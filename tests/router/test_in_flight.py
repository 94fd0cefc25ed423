"""Prompts in flight count as cached where they were sent (router/pending.py): a request
sharing a prefix with one running (or just ended) goes after it, before the conductor knows;
the engine simulator's reported cached tokens show the prefix really was there."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from conductor.hashing import prefix_hashes, token_bytes
from router.config import RouterConfig
from router.pending import (
    MAX_PENDING_S,
    MAX_PER_FIRST_BLOCK,
    PendingPrefixes,
    common_prefix,
)
from tests.router.inprocess import MODEL, layout
from tests.support.api import eventually, metric
from tests.support.processes import ConductorProcess, EngineSim

PREFIX = list(range(1000, 1400))  # 100 blocks of 4


def test_common_prefix_is_the_shared_leading_run_of_chained_hashes():
    def chain(tokens: list[int]) -> list[int]:  # as the router hashes prompts: chained
        return list(prefix_hashes(token_bytes(tokens), 1, ""))

    assert common_prefix(chain([1, 2, 3, 4]), chain([1, 2, 9])) == 2
    assert common_prefix(chain([1, 2, 3]), chain([1, 2, 3, 4])) == 3
    assert common_prefix([], chain([1])) == 0 and common_prefix(chain([5]), chain([6])) == 0
    assert common_prefix(chain([5, 2, 3]), chain([6, 2, 3])) == 0  # a chain never re-agrees
    long = chain(list(range(10_000)))
    for cut in (0, 1, 4_999, 9_999, 10_000):
        other = chain([*range(cut), -1])
        assert common_prefix(long, other) == cut == common_prefix(other, long)


def test_pending_prompts_match_by_their_longest_shared_prefix():
    pending = PendingPrefixes()
    first = pending.add("a", [1, 2, 3, 4])
    pending.add("b", [1, 2])
    pending.add("b", [1, 2, 3, 7])
    assert pending.add("c", []) is None
    assert pending.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 3}
    assert pending.match([9, 2, 3]) == {} and pending.match([]) == {}
    assert first is not None
    pending.remove(first)
    pending.remove(first)  # once only
    assert pending.match([1, 2, 3, 4, 5]) == {"b": 3}
    assert len(pending) == 2


def test_only_the_latest_prompts_of_a_first_block_are_kept():
    pending = PendingPrefixes()
    for n in range(MAX_PER_FIRST_BLOCK + 10):
        pending.add(f"i{n}", [1, n + 2])
    assert len(pending) == MAX_PER_FIRST_BLOCK
    matches = pending.match([1, 12])
    assert matches["i10"] == 2 and "i9" not in matches and len(matches) == MAX_PER_FIRST_BLOCK


def test_finished_prompts_are_released_once_the_index_has_them():
    """Oldest first per instance: those that ended before the index's progress (at most
    MAX_PENDING_S after the end); where the conductor cannot say, after the grace."""
    pending = PendingPrefixes()
    prompts = {(name, at): pending.add(name, [at, 100 + at]) for name in "ab" for at in (1, 2, 3)}
    for (_, at), prompt in sorted(prompts.items(), key=lambda item: item[0][1]):
        assert prompt is not None
        pending.end(prompt, float(at))
    assert set(pending.awaiting_index()) == {"a", "b"}
    progress = {"a": 2.5, "b": None}
    pending.release_indexed(progress.get, now=4.0, grace_s=2.0)
    assert pending.match([3, 103]) == {"a": 2, "b": 2}  # a's 3 is not indexed, b's 3 young
    assert pending.match([1, 101]) == pending.match([2, 102]) == {}  # a: indexed; b: grace
    assert len(pending) == 2
    pending.release_indexed(progress.get, now=3.0 + MAX_PENDING_S, grace_s=2.0)
    assert len(pending) == 0 and not pending.ending and not pending.awaiting_index()


def test_an_instance_taken_out_of_rotation_loses_its_prompts():
    """Held or in flight: its process may have died and restarted with an empty cache."""
    pending = PendingPrefixes()
    held, running, other = (pending.add(name, [1, 2]) for name in ("a", "a", "b"))
    assert held is not None and running is not None
    pending.end(held, 1.0)
    pending.forget("a")
    assert pending.match([1, 2]) == {"b": 2} and not pending.awaiting_index()
    pending.end(running, 2.0)  # the request running there ends later: nothing to find
    pending.release_indexed(lambda _: 3.0, now=3.0, grace_s=2.0)
    assert pending.match([1, 2]) == {"b": 2} and len(pending) == 1


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[EngineSim]]:
    """Two engine simulators whose KV events reach nobody: the conductor knows nothing."""
    started = [EngineSim(tmp_path, name) for name in ("e0", "e1")]
    try:
        for engine in started:
            engine.wait_ready()
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(scope="module")
def conductor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConductorProcess]:
    process = ConductorProcess(Path(tmp_path_factory.mktemp("conductor")))
    process.wait_ready()
    yield process
    process.stop()


async def _send(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[dict, int]:
    """The router's headers and the tokens the engine reported cached."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
        return dict(response.headers), answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _first_then_second(http, url) -> tuple[dict, dict, int]:
    """The shared prefix; then, within the grace period, a longer prompt sharing it."""
    first, _ = await _send(http, url, PREFIX)
    second, cached = await _send(http, url, [*PREFIX, *range(50)])
    return first, second, cached


async def test_a_prompt_sharing_a_just_routed_ones_prefix_follows_it(
    serve, engines, conductor, http
):
    config = layout([e.url for e in engines], conductor={"address": conductor.url})
    router, url = await serve(config | {"routing": {"policy": "ttft"}})
    first, second, cached = await _first_then_second(http, url)
    assert first["x-conductor-cached-tokens"] == "0"
    assert "x-conductor-fallback" not in second  # the conductor answered: nothing indexed
    assert second["x-conductor-prefill-instance"] == first["x-conductor-prefill-instance"]
    assert second["x-conductor-cached-tokens"] == str(len(PREFIX)) == str(cached)
    assert await metric(http, url, "router_in_flight_hit_tokens_total") == len(PREFIX)
    assert router.pending is not None
    await eventually(lambda: asyncio.sleep(0, len(router.pending)), lambda n: n == 0, timeout=5)


async def test_an_engine_that_dies_is_not_credited_its_prompts(
    tmp_path, serve, engines, conductor, http
):
    """An engine that dies (and comes back empty) loses its in-flight prefixes as soon as
    the router takes it out of rotation, not when their grace ends: back on its port, it
    is credited nothing of what it held."""
    config = layout([e.url for e in engines], conductor={"address": conductor.url})
    config["upstream"] = {"metrics_interval_seconds": 0.1, "probe_interval_seconds": 0.2}
    routing = {"policy": "ttft", "in_flight_grace_seconds": 30}
    router, url = await serve(config | {"routing": routing})
    first, _ = await _send(http, url, PREFIX)
    assert router.pending is not None and len(router.pending) == 1
    name = first["x-conductor-prefill-instance"]
    died = next(e for e in engines if e.instance_id == name)
    died.stop()
    await eventually(lambda: asyncio.sleep(0, len(router.pending)), lambda n: n == 0, timeout=3)
    back = EngineSim(tmp_path, name, port=died.port)
    engines.append(back)  # stopped by the fixture
    back.wait_ready()
    await eventually(lambda: healthy(http, url), lambda names: name in names, timeout=5)
    second, cached = await _send(http, url, [*PREFIX, *range(50)])
    assert (second["x-conductor-cached-tokens"], cached) == ("0", 0)


async def healthy(http: aiohttp.ClientSession, url: str) -> list[str]:
    async with http.get(f"{url}/health") as response:
        return (await response.json())["prefill_instances"]


async def test_in_flight_prefixes_false_counts_the_conductor_alone(serve, engines, conductor, http):
    config = layout([e.url for e in engines], conductor={"address": conductor.url})
    routing = {"policy": "ttft", "in_flight_prefixes": False}
    router, url = await serve(config | {"routing": routing})
    assert router.pending is None
    first, second, _ = await _first_then_second(http, url)
    assert second["x-conductor-cached-tokens"] == "0"
    assert second["x-conductor-prefill-instance"] != first["x-conductor-prefill-instance"]


async def test_the_grace_after_the_end_is_configurable(serve, engines, conductor, http):
    """``routing.in_flight_grace_seconds`` (a conductor service; default 2 s): how long a
    finished prompt still counts; bounded, so a typo cannot pin stale prefixes."""
    config = layout([e.url for e in engines], conductor={"address": conductor.url})
    routing = {"policy": "ttft", "in_flight_grace_seconds": 0.2}
    router, url = await serve(config | {"routing": routing})
    assert router.pending is not None
    await _send(http, url, PREFIX)
    assert len(router.pending) == 1
    await eventually(lambda: asyncio.sleep(0, len(router.pending)), lambda n: n == 0, timeout=1.5)
    for bad in (0, 31):
        with pytest.raises(ValidationError, match="in_flight_grace_seconds"):
            RouterConfig.model_validate(config | {"routing": {"in_flight_grace_seconds": bad}})
