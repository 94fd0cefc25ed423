"""ZMQ framing: live messages, replay requests, replies and end markers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conductor.wire import END_SEQ, FrameError, Message, parse_live, parse_replay, replay_request

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wire_fixtures.json"
CASES: list[dict[str, Any]] = json.loads(FIXTURES.read_text())
SEQ_5 = (5).to_bytes(8, "big")
END = b"\xff" * 8


def test_end_seq_is_minus_one_as_unsigned() -> None:
    """Publishers write ``(-1).to_bytes(8, 'big', signed=True)`` as the end marker."""
    assert END_SEQ == 2**64 - 1
    assert END_SEQ.to_bytes(8, "big") == (-1).to_bytes(8, "big", signed=True) == END


@pytest.mark.parametrize("start", [0, 5, 1000, 2**64 - 2])
def test_replay_request(start: int) -> None:
    """Two frames, empty delimiter then 8-byte BE start (Go sends one frame: vLLM ignores it)."""
    assert replay_request(start) == [b"", start.to_bytes(8, "big")]


REQUESTS = sorted({tuple(c["replay_request_hex"]) for c in CASES if "replay_request_hex" in c})


@pytest.mark.parametrize("request_hex", REQUESTS, ids=["-".join(r) for r in REQUESTS])
def test_replay_request_matches_captured_requests(request_hex: tuple[str, ...]) -> None:
    """The bytes vLLM and SGLang ROUTERs answered when the fixtures were captured."""
    frames = [bytes.fromhex(f) for f in request_hex]
    assert replay_request(int.from_bytes(frames[1], "big")) == frames


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        ([b"", b"", END, b""], None),  # vLLM >= 0.26, SGLang
        ([b"", END, b""], None),  # vLLM <= 0.25
        ([b"", b"kv@m", SEQ_5, b"\x93"], Message(b"kv@m", 5, b"\x93")),
        ([b"", SEQ_5, b"\x93"], Message(b"", 5, b"\x93")),
    ],
    ids=["end_4_frames", "end_3_frames", "reply_4_frames", "reply_3_frames"],
)
def test_parse_replay(frames: list[bytes], expected: Message | None) -> None:
    assert parse_replay(frames) == expected


def test_live_message() -> None:
    assert parse_live([b"kv@m", SEQ_5, b"\x93"]) == Message(b"kv@m", 5, b"\x93")


@pytest.mark.parametrize(
    "frames",
    [[], [SEQ_5], [b"", SEQ_5], [b"", b"", SEQ_5, b"\x93"], [b"", SEQ_5, b"\x93", b"", b""]],
    ids=lambda frames: f"{len(frames)}_frames",
)
def test_live_wrong_frame_count(frames: list[bytes]) -> None:
    with pytest.raises(FrameError):
        parse_live(frames)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"", SEQ_5],
        [b"", b"", SEQ_5, b"\x93", b""],
        [b"x", SEQ_5, b"\x93"],  # no empty delimiter
        [b"x", b"", SEQ_5, b"\x93"],
    ],
    ids=["0_frames", "1_frame", "2_frames", "5_frames", "3_frames_no_delimiter", "4_no_delimiter"],
)
def test_replay_malformed(frames: list[bytes]) -> None:
    with pytest.raises(FrameError):
        parse_replay(frames)


@pytest.mark.parametrize("width", [0, 4, 7, 9, 16])
@pytest.mark.parametrize(
    "build",
    [
        lambda seq: parse_live([b"", seq, b"\x93"]),
        lambda seq: parse_replay([b"", b"", seq, b"\x93"]),
        lambda seq: parse_replay([b"", seq, b"\x93"]),
    ],
    ids=["live", "replay_4", "replay_3"],
)
def test_seq_frame_must_be_8_bytes(build: Callable[[bytes], object], width: int) -> None:
    """A sequence frame of any other width is not a message (Go: 'must be 8 bytes')."""
    with pytest.raises(FrameError):
        build(b"\x00" * width)


def test_seq_is_unsigned_big_endian() -> None:
    seq = bytes.fromhex("0102030405060708")
    assert parse_live([b"", seq, b""]).seq == 0x0102030405060708
    assert parse_live([b"", b"\x80" + b"\x00" * 7, b""]).seq == 2**63
