"""Shared fixtures: a conductor subprocess on loopback, an HTTP client, ZMQ publishers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from tests.support.processes import REPO, ConductorProcess
from tests.support.wire_publisher import WirePublisher

__all__ = ["REPO", "ConductorProcess"]


@pytest.fixture
def conductor_factory(tmp_path: Path) -> Iterator[Callable[..., ConductorProcess]]:
    started: list[ConductorProcess] = []

    def start(*args: str, config: dict[str, Any] | None = None) -> ConductorProcess:
        process = ConductorProcess(tmp_path, *args, config=config)
        started.append(process)
        process.wait_ready()
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def conductor(conductor_factory: Callable[..., ConductorProcess]) -> ConductorProcess:
    return conductor_factory()


@pytest.fixture(scope="module")
def shared_conductor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConductorProcess]:
    """One service for a module of tests that leave no state behind (saves start-ups)."""
    process = ConductorProcess(tmp_path_factory.mktemp("conductor"))
    process.wait_ready()
    yield process
    process.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def publisher_factory(
    zmq_context: zmq.asyncio.Context,
) -> AsyncIterator[Callable[..., WirePublisher]]:
    publishers: list[WirePublisher] = []

    def create(port: int = 0, replay_port: int = 0, **options: Any) -> WirePublisher:
        publisher = WirePublisher(zmq_context, **options).start(port, replay_port)
        publishers.append(publisher)
        return publisher

    yield create
    await asyncio.gather(*(p.close() for p in publishers))
