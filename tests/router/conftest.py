"""Fixtures of the router's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from fleet.tiny_model import write_tiny_model
from tests.router.inprocess import ServedRouter, serve_router
from tests.router.sim_fleet import Fleet
from tests.support.processes import EngineSim, RouterProcess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's directory: a real HF tokenizer and chat template (fleet.tiny_model)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[dict[str, Any]], Awaitable[ServedRouter]]]:
    """Starts routers in this process (``inprocess``); closes them after the test."""
    servers: list[TestServer] = []

    async def start(config: dict[str, Any]) -> ServedRouter:
        return await serve_router(config, servers)

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[Callable[..., RouterProcess]]:
    """Starts router processes (not waiting for them to listen); stops them after the test."""
    started: list[RouterProcess] = []

    def start(config: dict[str, Any], *args: str) -> RouterProcess:
        started.append(RouterProcess(tmp_path, config, *args))
        return started[-1]

    yield start
    for router in started:
        router.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path)
    yield fleet
    fleet.stop()


@pytest.fixture
def engine_sims(tmp_path: Path) -> Iterator[Callable[..., EngineSim]]:
    """Engine simulators without KV events or a conductor, for an in-process router."""
    started: list[EngineSim] = []

    def start(name: str, *args: str, port: int | None = None) -> EngineSim:
        started.append(EngineSim(tmp_path, name, *args, port=port))
        started[-1].wait_ready()
        return started[-1]

    yield start
    for engine in started:
        engine.stop()
