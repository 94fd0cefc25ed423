"""The OpenAI API as vLLM serves it, through the router, with the official ``openai``
client: a router process in front of two engine simulators, each serving its own model
(``m``, tokenized by the router itself; ``other``, the default model, tokenized by its
engine's ``/tokenize``).

Each request goes through the router and straight to the engine that serves it; their
answers must be the same bytes but for what differs per request (the answer's ``id`` and
``created``, masked by ``tests.support.openai_client.comparable``), and the router's
non-streamed answer keeps the engine's ``Content-Length``. Prompts stay under a block (64
tokens), so no answer reports cached tokens another did not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.support.api import eventually, metric, post
from tests.support.openai_client import (
    CHATS,
    COMPLETIONS,
    GREEDY,
    INVALID_CHATS,
    SAMPLED,
    USER,
    assert_same_answer,
    assert_same_refusal,
    client,
    comparable,
    raw_answer,
    refusal,
)
from tests.support.processes import EngineSim, RouterProcess

BLOCK = 64  # longer than every prompt here: no answer differs by a cache hit
LOCAL, OTHER = "m", "other"  # tokenized by the router / by the engine's /tokenize


@dataclass(frozen=True)
class Surface:
    router: str
    engines: dict[str, str]  # model name -> its engine's URL


@pytest.fixture(scope="module")
def surface(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Surface]:
    run_dir = tmp_path_factory.mktemp("surface")
    engines = {
        name: EngineSim(run_dir, name, "--tokenizer", str(model_dir), model=name, block_size=BLOCK)
        for name in (LOCAL, OTHER)
    }
    router = None
    try:
        for engine in engines.values():
            engine.wait_ready()
        config = {
            "conductor": {"embedded": True},
            "models": [
                {
                    "modelname": LOCAL,
                    "block_size": BLOCK,
                    "instances": [{"instance_id": LOCAL, "http_endpoint": engines[LOCAL].url}],
                    "tokenizer": {"path": str(model_dir)},
                },
                {
                    "modelname": OTHER,
                    "block_size": BLOCK,
                    "default": True,
                    "instances": [{"instance_id": OTHER, "http_endpoint": engines[OTHER].url}],
                },
            ],
        }
        router = RouterProcess(run_dir, config)
        router.wait_ready()
        yield Surface(router.url, {name: engine.url for name, engine in engines.items()})
    finally:
        if router is not None:
            router.stop()
        for engine in engines.values():
            engine.stop()


@pytest.fixture
async def ready(surface: Surface, http: aiohttp.ClientSession) -> Surface:
    """Once the router tokenizes ``m``'s completions and chats itself (its engine agreed)
    and knows which models the engines serve."""
    active = f'router_local_tokenizer_active{{model="{LOCAL}"}}'
    await eventually(lambda: metric(http, surface.router, active), lambda n: n == 2)

    async def listed() -> set[str]:
        async with http.get(f"{surface.router}/v1/models") as response:
            return {card["id"] for card in (await response.json())["data"]}

    await eventually(listed, lambda names: names == {LOCAL, OTHER})
    return surface


def clients(surface: Surface, model: str) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    """(the router's client, the client of the engine serving ``model``)."""
    return client(surface.router), client(surface.engines[model])


@pytest.mark.parametrize("model", [LOCAL, OTHER])
@pytest.mark.parametrize("request_", list(COMPLETIONS.values()), ids=list(COMPLETIONS))
async def test_completions_answer_as_the_engine_does(
    ready: Surface, model: str, request_: dict[str, Any]
) -> None:
    router, engine = clients(ready, model)
    answer = await assert_same_answer(router, engine, chat=False, model=model, **request_)
    prompt = request_["prompt"]
    prompts = len(prompt) if isinstance(prompt, list) else 1
    assert len(answer.choices) == prompts * request_.get("n", 1)
    assert answer.model == model
    if request_.get("echo"):
        assert answer.choices[0].text.startswith("Hello world")


@pytest.mark.parametrize("model", [LOCAL, OTHER])
@pytest.mark.parametrize("request_", list(CHATS.values()), ids=list(CHATS))
async def test_chats_answer_as_the_engine_does(
    ready: Surface, model: str, request_: dict[str, Any]
) -> None:
    router, engine = clients(ready, model)
    answer = await assert_same_answer(router, engine, chat=True, model=model, **request_)
    assert len(answer.choices) == request_.get("n", 1)
    if request_.get("logprobs"):
        assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 2


async def test_a_request_without_model_goes_to_the_default_model(ready: Surface) -> None:
    """vLLM serves a request without ``model``; so does the router, on the default model's
    engines (``other`` here, though ``m`` is listed first)."""
    router, engine = clients(ready, OTHER)
    for chat, prompt in ((False, {"prompt": "Hello world"}), (True, {"messages": USER})):
        answer = await assert_same_answer(
            router, engine, chat=chat, model=openai.omit, **prompt, **GREEDY
        )
        assert answer.model == OTHER


async def test_an_unknown_model_is_the_clients_not_found_error(ready: Surface) -> None:
    router, _ = clients(ready, LOCAL)
    error = await refusal(router.completions.create(model="nope", prompt="Hello", max_tokens=2))
    assert isinstance(error, openai.NotFoundError)
    assert error.body == {
        "message": f"The model `nope` does not exist. Valid aliases: {LOCAL}, {OTHER}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


@pytest.mark.parametrize("model", [LOCAL, OTHER])
@pytest.mark.parametrize("request_", list(INVALID_CHATS.values()), ids=list(INVALID_CHATS))
async def test_an_invalid_chat_is_refused_in_the_engines_words(
    ready: Surface, model: str, request_: dict[str, Any]
) -> None:
    """Not the router's tokenizer's error, nor its rewording of an engine's /tokenize
    refusal: the engine's own answer to the request, byte for byte."""
    router, engine = clients(ready, model)
    error = await assert_same_refusal(
        router, engine, chat=True, model=model, max_tokens=2, **request_
    )
    assert isinstance(error, openai.BadRequestError)


@pytest.mark.parametrize("model", [LOCAL, OTHER])
async def test_malformed_messages_are_refused_in_the_engines_words(
    ready: Surface, model: str, http: aiohttp.ClientSession
) -> None:
    """Messages that are no list (the client's types forbid them; a raw client may send
    them): the engine's answer, naming the field as vLLM does."""
    body = {"model": model, "messages": "Hello", "max_tokens": 2}
    answers = []
    for url in (ready.router, ready.engines[model]):
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            answers.append((response.status, await response.read()))
    assert answers[0] == answers[1]
    assert answers[0][0] == 400


@pytest.mark.parametrize("model", [LOCAL, OTHER])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_streams_stay_server_sent_events(ready: Surface, model: str, chat: bool) -> None:
    """A stream (several prompts, n=2, usage at the end) is the engine's events, chunked:
    the client reads the same chunks through the router as straight from the engine."""
    router, engine = clients(ready, model)
    request: dict[str, Any] = {"model": model, "n": 2, **SAMPLED, "stream": True}
    request["stream_options"] = {"include_usage": True}
    if chat:
        request["messages"] = USER
    else:
        request["prompt"] = ["Hello world", "Good night"]
    chunks = []
    for api in (router, engine):
        raw = await raw_answer(api, chat, **request)
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in raw.headers
        chunks.append([comparable(chunk.model_dump_json().encode()) async for chunk in raw.parse()])
    assert chunks[0] == chunks[1]
    assert len(chunks[0]) > 2


async def test_a_batch_is_routed_by_its_first_prompt(
    ready: Surface, http: aiohttp.ClientSession
) -> None:
    """A batch of texts is routed by its first prompt's ids (the prompt tokens the router
    counts), tokenized where its model's prompts are: by the router, or by the engine's
    /tokenize given only the first text; a batch of id lists by its first list."""
    texts = ["Hello world", "The quick brown fox"]
    first = await post(http, f"{ready.engines[LOCAL]}/tokenize", {"prompt": texts[0]})
    cases = [
        (LOCAL, texts, "local", first[1]["count"]),
        (OTHER, texts, "engine", first[1]["count"]),
        (LOCAL, [[10, 11, 12, 13], [20, 21, 22]], "given", 4),
    ]
    for model, prompt, tokenized_by, routed_tokens in cases:
        before = await metric(http, ready.router, "router_prompt_tokens_total")
        body = {"model": model, "prompt": prompt, **GREEDY}
        async with http.post(f"{ready.router}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert response.headers["x-conductor-tokenized-by"] == tokenized_by
            assert response.headers["x-conductor-prefill-instance"] == model
        routed = await metric(http, ready.router, "router_prompt_tokens_total") - before
        assert routed == routed_tokens, model
