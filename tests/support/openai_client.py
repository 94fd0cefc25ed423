"""The official ``openai`` client against the router and against an engine directly, and
what of their answers must be equal: every byte but the ones that differ per request."""

from __future__ import annotations

import re
from typing import Any

import openai

# an answer's own id and creation time: the only bytes two equal requests' answers differ in
VOLATILE = re.compile(rb'"(id|created)": ?("[^"]*"|\d+)')

GREEDY = {"temperature": 0, "max_tokens": 3}
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 3}  # the same choices every time
USER = [{"role": "user", "content": "Hello world"}]
# the options vLLM serves that the router must pass through untouched, by test id
COMPLETIONS: dict[str, dict[str, Any]] = {
    "text": {"prompt": "Hello world", **GREEDY},
    "texts": {"prompt": ["Hello world", "The quick brown fox"], **GREEDY},
    "id-lists": {"prompt": [[10, 11, 12, 13], [20, 21, 22]], **GREEDY},
    "n2": {"prompt": "Hello world", "n": 2, **SAMPLED},
    "texts-n2": {"prompt": ["Hello world", "Good night"], "n": 2, **SAMPLED},
    "echo": {"prompt": "Hello world", "echo": True, **GREEDY},
    "logprobs": {"prompt": "Hello world", "logprobs": 2, **GREEDY},
    "echo-logprobs": {"prompt": "Hello world", "echo": True, "logprobs": 1, **GREEDY},
}
CHATS: dict[str, dict[str, Any]] = {
    "plain": {"messages": USER, **GREEDY},
    "n2": {"messages": USER, "n": 2, **SAMPLED},
    "logprobs": {"messages": USER, "logprobs": True, "top_logprobs": 2, **GREEDY},
}
# chats vLLM refuses (a 400): its own words must reach the client
INVALID_CHATS: dict[str, dict[str, Any]] = {
    "empty": {"messages": []},
    "empty-no-generation": {"messages": [], "extra_body": {"add_generation_prompt": False}},
    "greedy-n2": {"messages": USER, "n": 2, "temperature": 0},
    "top-without-logprobs": {"messages": USER, "top_logprobs": 2},
}


def client(url: str) -> openai.AsyncOpenAI:
    """A client of the OpenAI API at ``url`` (a router or an engine): no retries, so every
    error is the server's first answer."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def comparable(raw: bytes) -> bytes:
    """An answer's bytes with its ``id`` and ``created`` values masked; key order, spacing
    and every digit of every number kept."""
    return VOLATILE.sub(rb'"\1": _', raw)


async def raw_answer(api: openai.AsyncOpenAI, chat: bool, **request: Any) -> Any:
    """A non-streamed completion (``chat``: a chat completion) as the client received it:
    its status, headers and bytes, and ``parse()`` for the client's own object."""
    if chat:
        return await api.chat.completions.with_raw_response.create(**request)
    return await api.completions.with_raw_response.create(**request)


async def assert_same_answer(
    router: openai.AsyncOpenAI, engine: openai.AsyncOpenAI, chat: bool, **request: Any
) -> Any:
    """The request through the router and straight to the engine: the same status and
    bytes (``comparable``), and the router's ``Content-Length`` the body's. Returns the
    routed answer as the client parses it."""
    routed = await raw_answer(router, chat, **request)
    direct = await raw_answer(engine, chat, **request)
    assert routed.status_code == direct.status_code == 200
    assert comparable(routed.content) == comparable(direct.content), request
    assert int(routed.headers["content-length"]) == len(routed.content)
    assert "transfer-encoding" not in routed.headers
    return routed.parse()


async def refusal(call: Any) -> openai.APIStatusError:
    """The error the client raised for ``call`` (an awaitable create call)."""
    try:
        await call
    except openai.APIStatusError as error:
        return error
    raise AssertionError("the request was not refused")


async def assert_same_refusal(
    router: openai.AsyncOpenAI, engine: openai.AsyncOpenAI, chat: bool, **request: Any
) -> openai.APIStatusError:
    """The request refused by the router exactly as the engine refuses it: status and body
    byte for byte. Returns the router's error."""
    routed = await refusal(raw_answer(router, chat, **request))
    direct = await refusal(raw_answer(engine, chat, **request))
    assert (routed.status_code, routed.response.content) == (
        direct.status_code,
        direct.response.content,
    )
    return routed
