"""The engine simulator as a process: its OpenAI API, and what a conductor learns from it.

Every simulator here is ``python -m publishers.engine`` on 127.0.0.1 with its KV events bound
on an ephemeral loopback port (``--sim-kv-bind``), usually registered with a real conductor
subprocess, so these tests exercise exactly what a router would see.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from publishers.engine.__main__ import (
    build_parser,
    check,
    connectable,
    default_num_gpu_blocks,
    max_num_batched_tokens,
    store_shape,
    timing_model,
)
from publishers.engine.timing import TimingModel
from publishers.mooncake_store import MIB, STORE_CONNECTOR, StoreAddress, connector_config
from tests.support.api import eventually, get, matched, post, query
from tests.support.processes import ConductorProcess, EngineSim, free_port

MODEL = "m"
BLOCK_SIZE = 4
LOOPBACK_EVENTS = json.dumps(
    {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
    }
)
PROMPT = "The quick brown fox jumps over the lazy dog, then naps."
TOKEN_KEYS = {"count", "max_model_len", "tokens", "token_strs"}


@pytest.fixture
def engine_factory(tmp_path: Path) -> Iterator[Callable[..., EngineSim]]:
    started: list[EngineSim] = []

    def start(instance_id: str, *args: str) -> EngineSim:
        engine = EngineSim(tmp_path, instance_id, *args)
        started.append(engine)
        engine.wait_ready()
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSim]:
    """For tests that leave no state behind: 32 blocks (128 tokens), max_model_len 256."""
    engine = EngineSim(
        tmp_path_factory.mktemp("engine"),
        "shared",
        "--num-gpu-blocks-override",
        "32",
        "--max-model-len",
        "256",
    )
    try:
        engine.wait_ready()
        yield engine
    finally:
        engine.stop()


def registered_engine(
    factory: Callable[..., EngineSim], conductor: ConductorProcess, instance_id: str, *args: str
) -> EngineSim:
    return factory(
        instance_id,
        "--kv-events-config",
        LOOPBACK_EVENTS,
        "--sim-kv-bind",
        "--sim-register-with",
        conductor.url,
        *args,
    )


async def service(http: aiohttp.ClientSession, conductor: ConductorProcess, instance_id: str):
    _, answer = await get(http, f"{conductor.url}/services")
    return next((s for s in answer["services"] if s["InstanceID"] == instance_id), None)


async def wait_subscribed(
    http: aiohttp.ClientSession, conductor: ConductorProcess, instance_id: str
) -> dict[str, Any]:
    """Until the conductor's SUB socket is connected to the engine (no slow-joiner loss)."""
    entry = await eventually(
        lambda: service(http, conductor, instance_id),
        lambda entry: entry is not None and entry["State"] == "connected",
    )
    await asyncio.sleep(0.1)  # the subscription itself travels after the TCP connect
    return entry


async def tokenize(http: aiohttp.ClientSession, engine: EngineSim, **body: Any) -> list[int]:
    status, answer = await post(http, f"{engine.url}/tokenize", {"model": MODEL, **body})
    assert status == 200, answer
    return answer["tokens"]


async def complete(http: aiohttp.ClientSession, engine: EngineSim, **body: Any) -> dict:
    status, answer = await post(http, f"{engine.url}/v1/completions", {"model": MODEL, **body})
    assert status == 200, answer
    return answer


async def metrics(http: aiohttp.ClientSession, engine: EngineSim) -> dict[str, float]:
    """Unlabelled view of the engine's Prometheus samples: name -> value."""
    async with http.get(f"{engine.url}/metrics") as response:
        text = await response.text()
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-z_:]+)(?:\{[^}]*\})? (\S+)", line)
        if match:
            samples[match[1]] = float(match[2])
    return samples


async def read_log(engine: EngineSim) -> str:
    return engine.log()


def parse_sse(raw: str) -> list[dict[str, Any]]:
    """Every event must be ``data: <json>``; the stream ends with ``data: [DONE]``."""
    events = raw.split("\n\n")
    assert events[-1] == "", "the stream must end with a blank line"
    payloads = [event.removeprefix("data: ") for event in events[:-1]]
    assert all(event.startswith("data: ") for event in events[:-1])
    assert payloads[-1] == "[DONE]"
    return [json.loads(payload) for payload in payloads[:-1]]


def check_usage(usage: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> None:
    assert usage == usage | {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < prompt_tokens


# -- what the conductor learns ------------------------------------------------------------


async def test_a_served_prompt_is_indexed_then_evicted_then_cleared(
    conductor: ConductorProcess,
    engine_factory: Callable[..., EngineSim],
    http: aiohttp.ClientSession,
) -> None:
    engine = registered_engine(
        engine_factory, conductor, "sim-a", "--num-gpu-blocks-override", "16"
    )  # 64 tokens
    await wait_subscribed(http, conductor, "sim-a")
    base = conductor.url

    tokens = await tokenize(http, engine, prompt=PROMPT)
    full = len(tokens) // BLOCK_SIZE * BLOCK_SIZE
    assert full >= 2 * BLOCK_SIZE
    await complete(http, engine, prompt=PROMPT, max_tokens=2)
    await eventually(lambda: matched(http, base, tokens, "sim-a"), lambda n: n == full)

    other = list(range(5000, 5062))  # with 2 generated tokens it needs all 16 blocks
    await complete(http, engine, prompt=other, max_tokens=2)
    await eventually(lambda: matched(http, base, tokens, "sim-a"), lambda n: n == 0)
    assert await matched(http, base, other, "sim-a") == 60

    async with http.post(f"{engine.url}/reset_prefix_cache") as response:
        assert response.status == 200
    await eventually(lambda: matched(http, base, other, "sim-a"), lambda n: n == 0)


async def test_evicted_blocks_stay_loadable_from_the_cpu_tier(
    conductor: ConductorProcess,
    engine_factory: Callable[..., EngineSim],
    http: aiohttp.ClientSession,
) -> None:
    engine = registered_engine(
        engine_factory,
        conductor,
        "sim-cpu",
        "--num-gpu-blocks-override",
        "16",
        "--sim-cpu-offload-blocks",
        "32",
    )
    await wait_subscribed(http, conductor, "sim-cpu")
    first = list(range(1000, 1020))  # 5 blocks
    await complete(http, engine, prompt=first, max_tokens=1)
    await complete(http, engine, prompt=list(range(5000, 5062)), max_tokens=2)  # all 16 blocks

    async def tiers() -> tuple[int, int]:
        entry = (await query(http, conductor.url, first))["default"]["sim-cpu"]
        return entry["GPU"], entry["CPU"]

    await eventually(tiers, lambda gpu_cpu: gpu_cpu == (0, 20))
    again = await complete(http, engine, prompt=first, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # 19 tokens, 4 blocks
    assert (await metrics(http, engine))["sim_cpu_prefix_cache_hits_total"] == 16


async def test_the_engine_registers_itself_retrying_and_unregisters_on_shutdown(
    tmp_path: Path, engine_factory: Callable[..., EngineSim], http: aiohttp.ClientSession
) -> None:
    port = free_port()  # no conductor there yet
    engine = engine_factory(
        "sim-late",
        "--kv-events-config",
        LOOPBACK_EVENTS,
        "--sim-kv-bind",
        "--sim-register-with",
        f"http://127.0.0.1:{port}",
    )
    await eventually(lambda: read_log(engine), lambda log: "unreachable" in log)
    url = rf"http://127\.0\.0\.1:{port}"
    refused = rf"conductor unreachable url={url} error=ClientConnectorError: [^<>]*refused$"
    assert re.search(refused, engine.log(), re.MULTILINE), engine.log()  # no repr
    conductor = ConductorProcess(tmp_path, port=port)
    try:
        conductor.wait_ready()
        entry = await wait_subscribed(http, conductor, "sim-late")
        assert re.fullmatch(r"tcp://127\.0\.0\.1:[1-9]\d*", entry["Endpoint"])
        assert re.fullmatch(r"tcp://127\.0\.0\.1:[1-9]\d*", entry["ReplayEndpoint"])
        assert (entry["Type"], entry["ModelName"], entry["BlockSize"], entry["DPRank"]) == (
            "vLLM",
            MODEL,
            BLOCK_SIZE,
            0,
        )
        assert engine.stop() < 2.0
        assert await service(http, conductor, "sim-late") is None
        assert "unregistered status=200" in engine.log()
    finally:
        conductor.stop()


# -- OpenAI shapes ------------------------------------------------------------------------


async def test_completions_as_json_and_as_server_sent_events(
    shared_engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    url = f"{shared_engine.url}/v1/completions"
    prompt_tokens = len(await tokenize(http, shared_engine, prompt=PROMPT))
    async with http.post(url, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5}) as r:
        assert r.status == 200
        assert r.headers["x-engine-instance-id"] == "shared"
        assert float(r.headers["x-engine-ttft-ms"]) > 0
        answer = await r.json()
    # every key and JSON type is pinned against real vLLM in test_engine_vllm_parity
    assert answer["id"].startswith("cmpl-") and answer["object"] == "text_completion"
    assert answer["model"] == MODEL and isinstance(answer["created"], int)
    assert answer["kv_transfer_params"] is None
    [choice] = answer["choices"]
    assert (choice["index"], choice["finish_reason"], choice["stop_reason"]) == (0, "length", None)
    assert len(choice["text"].split()) == 5  # every generated token decodes to one word
    check_usage(answer["usage"], prompt_tokens, 5)

    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with http.post(url, json={"model": MODEL, **body}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        assert "x-engine-ttft-ms" in r.headers
        chunks = parse_sse(await r.text())
    *texts, usage = chunks
    assert len(texts) == 5 and usage["choices"] == []
    check_usage(usage["usage"], prompt_tokens, 5)
    for chunk in chunks:
        assert chunk["id"] == chunks[0]["id"] and chunk["object"] == "text_completion"
    assert "".join(c["choices"][0]["text"] for c in texts) == choice["text"]  # deterministic
    assert [c["choices"][0]["finish_reason"] for c in texts] == [None] * 4 + ["length"]

    stop = choice["text"].split(" ")[3]  # the third generated word
    stopped = await complete(http, shared_engine, prompt=PROMPT, max_tokens=5, stop=[stop])
    [choice] = stopped["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
    assert choice["text"] == answer["choices"][0]["text"].split(stop)[0]


async def test_chat_completions_as_json_and_as_server_sent_events(
    shared_engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    url = f"{shared_engine.url}/v1/chat/completions"
    messages = [{"role": "user", "content": PROMPT}]
    prompt_tokens = len(await tokenize(http, shared_engine, messages=messages))
    status, answer = await post(http, url, {"model": MODEL, "messages": messages, "max_tokens": 3})
    assert status == 200, answer
    assert answer["id"].startswith("chatcmpl-") and answer["object"] == "chat.completion"
    [choice] = answer["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 3
    assert (choice["index"], choice["finish_reason"], choice["logprobs"]) == (0, "length", None)
    check_usage(answer["usage"], prompt_tokens, 3)

    body = {"model": MODEL, "messages": messages, "max_completion_tokens": 3, "stream": True}
    async with http.post(url, json=body) as r:
        assert r.status == 200
        chunks = parse_sse(await r.text())
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(delta["content"] for delta in deltas) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_tokenize_and_models(shared_engine: EngineSim, http: aiohttp.ClientSession) -> None:
    url = f"{shared_engine.url}/tokenize"
    status, answer = await post(http, url, {"model": MODEL, "prompt": PROMPT})
    assert status == 200 and set(answer) == TOKEN_KEYS
    assert answer["count"] == len(answer["tokens"]) > 0
    assert (answer["max_model_len"], answer["token_strs"]) == (256, None)
    # a router tokenizes a copy of the whole request: extra fields are ignored
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, answer = await post(http, url, chat)
    chatml = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert status == 200 and answer["tokens"] == await tokenize(http, shared_engine, prompt=chatml)
    assert await tokenize(http, shared_engine, prompt=[7, 8, 9]) == [7, 8, 9]

    status, models = await get(http, f"{shared_engine.url}/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
        (MODEL, "model", 256)
    ]
    async with http.get(f"{shared_engine.url}/health") as response:
        assert response.status == 200


USER = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    ("/v1/completions", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [151_936]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 250, "max_tokens": 10}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 150, "max_tokens": 10}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": "16"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 2, "temperature": 0}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "n": 0}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", [1]]}, 400, "prompt"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "a", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stream": "yes"}, 400, "stream"),
    (
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "a",
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": True},
        },
        400,
        "kv_transfer_params",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "top_logprobs": 1},
        400,
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
    ),
    ("/v1/chat/completions", {"model": "nope", "messages": USER}, 404, "model"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": USER}, 400, "body"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/sim/kv_transfer/release", {"remote_request_id": "unknown"}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
async def test_bad_input_gets_an_openai_error(
    shared_engine: EngineSim,
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    status: int,
    param: str | None,
) -> None:
    got, answer = await post(http, f"{shared_engine.url}{path}", body)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


async def test_malformed_json_is_a_bad_request(
    shared_engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{shared_engine.url}/v1/completions", data=b"{") as response:
        assert response.status == 400
        assert (await response.json())["error"]["type"] == "BadRequestError"


# -- load and disaggregation --------------------------------------------------------------


async def test_metrics_show_the_queue_and_a_disconnect_frees_its_request(
    engine_factory: Callable[..., EngineSim], http: aiohttp.ClientSession
) -> None:
    engine = engine_factory("sim-busy", "--max-num-seqs", "1", "--sim-time-scale", "1")
    body = {"model": MODEL, "max_tokens": 1000}  # 1000 decode steps of ~25 ms: never done here

    async def generate(clients: aiohttp.ClientSession, prompt: str) -> None:
        async with clients.post(f"{engine.url}/v1/completions", json=body | {"prompt": prompt}):
            pass

    async with aiohttp.ClientSession() as clients:
        requests = [asyncio.create_task(generate(clients, p)) for p in ("one", "two", "three")]
        busy = await eventually(
            lambda: metrics(http, engine),
            lambda m: m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 2,
        )
        assert busy["vllm:kv_cache_usage_perc"] > 0
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
    idle = await eventually(
        lambda: metrics(http, engine),
        lambda m: m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0,
    )
    assert idle["vllm:kv_cache_usage_perc"] == 0
    assert idle["vllm:prefix_cache_queries_total"] > 0
    assert idle["vllm:time_to_first_token_seconds_count"] >= 1


async def test_prefill_then_decode_hand_over_through_kv_transfer_params(
    engine_factory: Callable[..., EngineSim], http: aiohttp.ClientSession
) -> None:
    prefill = engine_factory("sim-prefill")
    decode = engine_factory("sim-decode")
    prompt = PROMPT * 8
    prompt_tokens = len(await tokenize(http, prefill, prompt=prompt))
    proxy_params = {  # what the upstream proxy sends a prefill
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "stream": False}
    async with http.post(
        f"{prefill.url}/v1/completions", json=body | {"kv_transfer_params": proxy_params}
    ) as response:
        assert response.status == 200
        prefill_ttft = float(response.headers["x-engine-ttft-ms"])
        first = await response.json()
    assert first["usage"]["completion_tokens"] == 1
    params = first["kv_transfer_params"]
    assert params == params | {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "sim-prefill",
        "remote_host": "127.0.0.1",
        "remote_port": prefill.port,
        "tp_size": 1,
    }
    assert len(params["remote_block_ids"]) == prompt_tokens // BLOCK_SIZE
    assert (await metrics(http, prefill))["sim_kv_transfer_held_requests"] == 1
    async with http.post(f"{prefill.url}/reset_prefix_cache") as response:
        assert response.status == 409  # the held blocks are in use

    async with http.post(
        f"{decode.url}/v1/completions", json=body | {"kv_transfer_params": params}
    ) as response:
        assert response.status == 200
        decode_ttft = float(response.headers["x-engine-ttft-ms"])
        second = await response.json()
    assert second["usage"]["completion_tokens"] == 10
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens
    assert second["choices"][0]["text"].startswith(first["choices"][0]["text"])
    assert decode_ttft < prefill_ttft / 10  # loading the KV beats computing it
    await eventually(
        lambda: metrics(http, prefill), lambda m: m["sim_kv_transfer_held_requests"] == 0
    )
    async with http.post(f"{prefill.url}/reset_prefix_cache") as response:
        assert response.status == 200


# -- command line -------------------------------------------------------------------------


def parse(*argv: str) -> Any:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(args, parser)
    return args


def test_a_taken_port_is_one_line_and_exit_1() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "publishers.engine", "--host", "127.0.0.1"]
        result = subprocess.run(
            [*command, "--port", str(port)], capture_output=True, text=True, timeout=30
        )
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        f"mooncake-engine-sim: cannot listen on 127.0.0.1:{port}: address already in use\n"
    )


def test_timing_flags_default_to_the_timing_model_and_take_milliseconds() -> None:
    assert timing_model(parse()) == TimingModel()
    flags = ("--sim-prefill-overhead-ms", "5", "--sim-mfu", "0.3", "--sim-num-layers", "32")
    assert timing_model(parse(*flags)) == TimingModel(
        prefill_overhead_s=0.005, mfu=0.3, num_layers=32
    )


def test_the_default_pool_is_what_hbm_leaves_after_the_weights() -> None:
    # (8 x 80 GB x 0.9 - 141 GB of weights) / (320 KiB per token x 16 tokens per block)
    assert default_num_gpu_blocks(parse(), TimingModel()) == 82_969
    assert default_num_gpu_blocks(parse("--block-size", "32"), TimingModel()) == 41_484


@pytest.mark.parametrize(
    ("bound", "host", "expected"),
    [
        ("tcp://0.0.0.0:5557", "10.1.2.3", "tcp://10.1.2.3:5557"),
        ("tcp://[::]:5558", "10.1.2.3", "tcp://10.1.2.3:5558"),
        ("tcp://0.0.0.0:5557", "fd00::7", "tcp://[fd00::7]:5557"),
        ("tcp://127.0.0.1:5557", "10.1.2.3", "tcp://127.0.0.1:5557"),
        ("ipc:///tmp/kv", "10.1.2.3", "ipc:///tmp/kv"),
    ],
)
def test_a_wildcard_bind_registers_as_the_advertised_host(
    bound: str, host: str, expected: str
) -> None:
    assert connectable(bound, host) == expected


def test_kv_events_config_follows_vllm() -> None:
    assert not parse().kv_events_config.enabled
    assert parse("--kv-events-config", '{"enable_kv_cache_events": true}').kv_events_config.enabled
    disabled = '{"enable_kv_cache_events": true, "publisher": "null"}'
    assert not parse("--kv-events-config", disabled).kv_events_config.enabled
    with pytest.raises(SystemExit):
        parse("--kv-events-config", '{"enable_kv_cache_events": true, "endpoit": "tcp://*:1"}')


def test_registration_needs_a_stream_a_conductor_can_subscribe_to() -> None:
    register = ("--sim-register-with", "http://127.0.0.1:13333")
    connecting = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}'
    with pytest.raises(SystemExit):
        parse(*register)  # no events at all
    with pytest.raises(SystemExit):
        parse(*register, "--kv-events-config", connecting)  # vLLM's rule: the PUB connects
    parse(*register, "--kv-events-config", connecting, "--sim-kv-bind")
    parse(*register, "--kv-events-config", '{"enable_kv_cache_events": true}')  # tcp://*:5557


def test_the_token_budget_follows_vllm() -> None:
    assert max_num_batched_tokens(parse()) == 2048  # vLLM's API server on CPU
    assert parse().enable_chunked_prefill and not parse().enable_scale_out
    assert max_num_batched_tokens(parse("--max-num-batched-tokens", "512")) == 512
    unchunked = parse("--no-enable-chunked-prefill", "--max-model-len", "8192")
    assert max_num_batched_tokens(unchunked) == 8192  # any prompt must fit one step
    with pytest.raises(SystemExit):
        parse("--no-enable-chunked-prefill", "--max-num-batched-tokens", "512")
    with pytest.raises(SystemExit):
        parse("--max-num-batched-tokens", "0")


@pytest.mark.needs("store-wheel")
def test_a_store_connector_takes_vllms_flag_and_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    connector = json.dumps(STORE_CONNECTOR)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    assert parse().mooncake_config is None
    with pytest.raises(SystemExit):
        parse("--kv-transfer-config", connector)  # vLLM's rule: the file must be named
    for wrong in (
        STORE_CONNECTOR | {"kv_connector": "NixlConnector"},  # the simulator has one connector
        STORE_CONNECTOR | {"kv_role": "kv_everything"},
        STORE_CONNECTOR | {"kv_rnak": 0},
    ):
        with pytest.raises(SystemExit):
            parse("--kv-transfer-config", json.dumps(wrong))

    address = StoreAddress("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps(connector_config(address, 64 * MIB)))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    args = parse("--kv-transfer-config", connector, "--block-size", "32")
    assert args.mooncake_config.address == address
    assert store_shape(args).nbytes == 32 << 10  # the tiny model's block: 2 x 2 x 2 x 32 x 32
    with pytest.raises(SystemExit):
        parse("--kv-transfer-config", connector, "--sim-store-layers", "0")
