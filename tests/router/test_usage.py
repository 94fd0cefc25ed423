"""The usage tap: the engine's cached-token count from answers cut at any byte."""

from __future__ import annotations

import json
import random

import pytest

from router import usage
from router.usage import UsageTap, cached_tokens


def sse(*payloads: object) -> bytes:
    """Events framed as vLLM frames them: ``data: <compact JSON>\\n\\n``."""
    return b"".join(
        f"data: {p if isinstance(p, str) else json.dumps(p, separators=(',', ':'))}\n\n".encode()
        for p in payloads
    )


def chunk(text: str) -> dict:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def usage_of(cached: int) -> dict:
    details = {"cached_tokens": cached}
    return {"prompt_tokens": 90, "completion_tokens": 3, "prompt_tokens_details": details}


STREAM = sse(chunk("a"), chunk("b"), {"choices": [], "usage": usage_of(48)}, "[DONE]")


def tapped(data: bytes, streaming: bool, cuts: list[int]) -> int | None:
    tap = UsageTap(streaming)
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        tap.feed(data[start:end])
    return tap.cached_tokens()


@pytest.mark.parametrize("seed", range(20))
def test_stream_usage_survives_any_chunking(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 40)))
    assert tapped(STREAM, True, cuts) == 48


def test_stream_usage_byte_by_byte_and_whole() -> None:
    assert tapped(STREAM, True, list(range(1, len(STREAM)))) == 48
    assert tapped(STREAM, True, []) == 48


def test_stream_without_usage_is_unknown() -> None:
    assert tapped(sse(chunk("a"), chunk("b"), "[DONE]"), True, [7]) is None
    no_details = {"choices": [], "usage": {"prompt_tokens": 90, "prompt_tokens_details": None}}
    assert tapped(sse(chunk("a"), no_details, "[DONE]"), True, []) is None


def test_the_last_usage_wins_and_generated_text_is_not_usage() -> None:
    continuous = [{**chunk(str(n)), "usage": usage_of(n)} for n in range(5)]
    assert tapped(sse(*continuous, "[DONE]"), True, [30, 200]) == 4
    liar = chunk('{"usage": {"prompt_tokens_details": {"cached_tokens": 9}}}')
    assert tapped(sse({"choices": [], "usage": usage_of(48)}, liar), True, []) == 48


def test_a_last_event_without_its_blank_line_still_counts() -> None:
    assert tapped(sse(chunk("a")) + sse({"usage": usage_of(16)})[:-2], True, [3]) == 16


def test_json_answer_in_pieces() -> None:
    answer = json.dumps({"choices": [chunk("x")["choices"][0]], "usage": usage_of(32)}).encode()
    assert tapped(answer, False, [5, 17, 60]) == 32
    assert tapped(json.dumps({"usage": {"prompt_tokens": 4}}).encode(), False, []) is None
    assert tapped(b'{"usage": ', False, []) is None


def test_oversized_json_answer_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(usage, "MAX_KEPT_BYTES", 64)
    answer = json.dumps({"choices": [{"text": "x" * 100}], "usage": usage_of(8)}).encode()
    assert tapped(answer, False, [50]) is None


def test_cached_tokens_of_parsed_answers() -> None:
    assert cached_tokens({"usage": usage_of(7)}) == 7
    for junk in (None, [], {"usage": None}, {"usage": {"prompt_tokens_details": 3}}):
        assert cached_tokens(junk) is None
    assert cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}) is None
