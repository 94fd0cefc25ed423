"""Prompts in flight count as cached where they were sent (router/pending.py): a request
sharing a prefix with one still running goes after it, before the conductor knows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from router.pending import MAX_PER_FIRST_BLOCK, PendingPrefixes, common_prefix
from tests.router.inprocess import MODEL, layout
from tests.support.api import eventually, metric
from tests.support.processes import ConductorProcess

PREFIX = list(range(1000, 1400))  # 100 blocks of 4


def test_common_prefix_is_the_shared_leading_run():
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0
    long = list(range(10_000))
    for cut in (0, 1, 4_999, 9_999):
        assert common_prefix(long, [*long[:cut], -1]) == cut


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
    assert pending.match([1, 2, 3, 4, 5]) == {"b": 3}
    assert len(pending) == 2


def test_only_the_latest_prompts_of_a_first_block_are_kept():
    pending = PendingPrefixes()
    for n in range(MAX_PER_FIRST_BLOCK + 10):
        pending.add(f"i{n}", [1, n + 2])
    assert len(pending) == MAX_PER_FIRST_BLOCK
    matches = pending.match([1, 12])
    assert matches["i10"] == 2 and "i9" not in matches and len(matches) == MAX_PER_FIRST_BLOCK


class HeldEngine:
    """An engine that answers a completion only once the test lets it."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0
        self.url = ""

    async def _complete(self, request: web.Request) -> web.Response:
        self.received += 1
        await request.read()
        await self.release.wait()
        return web.json_response({"choices": [{"text": "ok"}]})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self._complete),
                web.get("/v1/models", self._models),
                web.get("/health", self._models),
                web.get("/metrics", self._metrics),
            ]
        )
        return app


@pytest.fixture
async def engines() -> AsyncIterator[list[HeldEngine]]:
    held = [HeldEngine(), HeldEngine()]
    servers = []
    for engine in held:
        server = TestServer(engine.app(), host="127.0.0.1")
        await server.start_server()
        engine.url = f"http://127.0.0.1:{server.port}"
        servers.append(server)
    yield held
    for engine in held:
        engine.release.set()
    for server in servers:
        await server.close()


@pytest.fixture(scope="module")
def conductor(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ConductorProcess]:
    process = ConductorProcess(Path(tmp_path_factory.mktemp("conductor")))
    process.wait_ready()
    yield process
    process.stop()


async def _send(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict[str, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with http.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return dict(response.headers)


async def _first_then_second(http, url, engines) -> tuple[dict[str, str], dict[str, str]]:
    """The shared prefix, held on its engine; then a longer prompt sharing it."""
    first = asyncio.create_task(_send(http, url, PREFIX))
    await eventually(lambda: asyncio.sleep(0, sum(e.received for e in engines)), lambda n: n == 1)
    second = asyncio.create_task(_send(http, url, [*PREFIX, *range(50)]))
    await eventually(lambda: asyncio.sleep(0, sum(e.received for e in engines)), lambda n: n == 2)
    for engine in engines:
        engine.release.set()
    return await first, await second


async def test_a_prompt_sharing_a_running_ones_prefix_follows_it(serve, engines, conductor, http):
    config = layout([e.url for e in engines], conductor={"address": conductor.url})
    router, url = await serve(config | {"routing": {"policy": "ttft"}})
    first, second = await _first_then_second(http, url, engines)
    assert first["x-conductor-cached-tokens"] == "0"
    assert "x-conductor-fallback" not in second  # the conductor answered: nothing indexed
    assert second["x-conductor-prefill-instance"] == first["x-conductor-prefill-instance"]
    assert second["x-conductor-cached-tokens"] == str(len(PREFIX))
    assert await metric(http, url, "router_in_flight_hit_tokens_total") == len(PREFIX)
    assert router.pending is not None
    await eventually(lambda: asyncio.sleep(0, len(router.pending)), lambda n: n == 0, timeout=5)


async def test_in_flight_prefixes_false_counts_the_conductor_alone(serve, engines, conductor, http):
    config = layout([e.url for e in engines], conductor={"address": conductor.url})
    routing = {"policy": "ttft", "in_flight_prefixes": False}
    router, url = await serve(config | {"routing": routing})
    assert router.pending is None
    first, second = await _first_then_second(http, url, engines)
    assert second["x-conductor-cached-tokens"] == "0"
    assert second["x-conductor-prefill-instance"] != first["x-conductor-prefill-instance"]
