"""The conductor client under a slow conductor: a query past its timeout routes without it,
yet its answer is still read so that the connection serves the next query (before, every
timeout closed its connection and the next query paid a new one on both sides)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import msgpack
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from conductor.hashing import token_bytes
from router import conductor_client
from router.conductor_client import ConductorClient, ConductorUnavailable
from router.config import ConductorSection, PrefillModelConfig
from router.notices import Notices

ANSWER = {"default": {"e0": {"GPU": 32, "CPU": 32, "DISK": 32}}}


@dataclass
class SlowConductor:
    delay_s: float = 0.0
    connections: set[int] = field(default_factory=set)  # distinct client connections

    async def query(self, request: web.Request) -> web.Response:
        self.connections.add(id(request.transport))
        await request.read()
        await asyncio.sleep(self.delay_s)
        return web.Response(body=msgpack.packb(ANSWER), content_type="application/msgpack")


@pytest.fixture
async def slow() -> AsyncIterator[tuple[SlowConductor, str]]:
    conductor = SlowConductor()
    app = web.Application()
    app.router.add_post("/query", conductor.query)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield conductor, f"http://127.0.0.1:{server.port}"
    await server.close()


def client(session: aiohttp.ClientSession, url: str) -> ConductorClient:
    section = ConductorSection(address=url, query_timeout_seconds=0.1)
    model = PrefillModelConfig(modelname="m", block_size=16)
    return ConductorClient(session, section, model, Notices(logging.getLogger("test")))


async def test_a_late_answer_keeps_its_connection_for_the_next_query(slow):
    conductor, url = slow
    async with aiohttp.ClientSession() as session:
        queries = client(session, url)
        conductor.delay_s = 0.3
        with pytest.raises(ConductorUnavailable):
            await queries.query(token_bytes(list(range(64))))
        await asyncio.sleep(0.4)  # the late answer arrives and is read
        conductor.delay_s = 0.0
        assert await queries.query(token_bytes(list(range(64)))) == {"e0": (32, 32, 32)}
    assert len(conductor.connections) == 1


async def test_late_calls_are_bounded(slow, monkeypatch):
    conductor, url = slow
    monkeypatch.setattr(conductor_client, "MAX_LATE_CALLS", 2)
    conductor.delay_s = 0.5
    async with aiohttp.ClientSession() as session:
        queries = client(session, url)
        for _ in range(4):
            with pytest.raises(ConductorUnavailable):
                await queries.query(token_bytes(list(range(64))))
        await asyncio.sleep(0)
        assert len(queries._late) == 2  # the later ones were cut
