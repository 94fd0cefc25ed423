"""One registration's event stream: a SUB socket for live batches, a DEALER for replays.

Sequence rules: batches are applied strictly in order; a gap is filled by a replay before
the batch that revealed it; a sequence going back means the publisher restarted, so the
owner's blocks are cleared and the stream is read as new. A malformed message is counted
and skipped: the SUB socket is never recreated for it (that would lose messages), and ZMQ
itself reconnects with capped exponential backoff.

Liveness: the moment the connection to the publisher drops (its process died, or the
network broke) the owner's blocks are cleared, because the conductor can no longer tell
what the engine holds; on every (re)connection the stream is read from the start of the
publisher's replay buffer, without waiting for its next batch. A dead engine thus stops
being reported within milliseconds, and an idle engine (a conductor started after it, or a
network blip) gets its blocks back from its buffer at once. ZMQ heartbeats bound the time to
notice a peer that vanished without closing its connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .wire.frames import FrameError, Message, parse_live, parse_replay, replay_request

log = logging.getLogger(__name__)

RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 5000
RECEIVE_HWM = 100_000
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000  # a silent peer is dropped after this (plus one interval)


@dataclass(slots=True)
class StreamCallbacks:
    """What the subscriber reports; the manager decodes, applies and counts."""

    on_message: Callable[[Message, bool], None]  # (message, replayed)
    on_restart: Callable[[], None]  # a new publisher: clear the owner's blocks
    on_state: Callable[[str], None]
    on_event: Callable[[str], None]  # gap, gap_unrepaired, replay_*, bad_frame, restart, lost
    on_lost: Callable[[], None]  # the publisher is gone: its blocks are unknown, clear them


class StreamSubscriber:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        name: str,
        endpoint: str,
        replay_endpoint: str,
        callbacks: StreamCallbacks,
        first_sequence: int = 0,
        replay_timeout: float = 2.0,
    ) -> None:
        self._context = context
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._callbacks = callbacks
        self._first_sequence = first_sequence
        self._replay_timeout = replay_timeout
        self.last_sequence: int | None = None
        self._last_replayed = False  # last_sequence came from a replay, not the live stream
        self.state = "connecting"
        self._order = asyncio.Lock()  # live batches, replays and clears, one at a time
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._catching_up: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Connect (lazily, like ZMQ) and start reading; raises ZMQError on a bad endpoint."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MIN_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint:
                self._dealer = self._new_dealer()
        except zmq.ZMQError:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            raise
        self._sub = sub
        self._tasks = [
            asyncio.create_task(self._read_live(), name=f"sub:{self.name}"),
            asyncio.create_task(self._watch(monitor), name=f"monitor:{self.name}"),
        ]

    async def stop(self) -> None:
        """Cancel reads (never waits on a blocked recv) and close every socket."""
        tasks = [*self._tasks, *([self._catching_up] if self._catching_up else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._catching_up = [], None
        if self._sub is not None:
            self._sub.disable_monitor()
            self._sub.close(0)
            self._sub = None
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None
        self._set_state("stopped")

    def _new_dealer(self) -> zmq.asyncio.Socket:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        try:
            dealer.connect(self.replay_endpoint)
        except zmq.ZMQError:
            dealer.close(0)
            raise
        return dealer

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._callbacks.on_state(state)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_CONNECTED:
                    self._set_state("connected")
                    self._catching_up = asyncio.create_task(
                        self._catch_up(), name=f"catch-up:{self.name}"
                    )
                elif event == zmq.EVENT_DISCONNECTED:
                    if self._catching_up is not None:  # its replies will never come
                        self._catching_up.cancel()
                        await asyncio.gather(self._catching_up, return_exceptions=True)
                    await self._lose_publisher()
                elif event == zmq.EVENT_CONNECT_RETRIED and self.state != "replaying":
                    self._set_state("disconnected")
        finally:
            monitor.close(0)

    async def _catch_up(self) -> None:
        """A (re)connected stream reads the publisher's buffer now, not at its next batch."""
        async with self._order:
            if self.last_sequence is None:
                await self._replay(self._first_sequence, None)

    async def _lose_publisher(self) -> None:
        async with self._order:
            self._set_state("disconnected")
            self._callbacks.on_event("lost")
            log.warning("stream=%s lost its publisher: clearing its blocks", self.name)
            self._callbacks.on_lost()
            self.last_sequence = None

    # -- live stream ---------------------------------------------------------------------
    async def _read_live(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            try:
                message = parse_live(frames)
            except FrameError as error:
                self._callbacks.on_event("bad_frame")
                log.warning("stream=%s dropped malformed message: %s", self.name, error)
                continue
            async with self._order:
                await self._handle_live(message)
            # pyzmq completes a recv at once while messages are queued: yield so a burst of
            # batches cannot hold /query and the other streams back.
            await asyncio.sleep(0)

    async def _handle_live(self, message: Message) -> None:
        last = self.last_sequence
        if last is not None and message.seq <= last and self._last_replayed:
            # sent live while a catch-up replay already delivered it (a new publisher
            # counting from 0 also drops its connection: its batches come back through
            # the catch-up that follows the reconnection)
            return
        if last is not None and message.seq <= last:
            # PUB/SUB never redelivers, so a live sequence that does not advance means a
            # new publisher counting from scratch.
            self._callbacks.on_event("restart")
            log.warning(
                "stream=%s publisher restarted (seq %d after %d): clearing its blocks",
                self.name,
                message.seq,
                last,
            )
            self._callbacks.on_restart()
            self.last_sequence = last = None
        expected = self._first_sequence if last is None else last + 1
        if message.seq > expected:
            if last is not None:
                self._callbacks.on_event("gap")
                log.info("stream=%s gap: expected seq %d, got %d", self.name, expected, message.seq)
            await self._replay(expected, message.seq)
            if self.last_sequence is None or self.last_sequence + 1 < message.seq:
                if last is not None or self.replay_endpoint:
                    self._callbacks.on_event("gap_unrepaired")
        self._apply(message, replayed=False)

    def _apply(self, message: Message, replayed: bool) -> None:
        self.last_sequence = message.seq
        self._last_replayed = replayed
        self._callbacks.on_message(message, replayed)

    # -- replay --------------------------------------------------------------------------
    async def _replay(self, start: int, stop: int | None) -> None:
        """Apply the publisher's buffered batches ``start <= seq < stop``, in order."""
        if self._dealer is None:
            return
        previous_state = self.state
        self._set_state("replaying")
        self._callbacks.on_event("replay_requested")
        try:
            await self._dealer.send_multipart(replay_request(start))
            while True:
                frames = await asyncio.wait_for(self._dealer.recv_multipart(), self._replay_timeout)
                try:
                    message = parse_replay(frames)
                except FrameError as error:
                    self._callbacks.on_event("bad_frame")
                    log.warning("stream=%s bad replay reply: %s", self.name, error)
                    continue
                if message is None:
                    break
                last = self.last_sequence
                wanted = start <= message.seq and (stop is None or message.seq < stop)
                if wanted and (last is None or message.seq > last):
                    self._apply(message, replayed=True)
        except (TimeoutError, zmq.ZMQError, asyncio.CancelledError) as error:
            self._callbacks.on_event("replay_failed")
            log.warning("stream=%s replay from %d failed: %r", self.name, start, error)
            self._dealer.close(0)  # late replies must not leak into the next replay
            self._dealer = self._new_dealer()
            if isinstance(error, asyncio.CancelledError):
                raise
        finally:
            self._set_state(previous_state if previous_state != "replaying" else "connected")
