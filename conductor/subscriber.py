"""One registration's event stream: a SUB socket for live batches, a DEALER for replays.

Sequence rules (``conductor.sequence``, which decides; this module only executes):
batches are applied strictly in order; a gap is filled by a replay before the batch that
revealed it; a sequence going back means the publisher restarted, so the owner's blocks are
cleared and the stream is read as new. A malformed message is counted and skipped: the SUB
socket is never recreated for it (that would lose messages).

Reconnecting: ZMQ retries a refused connection with capped exponential backoff, but resets
its interval on every connection it makes, so an endpoint that accepts and closes at once (a
crash-looping engine, a port taken by another program) would be reconnected every
``RECONNECT_MIN_MS``. A connection shorter than ``STABLE_CONNECTION_S`` therefore continues
the fault of the one before: the subscriber disconnects the endpoint and connects it again
itself after a wait that doubles up to ``RECONNECT_MAX_MS``, until a connection holds. Every
loss is counted; the first of a fault is logged, the next ones once per
``LOSS_SUMMARY_S`` in one line (``ConnectionFaults``).

Liveness: the moment the connection to the publisher drops (its process died, or the
network broke) the owner's blocks are cleared, because the conductor can no longer tell
what the engine holds; on every (re)connection the stream is read from the start of the
publisher's replay buffer, without waiting for its next batch. A publisher whose process
dies is noticed at once (its kernel closes the connection); one that vanished without
closing it (a partition, a frozen host) is dropped by TCP keepalive: its blocks leave the
index within ``publisher_timeout_s`` + one probe interval (``KEEPALIVE_S``). Not ZMTP
heartbeats: once a stream's receive queue is full libzmq stops reading its connection, so
it misses the heartbeat replies of a healthy publisher and drops it exactly when the
conductor is busiest (libzmq 4.3.5 can then abort on the reconnect, zeromq/libzmq#3937);
the kernel answers keepalive probes whatever the application reads. The cost: a publisher
process that hangs on a live host is not noticed.

Bounds: a message larger than ``max_message_bytes`` drops the connection (ZMQ MAXMSGSIZE;
it reconnects and catches up). Live batches wait in the SUB queue while a replay runs; its
high-water mark is ``receive_buffer_bytes // max_message_bytes`` messages, so the bytes
queued per stream stay under ``receive_buffer_bytes`` (plus the one message being decoded);
beyond it TCP pushes back on the publisher. A replay answers within ``replay_timeout_s``
per reply and ``replay_deadline_s`` overall, and gives up after ``MAX_BAD_REPLIES``
undecodable replies in a row: an endpoint answering garbage must not hold a stream's live
batches for the whole deadline.

Supervision: the live reader, the connection watcher and each catch-up run as
``SupervisedTask``s: a failure is logged, counted, shown as state "failed" and retried
with backoff. An instance marked down (``mark_down``) drops its events until ``mark_up``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client import Counter
from zmq.utils.monitor import parse_monitor_message

from .runtime import LoopShare, SupervisedTask
from .sequence import (
    Apply,
    DropDuplicate,
    Gap,
    GapUnrepaired,
    Replay,
    Restart,
    SequenceTracker,
)
from .states import SubscriberState, TaskState
from .stream_limits import StreamLimits
from .wire.frames import FrameError, Message, parse_live, parse_replay, replay_request

log = logging.getLogger(__name__)

RECONNECT_MIN_MS = 100
RECONNECT_MAX_MS = 5000
STABLE_CONNECTION_S = 2.0  # a connection shorter than this continues its publisher's fault
LOSS_SUMMARY_S = 60.0  # the losses of a fault after its first are logged once per interval
MAX_BAD_REPLIES = 3  # undecodable replies in a row that end a replay
KEEPALIVE_S = 1  # idle time before the first TCP keepalive probe, and between probes
MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
_monitor_ids = itertools.count()  # pyzmq names monitors by FD, which the kernel recycles
_OPEN = asyncio.Event()
_OPEN.set()


class ReplayFailed(Exception):
    """A replay that cannot end well: its message says why, for the log."""


@dataclass(slots=True)
class StreamCallbacks:
    """What the subscriber reports; the manager decodes, applies and counts."""

    # (message, replayed): decode and apply, one step per iteration (see ServiceManager);
    # a step may hand back a future to await instead of a turn (the ingest thread's room)
    on_message: Callable[[Message, bool], Iterator[asyncio.Future[Any] | None]]
    on_restart: Callable[[], None]  # a new publisher: clear the owner's blocks
    on_state: Callable[[SubscriberState], None]
    on_event: Callable[[str], None]  # gap, gap_unrepaired, replay_*, bad_frame, restart, lost
    on_lost: Callable[[], None]  # the publisher is gone: its blocks are unknown, clear them
    on_dropped: Callable[[Message], None]  # a batch of an instance marked down
    # a stream resumed from a snapshot: the publisher no longer holds batches
    # ``expected <= s < first`` (arguments: expected, first), so the index misses them
    on_resume_gap: Callable[[int, int], None] = lambda expected, first: None


@dataclass(frozen=True, slots=True)
class Loss:
    """What one lost connection means for the log and for the next connect."""

    first: bool  # the first loss of a fault: worth its own line
    untold: int  # losses of the fault since its last line, this one included (0: none)
    since_s: float  # how long ago that line was
    delay_s: float  # wait this long before connecting again (0: ZMQ reconnects at once)


class ConnectionFaults:
    """A publisher's connections as faults: one fault lasts from a lost connection until
    a connection holds ``stable_s``. Each connection of a fault that ends sooner doubles
    the wait before the next connect (from twice ``min_delay_s`` up to ``max_delay_s``);
    a fault's first loss is told, the later ones are counted and told together at most
    once per ``summary_s``. Pure: the caller passes the (monotonic) time."""

    def __init__(
        self,
        stable_s: float = STABLE_CONNECTION_S,
        min_delay_s: float = RECONNECT_MIN_MS / 1000,
        max_delay_s: float = RECONNECT_MAX_MS / 1000,
        summary_s: float = LOSS_SUMMARY_S,
    ) -> None:
        self.stable_s = stable_s
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self.summary_s = summary_s
        self.in_fault = False
        self._connected_at: float | None = None
        self._delay_s = 0.0
        self._untold = 0
        self._told_at = 0.0

    def connected(self, now: float) -> None:
        self._connected_at = now

    def lost(self, now: float) -> Loss:
        """A connection ended (``now``): whether to tell, and when to connect again."""
        began = self._connected_at
        self._connected_at = None
        short = began is not None and now - began < self.stable_s
        self._delay_s = min(self.max_delay_s, max(2 * self.min_delay_s, 2 * self._delay_s))
        if not short:
            self._delay_s = 0.0
        if not self.in_fault:
            self.in_fault, self._untold, self._told_at = True, 0, now
            return Loss(True, 0, 0.0, self._delay_s)
        self._untold += 1
        untold, since = self._untold, now - self._told_at
        if since < self.summary_s:
            return Loss(False, 0, since, self._delay_s)
        self._untold, self._told_at = 0, now
        return Loss(False, untold, since, self._delay_s)

    def held(self) -> int:
        """A connection held ``stable_s``: the fault is over. Returns its losses not told."""
        untold = self._untold if self.in_fault else 0
        self.in_fault, self._delay_s, self._untold = False, 0.0, 0
        return untold


class StreamSubscriber:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        name: str,
        endpoint: str,
        replay_endpoint: str,
        callbacks: StreamCallbacks,
        limits: StreamLimits,
        failures: Counter,
        share: LoopShare,
        first_sequence: int = 0,
        resume_after: int | None = None,
        gate: asyncio.Event | None = None,
    ) -> None:
        self._context = context
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._callbacks = callbacks
        self._limits = limits
        self._failures = failures
        self._share = share  # of the loop, with every other stream: applying waits its turn
        self._sequence = SequenceTracker(first_sequence, can_replay=bool(replay_endpoint))
        # restored from a snapshot: batches up to this one are in the index already, the
        # catch-up replays from the next one (None once caught up, lost or restarted)
        self._resume = resume_after
        self._sequence.last = resume_after
        self._gate = gate or _OPEN  # batches are applied only while it is set
        self.state = SubscriberState.CONNECTING
        self._connection = SubscriberState.CONNECTING  # what ZMQ says, under down and failed
        self.down = False
        self._order = asyncio.Lock()  # live batches, replays and clears, one at a time
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._tasks: list[SupervisedTask] = []
        self._catching_up: SupervisedTask | None = None
        self._faults = ConnectionFaults()
        self._holding: asyncio.TimerHandle | None = None  # ends the fault if it fires
        # a resumed stream's restored blocks are cleared if its publisher is not reached
        self._unreached: asyncio.TimerHandle | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Connect (lazily, like ZMQ) and start reading; raises ZMQError on a bad endpoint
        or when the context has no socket left (nothing stays open then)."""
        try:
            self._sub = self._socket(zmq.SUB)
            self._sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MIN_MS)
            self._sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
            # no pipe until a connection is made: else libzmq's disconnect() leaves a peer
            # that fails the handshake being reconnected forever (libzmq 4.3.5)
            self._sub.setsockopt(zmq.IMMEDIATE, 1)
            self._sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
            self._sub.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_S)
            self._sub.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_S)
            probes = max(1, math.ceil(self._limits.publisher_timeout_s / KEEPALIVE_S))
            self._sub.setsockopt(zmq.TCP_KEEPALIVE_CNT, probes)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            address = f"inproc://conductor-monitor-{next(_monitor_ids)}"
            self._sub.monitor(address, MONITOR_EVENTS)
            self._monitor = self._context.socket(zmq.PAIR)
            self._monitor.setsockopt(zmq.LINGER, 0)
            self._monitor.connect(address)
            self._sub.connect(self.endpoint)
            if self.replay_endpoint:
                self._dealer = self._new_dealer()
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._tasks = [
            self._supervised("live", self._read_live),
            self._supervised("monitor", self._watch),
        ]
        if self._resume is not None:
            self._unreached = asyncio.get_running_loop().call_later(
                self._limits.publisher_timeout_s, self._resume_unreached
            )

    def _resume_unreached(self) -> None:
        """Restored blocks stand for what the engine held when the snapshot was taken: a
        publisher not reached since may be gone, and its blocks go like a lost one's."""
        self._unreached = None
        log.warning(
            "stream=%s resumed from a snapshot but its publisher was not reached within "
            "%g s (publisher_timeout_s): clearing its blocks",
            self.name,
            self._limits.publisher_timeout_s,
        )
        self._callbacks.on_lost()
        self._sequence.reset()
        self._resume = None

    async def stop(self) -> None:
        """Stop every task, then close the sockets: the monitor is disabled while its PAIR
        still listens (libzmq's I/O thread blocks forever sending an event to a monitor
        PAIR nobody listens on, and would take ``disable_monitor`` down with it)."""
        tasks = [*self._tasks, *([self._catching_up] if self._catching_up else [])]
        await asyncio.gather(*(task.stop() for task in tasks))
        self._tasks, self._catching_up = [], None
        self._cancel_holding()
        if self._unreached is not None:
            self._unreached.cancel()
        self._close_sockets()
        self._set_connection(SubscriberState.STOPPED)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IPV6, 1)
        socket.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        socket.setsockopt(zmq.RCVHWM, self._limits.receive_hwm)
        return socket

    def _new_dealer(self) -> zmq.asyncio.Socket:
        dealer = self._socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
        except zmq.ZMQError:
            dealer.close(0)
            raise
        return dealer

    def _close_sockets(self) -> None:
        if self._sub is not None:
            self._sub.monitor(None, 0)
        for socket in (self._monitor, self._sub, self._dealer):
            if socket is not None:
                socket.close(0)
        self._sub = self._monitor = self._dealer = None

    def _supervised(self, task: str, factory: Callable[[], Awaitable[None]]) -> SupervisedTask:
        supervised = SupervisedTask(
            task, factory, self._failures, on_state=lambda _: self._publish_state()
        )
        supervised.start()
        return supervised

    # -- state ---------------------------------------------------------------------------
    @property
    def applied_sequence(self) -> int | None:
        """The last batch applied (None: none since the stream was last read as new)."""
        return self._sequence.last

    def supervised(self) -> list[SupervisedTask]:
        return [*self._tasks, *([self._catching_up] if self._catching_up else [])]

    def _set_connection(self, state: SubscriberState) -> None:
        self._connection = state
        self._publish_state()

    def _publish_state(self) -> None:
        """down > failed > the connection's state: the most urgent news wins."""
        if self.down:
            state = SubscriberState.DOWN
        elif any(task.state is TaskState.FAILED for task in self.supervised()):
            state = SubscriberState.FAILED
        else:
            state = self._connection
        if state != self.state:
            self.state = state
            self._callbacks.on_state(state)

    # -- connection ----------------------------------------------------------------------
    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                if self._unreached is not None:
                    self._unreached.cancel()
                    self._unreached = None
                self._cancel_holding()
                self._faults.connected(time.monotonic())
                self._holding = asyncio.get_running_loop().call_later(
                    self._faults.stable_s, self._connection_held
                )
                self._set_connection(SubscriberState.CONNECTED)
                await self._start_catch_up()
            elif event == zmq.EVENT_DISCONNECTED:
                self._cancel_holding()
                if self._catching_up is not None:  # its replies will never come
                    await self._catching_up.stop()
                    self._catching_up = None
                loss = self._faults.lost(time.monotonic())
                await self._lose_publisher(loss)
                if loss.delay_s:
                    await self._reconnect_after(loss.delay_s)
            elif (
                event == zmq.EVENT_CONNECT_RETRIED
                and self._connection is not SubscriberState.REPLAYING
            ):
                self._set_connection(SubscriberState.DISCONNECTED)

    async def _start_catch_up(self) -> None:
        if self._catching_up is not None:
            await self._catching_up.stop()
        self._catching_up = self._supervised("catch-up", self._catch_up)

    async def _catch_up(self) -> None:
        """A (re)connected stream reads the publisher's buffer now, not at its next batch."""
        async with self._order:
            replay = None if self.down else self._sequence.catch_up()
            if self._resume is not None and not self.down:
                replay = Replay(self._resume + 1, None)
            if replay is not None:
                await self._replay(replay, fail_loudly=True)
            self._resume = None

    async def _lose_publisher(self, loss: Loss) -> None:
        async with self._order:
            self._set_connection(SubscriberState.DISCONNECTED)
            self._callbacks.on_event("lost")
            if loss.first:
                log.warning("stream=%s lost its publisher: clearing its blocks", self.name)
            elif loss.untold:
                log.warning(
                    "stream=%s lost its publisher %d more times in the last %.0f s (each "
                    "connection closed within %g s); connecting again every %.1f s",
                    self.name,
                    loss.untold,
                    loss.since_s,
                    self._faults.stable_s,
                    loss.delay_s,
                )
            self._callbacks.on_lost()
            self._sequence.reset()
            self._resume = None

    async def _reconnect_after(self, delay_s: float) -> None:
        """Connect the endpoint again in ``delay_s``, not in ZMQ's ``RECONNECT_MIN_MS``;
        monitor events of the connection cut meanwhile are dropped (they are no news)."""
        assert self._sub is not None and self._monitor is not None
        try:
            self._sub.disconnect(self.endpoint)
        except zmq.ZMQError:  # not connected (any more): ZMQ reconnects as it would
            return
        try:
            await asyncio.sleep(delay_s)
            while await self._monitor.poll(0):
                await self._monitor.recv_multipart()
        finally:  # whatever happens, the stream must not stay disconnected
            self._sub.connect(self.endpoint)

    def _connection_held(self) -> None:
        self._holding = None
        untold = self._faults.held()
        if untold:
            log.info(
                "stream=%s connection to its publisher holds again (%d more losses before)",
                self.name,
                untold,
            )

    def _cancel_holding(self) -> None:
        if self._holding is not None:
            self._holding.cancel()
            self._holding = None

    async def mark_down(self) -> None:
        """The instance is dead (the router says so): forget its blocks, drop its events."""
        if self._catching_up is not None:
            await self._catching_up.stop()
            self._catching_up = None
        async with self._order:
            self.down = True
            self._callbacks.on_lost()
            self._sequence.reset()
            self._resume = None
            self._publish_state()

    async def mark_up(self) -> None:
        """Index the instance again, starting with its publisher's whole replay buffer."""
        self.down = False
        self._publish_state()
        if self._connection in (SubscriberState.CONNECTED, SubscriberState.REPLAYING):
            await self._start_catch_up()

    # -- live stream ---------------------------------------------------------------------
    async def _read_live(self) -> None:
        assert self._sub is not None
        # the same socket without pyzmq's futures: a batch already queued (a busy stream's
        # usual case) is read at once, ~10 % of ingest's time on bench.service_compare;
        # an empty queue is awaited as before (pyzmq reads the socket's events first)
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(self._sub.underlying)
        while True:
            try:
                frames = queued.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                frames = await self._sub.recv_multipart()
            try:
                message = parse_live(frames)
            except FrameError as error:
                self._callbacks.on_event("bad_frame")
                log.warning("stream=%s dropped malformed message: %s", self.name, error)
                continue
            await self._share.turn()
            async with self._order:
                if self.down:
                    self._callbacks.on_dropped(message)
                else:
                    await self._gate.wait()
                    await self._handle_live(message)

    async def _apply(self, message: Message, replayed: bool) -> None:
        """Apply a batch in the steps the manager cuts it into, a turn before each but the
        first (the caller took that one), or awaiting the ingest thread's answer."""
        for applying in self._callbacks.on_message(message, replayed):
            await (self._share.turn() if applying is None else applying)

    async def _handle_live(self, message: Message) -> None:
        """Execute what the sequence tracker decides for a live batch."""
        for action in self._sequence.live(message.seq):
            match action:
                case Apply():
                    await self._apply(message, replayed=False)
                case DropDuplicate():  # a catch-up replay delivered it first
                    pass
                case Restart(seq=seq, last=last):
                    self._callbacks.on_event("restart")
                    log.warning(
                        "stream=%s publisher restarted (seq %d after %d): clearing its blocks",
                        self.name,
                        seq,
                        last,
                    )
                    self._resume = None
                    self._callbacks.on_restart()
                case Gap(expected=expected, seq=seq):
                    self._callbacks.on_event("gap")
                    log.info("stream=%s gap: expected seq %d, got %d", self.name, expected, seq)
                case Replay():
                    await self._replay(action)
                case GapUnrepaired(seq=seq):
                    self._callbacks.on_event("gap_unrepaired")
                    if self._resume is not None:
                        self._callbacks.on_resume_gap(self._resume + 1, seq)
                        self._resume = None

    # -- replay --------------------------------------------------------------------------
    async def _replay(self, replay: Replay, fail_loudly: bool = False) -> None:
        """Apply the publisher's buffered batches the tracker accepts, in order.

        A replay that fails is counted and logged; the live stream goes on. With
        ``fail_loudly`` (a catch-up, which nothing else would retry) a DEALER that cannot be
        opened (no socket or file descriptor left) is raised to the supervisor, which
        shows the stream "failed" and retries with backoff.
        """
        previous = self._connection
        self._set_connection(SubscriberState.REPLAYING)
        self._callbacks.on_event("replay_requested")
        try:
            if self._dealer is None:
                self._dealer = self._new_dealer()
            async with asyncio.timeout(self._limits.replay_deadline_s):
                await self._receive_replay(self._dealer, replay)
        except (TimeoutError, ReplayFailed, zmq.ZMQError, asyncio.CancelledError) as error:
            self._callbacks.on_event("replay_failed")
            log.warning(
                "stream=%s replay from %d failed: %s",
                self.name,
                replay.start,
                self._failure_reason(error),
            )
            if self._dealer is not None:  # late replies must not leak into the next replay
                self._dealer.close(0)
                self._dealer = None  # opened again by the next replay
            if isinstance(error, asyncio.CancelledError) or (
                fail_loudly and isinstance(error, zmq.ZMQError)
            ):
                raise
        finally:
            self._set_connection(
                SubscriberState.CONNECTED if previous is SubscriberState.REPLAYING else previous
            )

    def _failure_reason(self, error: BaseException) -> str:
        """Why a replay failed, as a sentence for its log line."""
        if isinstance(error, ReplayFailed):
            return str(error)
        if isinstance(error, TimeoutError):
            return f"not done within {self._limits.replay_deadline_s:g} s (replay_deadline_s)"
        if isinstance(error, asyncio.CancelledError):
            return "cancelled (the connection was lost or the stream stopped)"
        return f"{type(error).__name__}: {error}"

    async def _receive_replay(self, dealer: zmq.asyncio.Socket, replay: Replay) -> None:
        await dealer.send_multipart(replay_request(replay.start))
        bad_in_a_row = 0
        while True:
            frames = await self._next_reply(dealer)
            await asyncio.sleep(0)  # a queued reply completes at once: let the deadline fire
            await self._share.turn()
            try:
                message = parse_replay(frames)
            except FrameError as error:
                self._callbacks.on_event("bad_frame")
                log.warning("stream=%s bad replay reply: %s", self.name, error)
                bad_in_a_row += 1
                if bad_in_a_row >= MAX_BAD_REPLIES:
                    raise ReplayFailed(
                        f"{bad_in_a_row} undecodable replies in a row (last: {error})"
                    ) from None
                continue
            bad_in_a_row = 0
            if message is None:
                return
            await self._gate.wait()
            expected = None if self._sequence.last is None else self._sequence.last + 1
            if self._sequence.accept_replayed(message.seq, replay):
                self._check_resume(expected, message.seq)
                await self._apply(message, replayed=True)

    def _check_resume(self, expected: int | None, seq: int) -> None:
        """A resumed stream's first replayed batch must follow its snapshot's: what the
        publisher's buffer lost meanwhile is missing from the index, and is said so."""
        resumed = self._resume
        if resumed is None or expected is None or expected != resumed + 1 or seq <= expected:
            return
        self._callbacks.on_event("gap_unrepaired")
        self._callbacks.on_resume_gap(expected, seq)
        self._resume = None
        log.warning(
            "stream=%s resumed after seq %d but its publisher's buffer starts at %d: "
            "batches %d..%d are not indexed",
            self.name,
            resumed,
            seq,
            expected,
            seq - 1,
        )

    async def _next_reply(self, dealer: zmq.asyncio.Socket) -> list[bytes]:
        timeout = self._limits.replay_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await dealer.recv_multipart()
        except TimeoutError:
            raise ReplayFailed(f"no reply within {timeout:g} s (replay_timeout_s)") from None
