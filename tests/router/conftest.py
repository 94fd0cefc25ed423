"""Fixtures of the router's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from tests.router.inprocess import ServedRouter, serve_router


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[ServedRouter]]]:
    """Starts routers in this process (``inprocess``); closes them after the test."""
    servers: list[TestServer] = []

    async def start(config: dict[str, Any]) -> ServedRouter:
        return await serve_router(config, servers)

    yield start
    for server in servers:
        await server.close()
