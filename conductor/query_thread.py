"""Plain queries answered on a thread of their own, beside the event loop (``query_thread``).

The event loop is one Python thread. ``_native.QueryThread`` (conductor/native/
query_thread.c) answers plain ``/query`` requests without the GIL, on listening sockets
bound to the service's port with ``SO_REUSEPORT``: the kernel spreads new connections over
them and the loop's. This module is its shell, on the loop:

* it gives the thread each context's plans (``ConductorApi.thread_plans``) and keeps them
  in step with the index: the index tells it before a context's slots change, it holds
  the context (the thread's queries of it wait) and publishes it again once the loop's
  current step is done;
* it takes the connections the thread hands over (a request it does not answer: the
  socket and the bytes not yet answered) and serves them as if the loop had accepted
  them (``http_guard.connection_protocol``);
* it tells the thread whether routers' routed prompts are held (then the loop answers
  every query) and how many connections the loop has open (one limit for both), and the
  loop's ingest steps when the thread last had a query (they stay short meanwhile, as for
  the loop's own: a query of a context waits for the step that holds it);
* it adds the thread's answers to the service's metrics before they are read.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from prometheus_client import Counter

from ._native import QueryThread
from .api import MSGPACK, PLAIN_HEADS, ConductorApi
from .http_guard import ConnectionGuard, ConnectionProtocol
from .index import ContextKey
from .plain_query import PLAIN_ROUTE

if TYPE_CHECKING:
    from prometheus_client.metrics import Histogram

log = logging.getLogger(__name__)
EXPIRE_EVERY_S = 0.25  # routed prompts whose time is over are let go this often at least
LISTEN_BACKLOG = 100  # asyncio's default


class QueryThreadShell:
    """The thread, its sockets, and what it needs of the loop (see the module's doc)."""

    def __init__(
        self,
        api: ConductorApi,
        guard: ConnectionGuard,
        server: asyncio.AbstractServer,
        protocol: ConnectionProtocol,
    ) -> None:
        self.api = api
        self.guard = guard
        self.protocol = protocol
        self.listeners = [_listener_beside(sock) for sock in server.sockets]  # type: ignore[attr-defined]
        options = api.options
        auth = options.auth
        self.thread = QueryThread(
            PLAIN_HEADS,
            tuple(self.listeners),
            api.thread_heads(),
            MSGPACK.encode(),
            auth.token.encode() if auth.required(PLAIN_ROUTE) else None,
            options.limits.body_bytes(PLAIN_ROUTE),
            options.limits.max_query_tokens,
            options.keepalive_timeout_s,
            tuple(self._seconds._upper_bounds[:-1]),
            guard.max_connections,
        )
        metrics = api.metrics
        self.answered = Counter(
            "conductor_query_thread_queries_total",
            "Plain queries the query thread answered (counted in conductor_http_requests_total "
            "and conductor_plain_queries_total too)",
            registry=metrics.registry,
        )
        self.handovers = Counter(
            "conductor_query_thread_handovers_total",
            "Connections the query thread gave to the event loop: a request it does not "
            "answer (another route, a header asking for more, a context it has no plan for, "
            "a request not whole within a second)",
            registry=metrics.registry,
        )
        self._counted = (0, 0.0, (0,) * len(self._seconds._upper_bounds), 0, 0)
        self._held: set[ContextKey] = set()  # held, to publish once the loop's step is done
        self._adopting: set[asyncio.Task[object]] = set()
        self._expiring: asyncio.TimerHandle | None = None

    @property
    def _seconds(self) -> Histogram:
        return self.api.metrics.query_seconds.labels(PLAIN_ROUTE)

    def start(self) -> None:
        """Serve: every context published, the thread running, handovers taken."""
        loop = asyncio.get_running_loop()
        table = self.api.table
        for key in list(table.contexts):
            self._publish(key)
        table.watch_slots(self._slots_changing)
        routed = self.api.routed
        routed.listener = self.thread.set_routed
        self.thread.set_routed(routed.holds_any())
        self.guard.peer = self.thread
        self.thread.set_loop_connections(len(self.guard.open))
        if self.guard.share is not None:  # ingest steps stay short while the thread answers
            self.guard.share.last_request_elsewhere = lambda: self.thread.last_request
        self.api.metrics.gatherers.append(self._gather)
        loop.add_reader(self.thread.handover_fd, self._take_handovers)
        self.thread.start()
        self._expiring = loop.call_later(EXPIRE_EVERY_S, self._expire)
        log.info("query thread answering on %d socket(s)", len(self.listeners))

    def stop(self) -> None:
        """The thread stopped and its connections closed; the loop's are the guard's."""
        if self._expiring is not None:
            self._expiring.cancel()
        asyncio.get_running_loop().remove_reader(self.thread.handover_fd)
        self.thread.stop()
        self.api.table.watch_slots(None)
        self.api.routed.listener = None
        self.guard.peer = None
        self.api.metrics.gatherers.remove(self._gather)
        if self.guard.share is not None:
            self.guard.share.last_request_elsewhere = None
        for listener in self.listeners:
            listener.close()
        for fd, _ in self.thread.handovers():
            socket.socket(fileno=fd).close()
        for task in self._adopting:
            task.cancel()

    # -- plans ---------------------------------------------------------------------------
    def _slots_changing(self, key: ContextKey) -> None:
        """Before the loop changes a context's slots: its plans held, published again once
        the loop's current step is done."""
        if key not in self._held:
            self.thread.hold(_key(key))
            if not self._held:
                asyncio.get_running_loop().call_soon(self._publish_held)
            self._held.add(key)

    def _publish_held(self) -> None:
        held, self._held = self._held, set()
        for key in held:
            self._publish(key)

    def _publish(self, key: ContextKey) -> None:
        self.thread.publish(_key(key), *self.api.thread_plans(key))

    # -- what it reads of the loop ---------------------------------------------------------
    def _expire(self) -> None:
        """Routed prompts whose time is over let go (the thread answers again once none is)."""
        self.api.routed.expire()
        self._expiring = asyncio.get_running_loop().call_later(EXPIRE_EVERY_S, self._expire)

    def _take_handovers(self) -> None:
        loop = asyncio.get_running_loop()
        for fd, pending in self.thread.handovers():
            sock = socket.socket(fileno=fd)
            task = loop.create_task(self._adopt(sock, pending))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    async def _adopt(self, sock: socket.socket, pending: bytes) -> None:
        """A connection the thread gave up, served by the loop from its first byte not yet
        answered."""
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(lambda: self.protocol(pending), sock)
        except OSError as error:  # closed by its client meanwhile
            log.debug("a connection handed over by the query thread is gone: %s", error)
            sock.close()

    def _gather(self) -> None:
        """The thread's answers since the last read, added to the service's series."""
        answered, seconds, buckets, handed, refused = self.thread.stats()
        last_answered, last_seconds, last_buckets, last_handed, last_refused = self._counted
        self._counted = (answered, seconds, buckets, handed, refused)
        metrics = self.api.metrics
        if answered > last_answered:
            metrics.http_requests.labels(PLAIN_ROUTE, "200").inc(answered - last_answered)
            metrics.plain_queries.inc(answered - last_answered)
            self.answered.inc(answered - last_answered)
            histogram = self._seconds  # prometheus_client has no bulk observe: its parts
            histogram._sum.inc(seconds - last_seconds)
            for bucket, (count, last) in enumerate(zip(buckets, last_buckets, strict=True)):
                if count > last:
                    histogram._buckets[bucket].inc(count - last)
        if handed > last_handed:
            self.handovers.inc(handed - last_handed)
        if refused > last_refused:
            self.guard.refused.labels("limit").inc(refused - last_refused)


def _key(key: ContextKey) -> tuple[str, str, str, int]:
    return (key.tenant_id, key.model_name, key.lora_name, key.block_size)


def _listener_beside(sock: socket.socket) -> socket.socket:
    """A listening socket on ``sock``'s address, sharing its port (both ``SO_REUSEPORT``)."""
    listener = socket.socket(sock.family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if sock.family == socket.AF_INET6:
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        listener.bind(sock.getsockname())
        listener.listen(LISTEN_BACKLOG)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener
