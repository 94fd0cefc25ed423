"""The conductor app served in the test's own event loop (aiohttp's ``TestServer``, a real
loopback socket): for tests of answers and statuses, which need no process of their own.
Signals, start-up, slow clients on the guarded socket and streams across processes keep
the ``conductor`` subprocess fixtures of ``tests/conftest.py``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from conductor.__main__ import parse_settings
from conductor.manager import ServiceManager
from conductor.service import MANAGER, create_app, state_path


@dataclass(frozen=True)
class ServedConductor:
    """A conductor app and the URL it answers on (``url`` as a conductor process has one)."""

    manager: ServiceManager
    url: str


@pytest.fixture
async def serve_conductor(
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Awaitable[ServedConductor]]]:
    """Starts conductors from command-line flags and a config file, as
    ``mooncake-conductor`` would; stops them (the app's cleanup_ctx) after the test."""
    servers: list[TestServer] = []

    async def start(*args: str, config: dict[str, Any] | None = None) -> ServedConductor:
        config_path = tmp_path / f"conductor_config.{len(servers)}.json"
        config_path.write_text(json.dumps(config or {}))
        settings, limits, parsed, path = parse_settings(["--config", str(config_path), *args])
        app = create_app(settings, limits, parsed, state_path(settings, path))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return ServedConductor(app[MANAGER], f"http://127.0.0.1:{server.port}")

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def served(serve_conductor: Callable[..., Awaitable[ServedConductor]]) -> ServedConductor:
    """One conductor with the defaults (an empty config file)."""
    return await serve_conductor()
