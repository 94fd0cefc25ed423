"""Connection-level limits aiohttp does not have: a request-head timeout and a connection cap.

Every connection's protocol (aiohttp's ``RequestHandler``) is wrapped: a connection over
``max_connections`` is aborted as it arrives (the others are untouched), and a request head
(everything up to the blank line) that has not fully arrived ``header_timeout`` seconds
after its first byte (or after the connection opened) closes the connection, so a client
sending a head byte by byte cannot hold a socket. The body has its own timeout, around the
read in the handlers.

The guard also tells the index's ``LoopShare`` when a request is being answered (from its
first bytes until the handler returns), so that ingest steps wait for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from .lazy_timer import LazyTimer
from .runtime import LoopShare

log = logging.getLogger(__name__)
ConnectionProtocol = Callable[..., "GuardedProtocol"]  # (pending: bytes = b"")
HEAD_END = b"\r\n\r\n"
# an app's protocol for a new connection, in place of aiohttp's (conductor.query_lane)
CONNECTION_PROTOCOL: web.AppKey[Callable[[web.AppRunner], asyncio.Protocol]] = web.AppKey(
    "connection_protocol"
)


class ConnectionGuard:
    """The open connections and the limits they are held to."""

    def __init__(
        self,
        header_timeout: float,
        max_connections: int,
        registry: CollectorRegistry,
        share: LoopShare | None = None,
    ) -> None:
        self.header_timeout = header_timeout
        self.share = share  # told of every request from its first bytes to its answer
        self.max_connections = max_connections
        self.refused = Counter(
            "conductor_http_connections_closed_total",
            "Connections closed by the server: over the limit or a head too slow",
            ["reason"],
            registry=registry,
        )
        self.open: dict[asyncio.Transport, GuardedProtocol] = {}
        # another server of the same port (conductor.query_thread): its connections count
        # toward the limit, and it is told of ours
        self.peer: ConnectionPeer | None = None

    def request_done(self, transport: asyncio.Transport | None) -> None:
        """A response was handled: the next bytes on the connection start a new head."""
        connection = self.open.get(transport) if transport is not None else None
        if connection is not None:
            connection.awaiting_head = True
            connection.tail = b""
            connection.answered()

    def close_all(self) -> None:
        """Shutdown: close every connection now, slow clients included."""
        for transport in list(self.open):
            transport.abort()


class ConnectionPeer(Protocol):
    """What the guard shares its limit with."""

    @property
    def connections(self) -> int: ...
    def set_loop_connections(self, count: int, /) -> None: ...


class GuardedProtocol(asyncio.Protocol):
    """Forwards every event to aiohttp's protocol, timing the request heads. ``pending``:
    bytes the connection sent before it was ours (a connection the query thread handed
    over), given to it first."""

    def __init__(
        self, inner: asyncio.Protocol, guard: ConnectionGuard, pending: bytes = b""
    ) -> None:
        self.inner = inner
        self.guard = guard
        self.pending = pending
        self.transport: asyncio.Transport | None = None
        self.awaiting_head = True
        self.tail = b""  # the last bytes seen, to find a head end split across reads
        self.answering = False  # a request's first bytes came, its answer not yet
        self._timer: LazyTimer | None = None  # the head's (made with the connection)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        guard = self.guard
        peer = guard.peer
        if len(guard.open) + (peer.connections if peer else 0) >= guard.max_connections:
            guard.refused.labels("limit").inc()
            self.transport.abort()
            return
        guard.open[self.transport] = self
        if peer is not None:
            peer.set_loop_connections(len(guard.open))
        self._timer = LazyTimer(self._head_timed_out)
        self._timer.arm(guard.header_timeout)
        self.inner.connection_made(transport)
        if self.pending:
            pending, self.pending = self.pending, b""
            self.data_received(pending)

    def data_received(self, data: bytes) -> None:
        if not self.answering and self.guard.share is not None:
            self.answering = True
            self.guard.share.request_began()
        if self.awaiting_head and self._timer is not None:
            if not self._timer.armed:
                self._timer.arm(self.guard.header_timeout)
            seen = self.tail + data
            if HEAD_END in seen:
                self.awaiting_head = False
                self._timer.disarm()
            self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.close()
        self.answered()
        if self.transport is not None and self.guard.open.pop(self.transport, None) is not None:
            if self.guard.peer is not None:
                self.guard.peer.set_loop_connections(len(self.guard.open))
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def answered(self) -> None:
        if self.answering and self.guard.share is not None:
            self.answering = False
            self.guard.share.request_ended()

    def _head_timed_out(self) -> None:
        """Armed at connect and at a head's first byte (an idle keep-alive connection
        between requests is aiohttp's ``keepalive_timeout``)."""
        if self.awaiting_head and self.transport is not None:
            self.guard.refused.labels("header_timeout").inc()
            log.debug("closing a connection whose request head did not arrive in time")
            self.transport.abort()


async def listen(
    runner: web.AppRunner, guard: ConnectionGuard, host: str | None, port: int, **options: Any
) -> asyncio.Server:
    """The serving socket, bound before the app is set up: a port in use fails before any
    stream is registered. It serves (and listens) once ``GuardedSite.start`` starts it;
    ``options`` are ``loop.create_server``'s (backlog, reuse_address, reuse_port)."""

    loop = asyncio.get_running_loop()
    protocol = connection_protocol(runner, guard)
    return await loop.create_server(protocol, host, port, start_serving=False, **options)


def connection_protocol(runner: web.AppRunner, guard: ConnectionGuard) -> ConnectionProtocol:
    """A new connection's protocol: the app's (or aiohttp's), behind the guard; given
    ``pending``, the bytes it sent before it was ours."""

    def protocol(pending: bytes = b"") -> GuardedProtocol:
        assert runner.server is not None, "served only once the runner is set up"
        make = runner.app.get(CONNECTION_PROTOCOL)
        return GuardedProtocol(make(runner) if make else runner.server(), guard, pending)

    return protocol


class GuardedSite(web.TCPSite):
    """``TCPSite`` whose connections go through a ``ConnectionGuard``: on ``server`` when
    it was bound beforehand (``listen``), else on a socket it binds when started."""

    def __init__(
        self,
        runner: web.AppRunner,
        guard: ConnectionGuard,
        server: asyncio.Server | None = None,
        **options: Any,
    ) -> None:
        super().__init__(runner, **options)
        self._guard = guard
        self._bound = server

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._bound
        if server is None:
            assert isinstance(self._runner, web.AppRunner)
            server = await listen(
                self._runner,
                self._guard,
                self._host,
                self._port,
                backlog=self._backlog,
                reuse_address=self._reuse_address,
                reuse_port=self._reuse_port,
            )
        self._server = server
        await server.start_serving()
