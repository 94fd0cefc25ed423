"""The router's connections to its engines: one pooled HTTP session per upstream, so each
engine's keep-alive connections serve every call the router makes to it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp

from .pool import Upstream


class UpstreamSessions:
    def __init__(self, connect_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def open(self, upstreams: Iterable[Upstream]) -> None:
        """A session per upstream (in the event loop: aiohttp's sessions need it)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
        for upstream in upstreams:
            self._sessions[upstream.instance_id] = aiohttp.ClientSession(
                upstream.url,
                timeout=timeout,
                # no cap: a capped pool queues requests (and /tokenize) inside the router,
                # where neither the engine's load nor the TTFT estimate can see them
                connector=aiohttp.TCPConnector(limit=0),
            )

    def to(self, upstream: Upstream) -> aiohttp.ClientSession:
        return self._sessions[upstream.instance_id]

    async def close(self) -> None:
        await asyncio.gather(*(session.close() for session in self._sessions.values()))
