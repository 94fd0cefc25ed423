"""ZMQ framing of KV-event streams: live messages, replay requests and replies."""

from __future__ import annotations

from dataclasses import dataclass

END_SEQ = 0xFFFFFFFFFFFFFFFF


class FrameError(ValueError):
    """A multipart message that is not a well-formed event message."""


@dataclass(slots=True, frozen=True)
class Message:
    topic: bytes
    seq: int
    payload: bytes


def _seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise FrameError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def parse_live(frames: list[bytes]) -> Message:
    """``[topic, seq(8 B BE), payload]`` as every publisher sends on PUB."""
    if len(frames) != 3:
        raise FrameError(f"expected 3 frames, got {len(frames)}")
    return Message(frames[0], _seq(frames[1]), frames[2])


def parse_replay(frames: list[bytes]) -> Message | None:
    """A DEALER reply: ``[b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang) or
    ``[b"", seq, payload]`` (vLLM <= 0.25). Returns None for the end-of-replay marker."""
    if len(frames) == 4 and frames[0] == b"":
        message = Message(frames[1], _seq(frames[2]), frames[3])
    elif len(frames) == 3 and frames[0] == b"":
        message = Message(b"", _seq(frames[1]), frames[2])
    else:
        raise FrameError(f"malformed replay reply of {len(frames)} frames")
    return None if message.seq == END_SEQ else message


def replay_request(start_seq: int) -> list[bytes]:
    """The two frames a DEALER sends to ask for every buffered batch from ``start_seq``."""
    return [b"", start_seq.to_bytes(8, "big")]
