"""Shared fixtures: a conductor subprocess on loopback, an HTTP client, ZMQ publishers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from tests.support import parts
from tests.support.processes import REPO, ConductorProcess
from tests.support.wire_publisher import WirePublisher

__all__ = ["REPO", "ConductorProcess"]

SKIPPED_FOR_PARTS_ENV = "MOONCAKE_SKIPPED_FOR_PARTS"  # a file: .ci/run's second phase reads it
SKIPPED_FOR_PARTS = "skipped_for_parts"  # a user property: it reaches pytest-xdist's controller
_skipped_for_parts: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-parts",
        action="store_true",
        help="a test whose needs marker names a missing part fails instead of skipping",
    )
    parser.addoption(
        "--only-tests",
        metavar="FILE",
        help="run only the test ids listed in FILE, one a line (the first phase's skips)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"needs(*parts): the test runs only where these heavy parts are ({', '.join(parts.PARTS)})",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    listed = config.getoption("only_tests")
    if listed:
        wanted = set(Path(listed).read_text().splitlines())
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid not in wanted])
        items[:] = [item for item in items if item.nodeid in wanted]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): two workers where there are two cores, one where
    real engines can run here (3 GB each, two at most at once: one test at a time)."""
    if parts.missing("vllm") is None or parts.missing("sglang") is None:
        return 1
    return min(2, os.cpu_count() or 1)


@pytest.hookimpl(tryfirst=True)  # before any fixture starts an engine or a store
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The one gate for the heavy parts: skip, saying why, or fail under --require-parts."""
    needed = [part for marker in item.iter_markers("needs") for part in marker.args]
    reasons = [reason for part in needed if (reason := parts.missing(part))]
    if not reasons:
        return
    if item.config.getoption("require_parts"):
        pytest.fail("a needed part is missing: " + "; ".join(reasons), pytrace=False)
    item.user_properties.append((SKIPPED_FOR_PARTS, True))
    pytest.skip("; ".join(reasons))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each skip for a part, wherever it ran: here, or in a pytest-xdist worker."""
    if (
        report.when == "setup"
        and report.skipped
        and (SKIPPED_FOR_PARTS, True) in report.user_properties
    ):
        _skipped_for_parts.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The skips' ids, written once: by the controller, not by each worker."""
    if hasattr(session.config, "workerinput"):
        return
    if path := os.environ.get(SKIPPED_FOR_PARTS_ENV):
        Path(path).write_text("".join(nodeid + "\n" for nodeid in sorted(_skipped_for_parts)))


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
