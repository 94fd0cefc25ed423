"""A vLLM 0.33 KV-event publisher on real ZMQ sockets, for driving the conductor in tests.

It speaks vLLM's exact wire (3-frame PUB messages, ROUTER replay with 4-frame
replies and an end marker, or the 3-frame form of vLLM <= 0.25) and can withhold batches
from the live stream to create gaps a replay must fill.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END_MARKER = (2**64 - 1).to_bytes(8, "big")


def stored(
    hashes: list[int],
    tokens: list[int],
    parent: int | None = None,
    medium: str = "GPU",
    block_size: int = 4,
    **extra: Any,
) -> dict[str, Any]:
    """A BlockStored map exactly as vLLM 0.33's BlockPool emits it."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        **extra,
    }


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def _bind(socket: zmq.asyncio.Socket, port: int, timeout: float = 3.0) -> None:
    """Bind, retrying while a just-closed socket still holds the port (ZMQ closes lazily)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.bind(f"tcp://127.0.0.1:{port}")
            return
        except zmq.ZMQError as error:
            if error.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class WirePublisher:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        topic: bytes = b"",
        with_replay: bool = True,
        legacy_replay: bool = False,
    ) -> None:
        self._context = context
        self.topic = topic
        self._with_replay = with_replay
        self._legacy_replay = legacy_replay
        self.next_seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.endpoint = ""
        self.replay_endpoint = ""
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.replay_requests: list[int] = []

    def start(self, port: int = 0, replay_port: int = 0) -> WirePublisher:
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        _bind(self._pub, port)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._with_replay:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            _bind(self._router, replay_port)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.create_task(self._serve_replays())
        return self

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(0)

    @staticmethod
    def payload(events: list[dict[str, Any]], dp_rank: int | None = 0) -> bytes:
        return msgpack.packb([time.time(), events, dp_rank])

    async def publish(
        self, events: list[dict[str, Any]], *, send: bool = True, dp_rank: int | None = 0
    ) -> int:
        """Publish one batch; with ``send=False`` it only enters the replay buffer (a loss)."""
        seq = self.next_seq
        self.next_seq += 1
        payload = self.payload(events, dp_rank)
        self.buffer.append((seq, payload))
        if send:
            await self.send_raw([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        assert self._pub is not None
        await self._pub.send_multipart(frames)

    async def _serve_replays(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and answers nothing
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    body = [seq.to_bytes(8, "big"), payload]
                    head = [identity, b""] if self._legacy_replay else [identity, b"", self.topic]
                    await self._router.send_multipart(head + body)
            end = [b"", END_MARKER, b""] if self._legacy_replay else [b"", b"", END_MARKER, b""]
            await self._router.send_multipart([identity, *end])
