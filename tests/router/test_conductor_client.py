"""The conductor client under a slow conductor: a query past its timeout routes without it,
yet its answer is still read so that the connection serves the next query (before, every
timeout closed its connection and the next query paid a new one on both sides)."""

from __future__ import annotations

import asyncio
import json
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
from router.config import ConductorSection
from router.index_client import IndexContext
from router.notices import Notices
from router.pool import InstancePool

ANSWER = {"default": {"e0": {"GPU": 32, "CPU": 32, "DISK": 32}}}


@dataclass
class SlowConductor:
    delay_s: float = 0.0
    connections: set[int] = field(default_factory=set)  # distinct client connections
    progress_asked: list[list[str]] = field(default_factory=list)
    hits_only: list[str | None] = field(default_factory=list)  # each query's header
    indexed_until: str | None = None  # the X-Conductor-Indexed-Until header it answers

    async def query(self, request: web.Request) -> web.Response:
        self.connections.add(id(request.transport))
        self.hits_only.append(request.headers.get("X-Conductor-Hits-Only"))
        if (asked := request.headers.get("X-Conductor-Progress")) is not None:
            self.progress_asked.append(json.loads(asked))
        await request.read()
        await asyncio.sleep(self.delay_s)
        response = web.Response(body=msgpack.packb(ANSWER), content_type="application/msgpack")
        if self.indexed_until is not None:
            response.headers["X-Conductor-Indexed-Until"] = self.indexed_until
        return response


@pytest.fixture
async def slow() -> AsyncIterator[tuple[SlowConductor, str]]:
    conductor = SlowConductor()
    app = web.Application()
    app.router.add_post("/query", conductor.query)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield conductor, f"http://127.0.0.1:{server.port}"
    await server.close()


CONTEXT = IndexContext("default", "m", "", 16)


def client(session: aiohttp.ClientSession, url: str) -> ConductorClient:
    section = ConductorSection(address=url, query_timeout_seconds=0.1)
    pool = InstancePool.build([])
    return ConductorClient(session, section, Notices(logging.getLogger("test")), pool)


async def test_a_late_answer_keeps_its_connection_for_the_next_query(slow):
    conductor, url = slow
    async with aiohttp.ClientSession() as session:
        queries = client(session, url)
        conductor.delay_s = 0.3
        with pytest.raises(ConductorUnavailable):
            await queries.query(token_bytes(list(range(64))), CONTEXT)
        await asyncio.sleep(0.4)  # the late answer arrives and is read
        conductor.delay_s = 0.0
        assert await queries.query(token_bytes(list(range(64))), CONTEXT) == {"e0": (32, 32, 32)}
    assert len(conductor.connections) == 1


async def test_late_calls_are_bounded(slow, monkeypatch):
    conductor, url = slow
    monkeypatch.setattr(conductor_client, "MAX_LATE_CALLS", 2)
    conductor.delay_s = 0.5
    async with aiohttp.ClientSession() as session:
        queries = client(session, url)
        for _ in range(4):
            with pytest.raises(ConductorUnavailable):
                await queries.query(token_bytes(list(range(64))), CONTEXT)
        await asyncio.sleep(0)
        assert len(queries._late) == 2  # the later ones were cut


async def test_progress_is_asked_in_turns_and_odd_answers_are_ignored(slow, monkeypatch):
    """The instances with prompts in flight go in ``X-Conductor-Progress``, at most
    ``MAX_PROGRESS_OF`` a query, the next ones each time; the answer's numbers are kept per
    instance, and anything else in it (null, text, booleans, not JSON) changes nothing."""
    conductor, url = slow
    monkeypatch.setattr(conductor_client, "MAX_PROGRESS_OF", 2)
    prompt = token_bytes(list(range(64)))
    async with aiohttp.ClientSession() as session:
        queries = client(session, url)
        await queries.query(prompt, CONTEXT)  # nothing in flight: no header
        for _ in range(3):
            await queries.query(prompt, CONTEXT, progress_of=["a", "b", "c"])
        assert conductor.progress_asked == [["a", "b"], ["c", "a"], ["b", "c"]]
        assert set(conductor.hits_only) == {"1"}  # the router needs the hits alone
        conductor.indexed_until = '{"a": 12.5, "b": null, "c": "soon", "d": true, "e": 3}'
        await queries.query(prompt, CONTEXT, progress_of=["a"])
        assert [queries.indexed_until(i) for i in "abcde"] == [12.5, None, None, None, 3.0]
        for odd in ("not json", "[1, 2]", '{"a": [1]}'):
            conductor.indexed_until = odd
            await queries.query(prompt, CONTEXT, progress_of=["a"])
            assert queries.indexed_until("a") == 12.5
