"""The vLLM-wire KV-event publisher any engine, cache daemon or test embeds.

It behaves like vLLM 0.33's ``ZmqEventPublisher``, so whatever consumes a real engine's
stream (this project's conductor, the Go conductor, Dynamo) consumes this one unchanged:
a PUB socket sends ``[topic, seq (8 B BE), payload]`` per batch, sequence numbers count
batches from 0, and a ROUTER serves replays of the last ``buffer_steps`` batches with the
identical bytes, followed by an end marker.

One sender thread owns the sockets and services replay requests between queue polls, as in
vLLM; ``publish`` only encodes and enqueues, so it never blocks an asyncio loop and may be
called from any thread.

Deviations from vLLM, each deliberate:
- the queue is unbounded: vLLM's bounded queue blocks ``publish`` when full, which would
  stall an event loop; the sender thread only hands bytes to ZMQ (PUB drops at its HWM
  rather than blocking), so the queue does not grow in practice;
- the sequence number is taken in ``publish`` (under a lock, in queue order) instead of in
  the thread, so callers learn it; the wire cannot tell the difference;
- ``bind`` can override vLLM's bind-or-connect guess (SGLang has the same option), so
  tests can bind 127.0.0.1 and an ephemeral port.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from time import time
from types import TracebackType

import zmq

from conductor.failures import describe
from conductor.wire.events import Event
from conductor.wire.frames import END_SEQ

from .encoding import Layout, WireEvent, check_layout, encode_batch

log = logging.getLogger(__name__)

END_SEQ_BYTES = END_SEQ.to_bytes(8, "big")
QUEUE_POLL_SECONDS = 0.1  # vLLM's: also the longest a replay request waits on an idle publisher


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of DP rank ``r``: tcp port + r (port 0 stays ephemeral), inproc ``_dp{r}``.

    One publisher per DP rank must not collide on the same address; consumers derive every
    rank's address from rank 0's the same way.
    """
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"cannot offset {endpoint!r} by a DP rank: only tcp:// and inproc:// can")


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: a wildcard, IPv6 or local endpoint is a bind address,
    anything else names a remote SUB to connect to."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def replay_replies(
    request: list[bytes], buffer: Iterable[tuple[int, bytes]], topic: bytes | None
) -> Iterator[list[bytes]]:
    """The ROUTER's replies to ``[identity, b"", start_seq]``: every buffered batch from
    start_seq on, then the end marker, as vLLM answers (``topic`` None: as vLLM <= 0.25,
    without the topic frame)."""
    identity, _, start = request
    start_seq = int.from_bytes(start, "big")
    topic_frame = [] if topic is None else [topic]
    for seq, payload in buffer:
        if seq >= start_seq:
            yield [identity, b"", *topic_frame, seq.to_bytes(8, "big"), payload]
    end_topic = [] if topic is None else [b""]
    yield [identity, b"", *end_topic, END_SEQ_BYTES, b""]


class KVEventPublisher:
    """Publishes KV-event batches on the vLLM wire; see the module docstring.

    ``endpoint`` and ``replay_endpoint`` are the addresses actually bound or connected
    (ZMQ's LAST_ENDPOINT): the real port after binding ``tcp://127.0.0.1:0``, ``0.0.0.0``
    for a ``*`` bind, ``_dp{r}``/``+r`` applied; ``replay_endpoint`` is None without replay.
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        data_parallel_rank: int = 0,
        topic: str = "",
        layout: Layout = "vllm",
        legacy_replay: bool = False,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        bind: bool | None = None,
    ) -> None:
        """Create and bind (or connect) the sockets now, so address errors raise here.

        ``legacy_replay`` answers replays as vLLM <= 0.25 did (no topic frame);
        ``bind`` None applies vLLM's rule (``binds``); the ROUTER always binds.
        """
        self.data_parallel_rank = data_parallel_rank
        self.layout = check_layout(layout)
        self._topic = topic.encode("utf-8")
        self._legacy_replay = legacy_replay
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._next_seq = 0
        self._handled = 0  # batches the thread took off the queue, sent or not
        self._closed = False
        self._state = threading.Condition()

        context = zmq.Context.instance()
        pub_endpoint = offset_endpoint(endpoint, data_parallel_rank)
        self._pub = _socket(context, zmq.PUB, hwm, pub_endpoint)
        self._router: zmq.Socket | None = None
        try:
            if binds(pub_endpoint) if bind is None else bind:
                self._pub.bind(pub_endpoint)
            else:
                self._pub.connect(pub_endpoint)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                router_endpoint = offset_endpoint(replay_endpoint, data_parallel_rank)
                # room for two whole-buffer replays with their end markers, as vLLM sizes it
                router_hwm = 2 * (buffer_steps + 1)
                self._router = _socket(context, zmq.ROUTER, router_hwm, router_endpoint)
                self._router.bind(router_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # -- caller side ---------------------------------------------------------------------
    def publish(
        self,
        events: Sequence[Event | WireEvent],
        dp_rank: int | None = None,
        *,
        timestamp: float | None = None,
    ) -> int:
        """Queue one batch and return its sequence number; never blocks on the network.

        ``dp_rank`` None is filled with the publisher's rank and ``timestamp`` None with
        ``time.time()``, as vLLM's scheduler and publisher do. Encoding happens here, so a
        malformed event raises in the caller, not in the sender thread.
        """
        payload = encode_batch(
            events,
            time() if timestamp is None else timestamp,
            self.data_parallel_rank if dp_rank is None else dp_rank,
            self.layout,
        )
        with self._state:
            if self._closed:
                raise RuntimeError("publisher is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._queue.put((seq, payload))
        return seq

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch queued so far was handed to the PUB socket (and entered
        the replay buffer); False if that did not happen within ``timeout`` seconds."""
        with self._state:
            target = self._next_seq
            return self._state.wait_for(lambda: self._handled >= target, timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Hand what is queued to the PUB socket, stop the thread and close the sockets
        (linger 0, as vLLM), within ``timeout``. Idempotent.

        If the thread does not stop in time it is left to close the sockets itself when it
        does (it is a daemon; closing them from here would race it).
        """
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("publisher thread still running timeout_s=%s", timeout)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- sender thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._router is not None and self._router.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=QUEUE_POLL_SECONDS)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(*item)
        finally:
            self._close_sockets()

    def _send(self, seq: int, payload: bytes) -> None:
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
        except zmq.ZMQError as error:
            # a lost batch is a gap consumers repair; a dead thread is not
            log.error("publish failed seq=%d error=%s", seq, describe(error))
        finally:
            with self._state:
                self._handled += 1
                self._state.notify_all()

    def _serve_replay(self) -> None:
        """Answer ``[identity, b"", start_seq]`` with every buffered batch from start_seq on,
        then the end marker. Anything else is ignored (no reply), as vLLM does."""
        assert self._router is not None
        try:
            frames = self._router.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request ignored frames=%d", len(frames))
                return
            topic = None if self._legacy_replay else self._topic
            for reply in replay_replies(frames, self._buffer, topic):
                self._router.send_multipart(reply)
        except zmq.ZMQError as error:
            log.error("replay failed error=%s", describe(error))

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=0)


def _socket(context: zmq.Context, kind: int, send_hwm: int, endpoint: str) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, send_hwm)
    if "[" in endpoint:  # an IPv6 literal can only be bound or reached with IPv6 enabled
        socket.setsockopt(zmq.IPV6, 1)
    return socket
