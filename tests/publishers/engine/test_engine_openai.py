"""The simulator's OpenAI options (list prompts, ``n``, ``echo``, ``logprobs``, ``model``)
against what real vLLM 0.32 answered, and what each option means.

``tests/fixtures/vllm_openai_options.json`` (``scripts/capture-vllm-openai-options.py``)
holds a real vLLM CPU engine's answers, serving the tiny model and its LoRA adapter, to one
request per option, sent one at a time, with the KV events each published. The simulator,
started with the same tokenizer (the tiny model's), flags, block size and PYTHONHASHSEED,
gets the same requests in the same order. Its answers must have vLLM's status, and for an
error vLLM's words; otherwise the same usage (prompt, completion and cached tokens), the
same keys and JSON types recursively (generated text and made-up log-probabilities differ
by nature), and its KV events must be vLLM's, field by field, hashes included.

The tests after it pin what the shapes cannot show: choice order, echoes, how logprobs
line up with the text, streams that merge several choices, and cache accounting.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from fleet.tiny_model import write_tiny_model
from tests.publishers.test_publisher import receive, subscriber
from tests.support.api import eventually, metric, post
from tests.support.processes import REPO, EngineSim, free_port
from tests.support.vllm_shapes import shape

CAPTURE = json.loads((REPO / "tests/fixtures/vllm_openai_options.json").read_text())
CASES: list[dict[str, Any]] = CAPTURE["cases"]
MODEL = CAPTURE["base_model"]
LORA = CAPTURE["lora"]
ONLY_IN_VLLM_032 = "kv_cache_spec_kind"  # vLLM 0.32's GPU events; the simulator's are 0.33's
LONG = list(range(100, 200))  # the capture's 100-token prompt: three blocks of 32 and a bit
USER = [{"role": "user", "content": "Hello world"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def start_engine(log_dir: Path, model_dir: Path, events_port: int, name: str) -> EngineSim:
    """The capture's engine: its model path (as ``MODEL_DIR``), tokenizer, context, block
    size, adapter (same name and path string), hash seed and events."""
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "topic": "kv-events",
    }
    engine = EngineSim(
        log_dir,
        name,
        "MODEL_DIR",
        "--tokenizer",
        str(model_dir),
        "--max-model-len",
        "2048",
        "--kv-events-config",
        json.dumps(events),
        "--sim-kv-bind",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"{LORA['name']}={LORA['path']}",
        model=MODEL,
        block_size=CAPTURE["block_size"],
        env={"PYTHONHASHSEED": "0"},
    )
    engine.wait_ready()
    return engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[EngineSim]:
    """For the tests that leave no state another relies on."""
    started = start_engine(tmp_path_factory.mktemp("engine"), model_dir, free_port(), "options")
    try:
        yield started
    finally:
        started.stop()


# -- the capture, case by case --------------------------------------------------------------


def logprob_free(value: Any, key: str = "") -> Any:
    """``value`` with the dicts keyed by token (text or id) as lists of their values, and a
    token's bytes as a list of ints even when the token is empty: which tokens they name is
    the model's business, their layout is vLLM's."""
    if key == "bytes" and isinstance(value, list):
        return [0]
    if isinstance(value, dict):
        if key in ("top_logprobs", "prompt_logprobs") and "logprob" not in value:
            return [logprob_free(item) for item in value.values()]
        return {k: logprob_free(item, k) for k, item in value.items()}
    if isinstance(value, list):
        return [logprob_free(item, key) for item in value]
    return value


def counts(usage: dict[str, Any]) -> dict[str, int]:
    """What usage must agree on: the token counts and the cached tokens (vLLM also names
    fields it leaves empty here)."""
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {key: usage[key] for key in keys} | {
        "cached": usage["prompt_tokens_details"]["cached_tokens"]
    }


async def send(http: aiohttp.ClientSession, url: str, case: dict[str, Any]) -> dict[str, Any]:
    async with http.request(case["method"], url + case["path"], json=case["body"]) as response:
        text = await response.text()
        got: dict[str, Any] = {"status": response.status}
        if response.content_type == "text/event-stream":
            events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
            got["sse"] = [event if event == "[DONE]" else json.loads(event) for event in events]
        else:
            got["json"] = json.loads(text)
        return got


def assert_like_vllm(got: dict[str, Any], case: dict[str, Any]) -> None:
    assert got["status"] == case["status"], got
    if case["status"] != 200:
        assert got["json"] == case["json"]  # vLLM's words, type, param and code
        return
    if "json" in case:
        want, answer = case["json"], got["json"]
        assert shape(logprob_free(answer)) == shape(logprob_free(want))
        if "usage" in want:
            assert counts(answer["usage"]) == counts(want["usage"])
            assert [c["index"] for c in answer["choices"]] == [c["index"] for c in want["choices"]]
            assert answer["model"] == want["model"]
        return
    *chunks, done = got["sse"]
    *want, want_done = case["sse"]
    assert done == want_done == "[DONE]"
    # chunks of several choices interleave as their tokens come: the kinds of chunk, the
    # first and the last must be vLLM's, and each choice must end once
    assert shape(logprob_free(chunks)) == shape(logprob_free(want))
    assert shape(logprob_free(chunks[0])) == shape(logprob_free(want[0]))
    assert shape(logprob_free(chunks[-1])) == shape(logprob_free(want[-1]))
    assert ended(chunks) == ended(want)
    if "usage" in want[-1]:
        assert counts(chunks[-1]["usage"]) == counts(want[-1]["usage"])


def ended(chunks: list[dict[str, Any]]) -> list[int]:
    return sorted(c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"])


def events_of(payload: bytes) -> tuple[list[list[tuple[str, Any]]], int]:
    """A batch's events field by field (without vLLM 0.32's extra field) and its DP rank."""
    _, events, rank = msgpack.unpackb(payload)
    return [[(k, v) for k, v in e.items() if k != ONLY_IN_VLLM_032] for e in events], rank


async def test_each_option_is_answered_as_real_vllm_answered_it(
    tmp_path: Path, model_dir: Path, http: aiohttp.ClientSession
) -> None:
    events_port = free_port()
    engine = start_engine(tmp_path, model_dir, events_port, "capture")
    try:
        with subscriber(f"tcp://127.0.0.1:{events_port}") as sub:
            for case in CASES:
                got = await send(http, engine.url, case)
                try:
                    assert_like_vllm(got, case)
                    for frame in case["frames"]:
                        _, _, payload = receive(sub)
                        _, events, rank = frame
                        want = [[(k, v) for k, v in e.items() if k != ONLY_IN_VLLM_032]
                                for e in events]  # fmt: skip
                        assert events_of(payload) == (want, rank)
                except AssertionError as error:
                    raise AssertionError(f"case {case['name']}: {error}") from error
            assert not sub.poll(300), "a KV-event batch vLLM did not publish"
    finally:
        engine.stop()


# -- what each option means ----------------------------------------------------------------


async def complete(http: aiohttp.ClientSession, engine: EngineSim, **body: Any) -> dict[str, Any]:
    status, answer = await post(http, f"{engine.url}/v1/completions", {"model": MODEL, **body})
    assert status == 200, answer
    return answer


async def chat(http: aiohttp.ClientSession, engine: EngineSim, **body: Any) -> dict[str, Any]:
    url = f"{engine.url}/v1/chat/completions"
    status, answer = await post(http, url, {"model": MODEL, "messages": USER, **body})
    assert status == 200, answer
    return answer


async def stream(
    http: aiohttp.ClientSession, engine: EngineSim, path: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{engine.url}{path}", json=body) as response:
        assert response.status == 200, await response.text()
        text = await response.text()
    events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


async def tokens_of(http: aiohttp.ClientSession, engine: EngineSim, prompt: Any) -> list[int]:
    status, answer = await post(http, f"{engine.url}/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200, answer
    return answer["tokens"]


def texts(answer: dict[str, Any]) -> list[str]:
    return [choice["text"] for choice in answer["choices"]]


async def test_list_prompts_and_n_give_a_choice_per_prompt_and_sample_in_vllms_order(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    prompts = ["The quick brown fox", "Good night moon"]
    single = [texts(await complete(http, engine, prompt=p, max_tokens=3)) for p in prompts]
    answer = await complete(http, engine, prompt=prompts, n=3, max_tokens=3)
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    by_prompt = [texts(answer)[0:3], texts(answer)[3:6]]
    for samples, (alone,) in zip(by_prompt, single, strict=True):
        assert samples[0] == alone  # a request's first sample is what n = 1 answers
        assert len(set(samples)) == 3  # the others are other samples
    tokens = [len(await tokens_of(http, engine, p)) for p in prompts]
    assert answer["usage"]["prompt_tokens"] == sum(tokens)  # each prompt once, not n times
    assert answer["usage"]["completion_tokens"] == 6 * 3

    ids = [[10, 11, 12, 13], [20, 21, 22]]
    by_ids = await complete(http, engine, prompt=ids, max_tokens=2)
    assert len(by_ids["choices"]) == 2 and by_ids["usage"]["prompt_tokens"] == 7


async def test_a_stream_of_several_choices_says_the_same_as_the_whole_answer(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    body = {"prompt": ["The quick brown fox", "Good night moon"], "n": 2, "max_tokens": 4}
    whole = await complete(http, engine, **body)
    chunks = await stream(http, engine, "/v1/completions", body)
    *deltas, last = chunks
    streamed = ["".join(c["text"] for d in deltas for c in d["choices"] if c["index"] == i)
                for i in range(4)]  # fmt: skip
    assert streamed == texts(whole)
    assert last["choices"] == [] and last["usage"] == last["usage"] | {
        "prompt_tokens": whole["usage"]["prompt_tokens"],
        "completion_tokens": 16,
    }

    messages = await stream(http, engine, "/v1/chat/completions",
                            {"messages": USER, "n": 2, "max_tokens": 3})  # fmt: skip
    roles = [c["choices"][0] for c in messages[:2]]
    assert roles == [{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for i in (0, 1)]  # fmt: skip
    whole_chat = await chat(http, engine, n=2, max_tokens=3)
    for index, choice in enumerate(whole_chat["choices"]):
        parts = [c["delta"]["content"] for m in messages[2:-1] for c in m["choices"]
                 if c["index"] == index]  # fmt: skip
        assert "".join(parts) == choice["message"]["content"]


async def test_echo_repeats_the_prompt_as_given_or_as_its_ids_decode(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    plain = await complete(http, engine, prompt="Hello world", max_tokens=2)
    echoed = await complete(http, engine, prompt="Hello world", max_tokens=2, echo=True)
    assert texts(echoed) == ["Hello world" + texts(plain)[0]]
    ids = [10, 11, 12, 13]
    async with http.post(f"{engine.url}/detokenize", json={"tokens": ids}) as response:
        decoded = (await response.json())["prompt"]
    by_ids = await complete(http, engine, prompt=ids, max_tokens=2, echo=True)
    assert texts(by_ids)[0].startswith(decoded)
    only = await complete(http, engine, prompt="Hello world", max_tokens=0, echo=True)
    assert texts(only) == ["Hello world"] and only["usage"]["completion_tokens"] == 1

    *deltas, _ = await stream(http, engine, "/v1/completions",
                              {"prompt": "Hello world", "max_tokens": 2, "echo": True})  # fmt: skip
    first = deltas[0]["choices"][0]
    assert first["text"].startswith("Hello world")
    assert first["prompt_token_ids"] == await tokens_of(http, engine, "Hello world")
    assert "".join(d["choices"][0]["text"] for d in deltas) == texts(echoed)[0]


def check_completion_logprobs(logprobs: dict[str, Any], text: str, k: int) -> None:
    """vLLM's layout: offsets advance by each token's text, each position's candidates put
    the chosen token first with the highest value, ``max(k, 1)`` of them."""
    tokens = logprobs["tokens"]
    assert "".join(tokens) == text
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert logprobs["text_offset"] == offsets
    for token, value, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"],
                                 strict=True):  # fmt: skip
        if top is None:  # the first prompt token: nothing precedes it
            assert value is None
            continue
        assert len(top) == max(k, 1) and next(iter(top)) == token
        assert top[token] == value == max(top.values()) and value < 0


async def test_logprobs_line_up_with_the_text_they_describe(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    for k in (0, 1, 5):
        answer = await complete(http, engine, prompt="Hello world", max_tokens=4, logprobs=k)
        (choice,) = answer["choices"]
        check_completion_logprobs(choice["logprobs"], choice["text"], k)
    again = await complete(http, engine, prompt="Hello world", max_tokens=4, logprobs=5)
    assert again["choices"][0]["logprobs"] == choice["logprobs"]  # the same every time

    echoed = await complete(http, engine, prompt="Hello world", max_tokens=2, logprobs=2,
                            echo=True)  # fmt: skip
    (choice,) = echoed["choices"]
    prompt_ids = await tokens_of(http, engine, "Hello world")
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][0] == "<|begin_of_text|>" and logprobs["top_logprobs"][0] is None
    assert len(logprobs["tokens"]) == len(prompt_ids) + 2
    check_completion_logprobs(logprobs, "".join(logprobs["tokens"]), 2)
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    for token_id, position in zip(prompt_ids[1:], prompt_logprobs[1:], strict=True):
        assert position[str(token_id)]["rank"] == 1

    asked = await complete(http, engine, prompt="Hello world", max_tokens=1, prompt_logprobs=3)
    (choice,) = asked["choices"]
    assert choice["logprobs"] is None  # prompt logprobs alone, without echo
    sizes = [None if position is None else len(position) for position in choice["prompt_logprobs"]]
    assert sizes == [None] + [3] * (len(prompt_ids) - 1)
    chatted = await chat(http, engine, max_tokens=1, prompt_logprobs=0)
    assert chatted["prompt_logprobs"][0] is None and len(chatted["prompt_logprobs"]) > 1

    body = {"prompt": "Hello world", "max_tokens": 4, "logprobs": 1}
    *deltas, _ = await stream(http, engine, "/v1/completions", body)
    offsets = [d["choices"][0]["logprobs"]["text_offset"][0] for d in deltas]
    whole = await complete(http, engine, prompt="Hello world", max_tokens=4, logprobs=1)
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


async def test_chat_logprobs_give_each_token_and_its_top_alternatives(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    answer = await chat(http, engine, max_tokens=3, logprobs=True, top_logprobs=2)
    (choice,) = answer["choices"]
    content = choice["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == choice["message"]["content"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert [t["token"] for t in entry["top_logprobs"]][:1] == [entry["token"]]
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(values) == 2 and values == sorted(values, reverse=True)
    bare = await chat(http, engine, max_tokens=3, logprobs=True)
    assert all(entry["top_logprobs"] == [] for entry in bare["choices"][0]["logprobs"]["content"])
    assert (await chat(http, engine, max_tokens=3))["choices"][0]["logprobs"] is None


async def test_a_request_without_model_is_the_base_model_and_answers_carry_its_name(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    status, answer = await post(http, f"{engine.url}/v1/completions",
                                {"prompt": "Hello world", "max_tokens": 2})  # fmt: skip
    assert status == 200 and answer["model"] == MODEL
    async with http.post(f"{engine.url}/v1/chat/completions",
                         json={"messages": USER, "max_tokens": 2}) as response:  # fmt: skip
        assert response.status == 200
        assert int(response.headers["Content-Length"]) == len(await response.read())
    status, answer = await post(http, f"{engine.url}/v1/completions",
                                {"model": "nope", "prompt": "x"})  # fmt: skip
    assert (status, answer["error"]["message"]) == (
        404,
        f"The model `nope` does not exist. Valid aliases: {MODEL}.",
    )


async def test_samples_share_their_prompts_blocks_and_cached_tokens_are_vllms(
    tmp_path: Path, model_dir: Path, http: aiohttp.ClientSession
) -> None:
    """``n`` samples are computed once: the first caches the prompt's blocks (one
    BlockStored), the others hit them in the same step; usage reports the last sample's,
    and ``vllm:request_params_n`` counts the request once.
    A list's usage reports its last prompt's; a request asking for prompt logprobs (echo
    with logprobs) reads no cache, as vLLM."""
    events_port = free_port()
    engine = start_engine(tmp_path, model_dir, events_port, "samples")
    try:
        with subscriber(f"tcp://127.0.0.1:{events_port}") as sub:
            answer = await complete(http, engine, prompt=LONG, n=3, max_tokens=2)
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
            _, events, _ = msgpack.unpackb(receive(sub)[2])
            assert [e["type"] for e in events] == ["BlockStored"]
            assert len(events[0]["block_hashes"]) == 3
            assert not sub.poll(200)
            # vLLM observes a prompt's n once, when its last sample ends
            n_count = await metric(http, engine.url, "vllm:request_params_n_count")
            assert (n_count, await metric(http, engine.url, "vllm:request_params_n_sum")) == (1, 3)

            other = list(range(300, 400))
            last_new = await complete(http, engine, prompt=[LONG, other], max_tokens=1)
            assert last_new["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            last_cached = await complete(http, engine, prompt=[other, LONG], max_tokens=1)
            assert last_cached["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
            echoed = await complete(http, engine, prompt=LONG, max_tokens=1, echo=True,
                                    logprobs=1)  # fmt: skip
            assert echoed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        engine.stop()


REFUSED = [
    ({"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
     "kv_transfer_params"),
    ({"prompt": ["x", "y"], "kv_transfer_params": {"do_remote_decode": True}},
     "kv_transfer_params"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), REFUSED)
async def test_what_the_simulator_cannot_do_is_a_plain_400(
    engine: EngineSim, http: aiohttp.ClientSession, body: dict[str, Any], param: str
) -> None:
    status, answer = await post(http, f"{engine.url}/v1/completions", {"model": MODEL, **body})
    assert status == 400 and answer["error"]["param"] == param
    assert answer["error"]["message"].startswith("the simulator does not support")


REFUSED_BY_REQUEST_MODEL = [
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": -2}),
    ("/v1/completions", {"prompt": "x", "logprobs": -2}),
]


async def test_render_refuses_what_generation_refuses(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """vLLM's request models check a body whichever route it came to: a scale-out render
    answers the same 400 as the generation route."""
    engine = EngineSim(tmp_path, "render", "--enable-scale-out")
    engine.wait_ready()
    try:
        for path, body in REFUSED_BY_REQUEST_MODEL:
            generated = await post(http, engine.url + path, body)
            assert generated[0] == 400, generated
            assert await post(http, f"{engine.url}{path}/render", body) == generated
    finally:
        engine.stop()


def test_the_fixture_is_the_capture_scripts() -> None:
    """The capture ran the script's requests, in its order (a stale fixture fails here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "capture", REPO / "scripts/capture-vllm-openai-options.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requests = [(c["name"], c["path"], c["body"]) for c in module.cases()]
    assert requests == [(c["name"], c["path"], c["body"]) for c in CASES]


async def test_a_client_gone_mid_stream_ends_every_choice_of_its_request(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    engine = EngineSim(tmp_path, "slow", time_scale=1.0)  # ~25 ms per decode step
    engine.wait_ready()
    try:
        body = {"prompt": ["one", "two"], "n": 3, "max_tokens": 1000, "stream": True}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{engine.url}/v1/completions", json=body) as response:
                assert response.status == 200
                await response.content.readline()  # the first chunk: every choice is running
                busy = await metric(http, engine.url, "vllm:num_requests_running")
                assert busy == 6
        idle = await eventually(
            lambda: metric(http, engine.url, "vllm:num_requests_running"), lambda n: n == 0
        )
        assert idle == 0
        assert await metric(http, engine.url, "vllm:kv_cache_usage_perc") == 0
    finally:
        engine.stop()


async def test_a_sample_that_meets_its_stop_string_ends_alone(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    """The stopped sample's engine request ends then (counted as a ``stop``, having generated
    fewer tokens than its length), the others run on to their length."""
    body = {"prompt": "A stop string for one sample", "n": 3, "max_tokens": 12}
    free = texts(await complete(http, engine, **body))
    third = len(free[0]) // 3
    stop = free[0][third : third + 3]  # in one of sample 0's first tokens, not its last
    assert all(stop not in text for text in free[1:])
    stopped = 'vllm:request_success_total{finished_reason="stop"}'
    generated = "vllm:request_generation_tokens_sum"
    before = [await metric(http, engine.url, name) for name in (stopped, generated)]
    answer = await complete(http, engine, **body, stop=[stop])
    finished = [(c["finish_reason"], c["stop_reason"]) for c in answer["choices"]]
    assert finished == [("stop", stop), ("length", None), ("length", None)]
    assert texts(answer) == [free[0].split(stop)[0], *free[1:]]
    after = [await metric(http, engine.url, name) for name in (stopped, generated)]
    assert after[0] == before[0] + 1
    assert 2 * 12 < after[1] - before[1] < 3 * 12
