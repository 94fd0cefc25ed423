"""Made-up log-probabilities in vLLM 0.32's OpenAI shapes.

The simulator has no model, so the values cannot be real ones; they are a pure function of
the sequence's sampling seed and the token's position, so the same request gets the same
numbers on every engine and run, and they agree with how the simulator samples: the token
at each position is the most likely one (rank 1, the highest log-probability) and the
alternatives follow with ranks 2, 3, ... and strictly lower values. A client sees vLLM's
fields, lengths, ranks and ordering; the numbers themselves mean nothing.

vLLM's dict for one position with ``logprobs=k`` holds the chosen token first and the top
``k`` after it; the chosen token being the top one here, that is ``max(k, 1)`` candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
_UNIT = float(1 << 64)

Decode = Callable[[int], str]  # one token id as text


@dataclass(frozen=True, slots=True)
class Candidate:
    token_id: int
    logprob: float
    rank: int


Position = tuple[int, list[Candidate] | None]  # a token and its candidates (None: unknown)


def _unit(seed: int, position: int, salt: int) -> float:
    """A number in [0, 1) fixed by its arguments."""
    data = position.to_bytes(8, "little", signed=True) + salt.to_bytes(4, "little", signed=True)
    return xxhash.xxh3_64_intdigest(data, seed=seed) / _UNIT


def candidates(
    seed: int, position: int, token_id: int, num_logprobs: int, num_ordinary: int
) -> list[Candidate]:
    """``token_id`` at ``position`` of the sequence seeded ``seed`` (rank 1), then the next
    ``num_logprobs - 1`` alternatives, each a different token, each less likely."""
    logprob = -(0.05 + 2.0 * _unit(seed, position, 0))
    chosen = [Candidate(token_id, logprob, 1)]
    used = {token_id}
    salt = 1
    while len(chosen) < max(num_logprobs, 1):
        alternative = int(_unit(seed, position, salt) * num_ordinary)
        salt += 1
        if alternative in used:
            continue
        used.add(alternative)
        logprob -= 0.25 + _unit(seed, position, -salt)
        chosen.append(Candidate(alternative, logprob, len(chosen) + 1))
    return chosen


def positions(
    seed: int,
    token_ids: Sequence[int],
    start: int,
    num_logprobs: int,
    num_ordinary: int,
) -> list[Position]:
    """Each token of ``token_ids`` (at positions ``start``, ``start + 1``, ... of its
    sequence) with its candidates; a sequence's first token has none (nothing precedes it)."""
    return [
        (token_id, None if at == 0 else candidates(seed, at, token_id, num_logprobs, num_ordinary))
        for at, token_id in enumerate(token_ids, start)
    ]


def completion_logprobs(
    entries: Sequence[Position], num_logprobs: int, decode: Decode, offset: int = 0
) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (vLLM's ``CompletionLogProbs``): each position's
    first ``num_logprobs + 1`` candidates (an echoed prompt's may have more); ``text_offset``
    starts at ``offset`` and advances by each token's text, as vLLM counts it."""
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token_id, options in entries:
        token = decode(token_id)
        text_offset.append(offset)
        offset += len(token)
        tokens.append(token)
        token_logprobs.append(None if options is None else options[0].logprob)
        shown = None if options is None else options[: num_logprobs + 1]
        top_logprobs.append(
            None if shown is None else {decode(o.token_id): o.logprob for o in shown}
        )
    return {
        "text_offset": text_offset,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def prompt_logprobs(entries: Sequence[Position], decode: Decode) -> list[Any]:
    """A choice's ``prompt_logprobs`` (vLLM's raw ``Logprob`` dicts by token id)."""
    return [
        None
        if options is None
        else {
            str(o.token_id): {
                "logprob": o.logprob,
                "rank": o.rank,
                "decoded_token": decode(o.token_id),
            }
            for o in options
        }
        for _, options in entries
    ]


def chat_logprobs(entries: Sequence[Position], top_logprobs: int, decode: Decode) -> dict[str, Any]:
    """A chat choice's ``logprobs`` (vLLM's ``ChatCompletionLogProbs``): each token with
    its value and UTF-8 bytes, and its first ``top_logprobs`` candidates."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = decode(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = []
    for token_id, options in entries:
        assert options is not None, "generated tokens always have candidates"
        top = [entry(o.token_id, o.logprob) for o in options[:top_logprobs]]
        content.append(entry(token_id, options[0].logprob) | {"top_logprobs": top})
    return {"content": content}
