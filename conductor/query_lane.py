"""A connection's protocol: the query routes answered directly, the rest by aiohttp.

Each connection starts in the lane. A request whose head the lane reads (as a plain
query's, by ``_native.HeadReader``; else by ``lane_http.parse_head``) is read whole and
answered at once if it is a plain query (``ConductorApi.answer_plain``, from C:
``conductor.plain_query``), else by the API's own handler (``ConductorApi.answer_lane``:
the same checks, errors, metrics and dialects as through aiohttp); requests on a
connection are answered one after the other, in order (a long pipeline of plain queries
``PLAIN_AT_ONCE`` a round of the loop, so ingest gets its turns). At the first request
the lane does not serve (another route, a body too large, chunked, malformed), the
connection goes to aiohttp's protocol for good, with every byte not yet answered, so
aiohttp answers it exactly as it would have from the start. A router keeps its query
connections apart (``router.conductor_client``), so they stay in the lane.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import web

from .lane_http import HEAD_END, MAX_HEAD_BYTES, Head, LaneRequest, answer_bytes, parse_head
from .lazy_timer import LazyTimer
from .plain_query import PLAIN_ROUTE, PlainHead

log = logging.getLogger(__name__)
PAUSE_BUFFER_BYTES = 4 * 1024 * 1024  # pipelined bytes held while a request is answered
PLAIN_AT_ONCE = 16  # pipelined plain queries answered in one go: then the loop's other work

Answerer = Callable[[LaneRequest], Awaitable[web.Response]]
# a plain query's whole answer, given its head, body and connection; None: not plain
PlainAnswerer = Callable[[PlainHead, bytes, asyncio.Transport], bytes | None]


@dataclass(frozen=True)
class LaneSettings:
    """What the lane needs of the API: its answerers (a plain query's head reader first),
    aiohttp's protocol, the limits."""

    answer: Answerer
    read_plain: Callable[[bytes], PlainHead | None]
    answer_plain: PlainAnswerer
    aiohttp_protocol: Callable[[], asyncio.Protocol]
    body_limit: Callable[[str], int]
    body_timeout_s: float
    keepalive_timeout_s: float


@dataclass(frozen=True, slots=True)
class _Read:
    """A request head the lane read: as the plain path reads it, or else as the handler
    does (``head``), with where its body starts in the buffer and how long it is."""

    raw: bytes  # the head, up to the blank line
    plain: PlainHead | None
    head: Head | None
    start: int
    length: int

    def handler_head(self) -> Head | None:
        """The head as the handler reads it (a plain one's too, if the plain path declined)."""
        return self.head if self.head is not None else parse_head(self.raw)


class QueryLane(asyncio.Protocol):
    """One connection: in the lane until its first request the lane does not serve."""

    def __init__(self, settings: LaneSettings) -> None:
        self.settings = settings
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None  # the client's address, for the refusals' log
        self.buffer = bytearray()
        self.inner: asyncio.Protocol | None = None  # aiohttp's, once handed over
        self.answering: asyncio.Task[None] | None = None
        self.paused = False
        self._waiting_body: _Read | None = None  # a head whose body is still arriving
        # idle between requests (keep-alive), or a body arriving too slowly
        self._timer = LazyTimer(self._timed_out)
        self._later: asyncio.Handle | None = None  # the rest of a long pipeline, next round

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) else None
        self._timer.arm(self.settings.keepalive_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
            return
        self.buffer += data
        if self.answering is None and self._later is None:
            self._next()
        elif len(self.buffer) > PAUSE_BUFFER_BYTES and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            return self.inner.eof_received()
        return None  # the transport closes, as aiohttp's protocol has it

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.close()
        if self._later is not None:
            self._later.cancel()
        if self.inner is not None:
            self.inner.connection_lost(exc)
        elif self.answering is not None:
            self.answering.cancel()

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    # -- the lane ----------------------------------------------------------------------------
    def _next(self) -> None:
        """Answer the buffer's whole requests in order: a plain query at once, any other
        by the answerer's task (the next waits for it); hand over at one not ours."""
        for _ in range(PLAIN_AT_ONCE):
            if not self.buffer or self.answering is not None or self.inner is not None:
                return
            taken = self._take()
            if taken is None:
                return
            read, body = taken
            if read.plain is not None:
                answer = self._plain_answer(read.plain, body)
                if answer is not None:
                    if not self._written(answer, read.plain.keep_alive):
                        return
                    continue
            head = read.handler_head()
            if head is None:  # read as plain by C, not by Python: aiohttp's then
                self.buffer[:0] = read.raw + HEAD_END + body
                self._hand_over()
                return
            self._start(head, body)
        if self.buffer and self.answering is None and self.inner is None:
            self._later = asyncio.get_running_loop().call_soon(self._go_on)

    def _plain_answer(self, head: PlainHead, body: bytes) -> bytes | None:
        """The plain path's answer, or None: the handler's then (a failure there is a bug,
        logged, and the handler still answers the request)."""
        assert self.transport is not None
        try:
            return self.settings.answer_plain(head, body, self.transport)
        except Exception:
            log.exception("the plain path failed; the handler answers the query")
            return None

    def _go_on(self) -> None:
        self._later = None
        self._next()

    def _take(self) -> tuple[_Read, bytes] | None:
        """The buffer's first request if it is whole (taken out of it); None if it is not
        (yet), or not ours (then handed over)."""
        read = self._waiting_body  # its head was read already
        if read is None:
            end = self.buffer.find(HEAD_END, 0, MAX_HEAD_BYTES + len(HEAD_END))
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self._hand_over()
                return None
            raw = bytes(self.buffer[:end])
            start = end + len(HEAD_END)
            plain = self.settings.read_plain(raw)
            if plain is not None:
                read = _Read(raw, plain, None, start, plain.length)
                path = PLAIN_ROUTE
            else:
                head = parse_head(raw)
                if head is None:
                    self._hand_over()
                    return None
                read, path = _Read(raw, None, head, start, head.length), head.path
            if read.length > self.settings.body_limit(path):
                self._hand_over()
                return None
        if len(self.buffer) - read.start < read.length:
            if self._waiting_body is None:  # the rest of the body, within the timeout
                self._waiting_body = read
                self._timer.arm(self.settings.body_timeout_s)
            return None
        self._timer.disarm()
        self._waiting_body = None
        body = bytes(self.buffer[read.start : read.start + read.length])
        del self.buffer[: read.start + read.length]
        return read, body

    def _start(self, head: Head, body: bytes | None) -> None:
        request = LaneRequest(
            "POST", head.path, head.headers, head.content_type, head.length, body, head.keep_alive,
            self.transport, self.remote,
        )  # fmt: skip
        self.answering = asyncio.ensure_future(self._answer(request))

    async def _answer(self, request: LaneRequest) -> None:
        try:
            response = await self.settings.answer(request)
        except Exception:  # the answerer turns every error into a response; this is a bug
            log.exception("the query lane could not answer %s", request.path)
            self._close()
            return
        finally:
            self.answering = None
        keep_alive = request.keep_alive and response.keep_alive is not False
        if self._written(answer_bytes(response, keep_alive), keep_alive):
            self._next()

    def _written(self, answer: bytes, keep_alive: bool) -> bool:
        """``answer`` sent; whether the connection stays for the next request."""
        assert self.transport is not None
        if self.transport.is_closing():
            return False
        self.transport.write(answer)
        if not keep_alive:
            self._close()
            return False
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        self._timer.arm(self.settings.keepalive_timeout_s)
        return True

    def _hand_over(self) -> None:
        """From now on aiohttp serves this connection, from the first unanswered byte."""
        self._timer.disarm()
        assert self.transport is not None
        self.inner = self.settings.aiohttp_protocol()
        self.inner.connection_made(self.transport)
        pending, self.buffer = bytes(self.buffer), bytearray()
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        self.inner.data_received(pending)

    def _close(self) -> None:
        self._timer.disarm()
        if self.transport is not None:
            self.transport.close()

    def _timed_out(self) -> None:
        """Idle too long: closed. A body too slow: answered (408) without it, then closed."""
        if self.answering is not None or self.inner is not None:
            return
        waiting, self._waiting_body = self._waiting_body, None
        if waiting is None:
            self._close()
            return
        self.buffer.clear()
        head = waiting.handler_head()
        if head is None:  # read as plain by C, not by Python: aiohttp would not read it
            self._close()
            return
        self._start(head, None)
