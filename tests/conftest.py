"""Shared fixtures: a conductor subprocess on loopback, an HTTP client, ZMQ publishers."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from tests.support.wire_publisher import WirePublisher

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ConductorProcess:
    """``python -m conductor`` on 127.0.0.1, stopped with SIGTERM."""

    def __init__(self, tmp_path: Path, *args: str, config: dict[str, Any] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = tmp_path / "conductor_config.json"
        if config is not None:
            import json

            config_path.write_text(json.dumps(config))
        self.command = [
            sys.executable,
            "-m",
            "conductor",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--config",
            str(config_path),
            *args,
        ]
        env = {**os.environ, "CONDUCTOR_LOG_LEVEL": "DEBUG", "PYTHONPATH": str(REPO)}
        self.log_path = tmp_path / f"conductor-{self.port}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"conductor exited: {self.log_path.read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("conductor did not start listening")

    def stop(self, timeout: float = 5.0) -> float:
        """SIGTERM and wait; returns how long the shutdown took."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self._log.close()
        return time.monotonic() - started

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


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
