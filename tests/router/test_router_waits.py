"""How long a router process waits on an engine that accepted a request and says nothing:
a stream's headers within ``stream_headers_timeout_seconds`` (vLLM sends them before the
first token), and not a moment longer once the router has found the engine dead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.router.inprocess import MODEL, layout
from tests.support.api import eventually, metric
from tests.support.processes import EngineSim, RouterProcess


@dataclass
class SilentEngine:
    """An "engine" on 127.0.0.1 that accepts connections and never sends a byte (a hung
    process); ``stop_listening`` closes its port but keeps the connections it holds open,
    as an engine whose host died leaves them."""

    url: str = ""
    server: asyncio.Server | None = None
    held: list[asyncio.StreamWriter] = field(default_factory=list)

    def hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.held.append(writer)  # read nothing, answer nothing, close nothing

    def stop_listening(self) -> None:
        assert self.server is not None
        self.server.close()  # Python 3.11: the connections it accepted stay open


@pytest.fixture
async def silent() -> AsyncIterator[SilentEngine]:
    engine = SilentEngine()
    engine.server = await asyncio.start_server(engine.hold, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{engine.server.sockets[0].getsockname()[1]}"
    yield engine
    engine.stop_listening()
    for writer in engine.held:
        writer.close()


@pytest.fixture
def working(tmp_path: Path) -> Iterator[EngineSim]:
    engine = EngineSim(tmp_path, "e1", model=MODEL)
    engine.wait_ready()
    yield engine
    engine.stop()


def start_router(
    routers: Callable[..., RouterProcess], urls: list[str], **upstream: float
) -> RouterProcess:
    """A router process over ``urls`` (e0, e1...); no conductor: it routes by load, so the
    first request goes to e0 (ties rotate from the first instance)."""
    router = routers(layout(urls, upstream=upstream))
    router.wait_ready()
    return router


async def timed_completion(
    http: aiohttp.ClientSession, url: str, stream: bool
) -> tuple[float, int, str, bytes]:
    # token ids: no engine's /tokenize is asked (the silent one would hold that too)
    request = {"model": MODEL, "prompt": [11, 12, 13, 14, 15], "max_tokens": 3, "stream": stream}
    started = time.monotonic()
    async with http.post(f"{url}/v1/completions", json=request) as response:
        body = await response.read()
        instance = response.headers.get("x-conductor-prefill-instance", "")
        return time.monotonic() - started, response.status, instance, body


async def test_a_stream_without_headers_in_time_goes_to_the_next_engine(
    silent, working, routers, http
):
    router = start_router(
        routers,
        [silent.url, working.url],
        stream_headers_timeout_seconds=1.0,
        first_byte_timeout_seconds=60,
    )
    elapsed, status, instance, body = await timed_completion(http, router.url, stream=True)
    assert (status, instance) == (200, "e1") and body.endswith(b"data: [DONE]\n\n")
    assert 1.0 <= elapsed < 3.0  # the headers timeout, not the first-byte one
    stage = 'router_upstream_timeouts_total{instance="e0",stage="stream_headers"}'
    assert await metric(http, router.url, stage) == 1
    assert "sent no stream headers within 1.0s" in router.log()


async def test_a_request_waiting_on_an_engine_found_dead_moves_on_at_once(
    silent, working, routers, http
):
    router = start_router(
        routers,
        [silent.url, working.url],
        first_byte_timeout_seconds=60,
        metrics_interval_seconds=0.2,
        control_timeout_seconds=0.3,
    )
    waiting = asyncio.create_task(timed_completion(http, router.url, stream=False))
    in_flight = 'router_in_flight_requests{instance="e0"}'
    await eventually(lambda: metric(http, router.url, in_flight), lambda n: n == 1)
    silent.stop_listening()  # its next /metrics scrape is refused: out of rotation
    stopped = time.monotonic()
    elapsed, status, instance, _ = await asyncio.wait_for(waiting, timeout=10)
    assert (status, instance) == (200, "e1")
    assert time.monotonic() - stopped < 3.0  # not the 60 s first-byte timeout
    assert await metric(http, router.url, 'router_retries_total{instance="e0"}') == 1
    assert "upstream instance=e0 out of rotation: /metrics: ClientConnectorError" in router.log()
