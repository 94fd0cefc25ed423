"""LoRA adapters in the simulator: vLLM's flags, cards, block hashes, KV events and limits.

``tests/fixtures/vllm_lora_frames.json`` (``scripts/capture-vllm-lora-frames.py``) holds a
real vLLM 0.32's KV-event frames and usage for token-id prompts on its adapter ``tiny-sql``
and on its base model, one at a time. The simulator, started with the same flags (the
adapter's path string included: vLLM hashes it into every adapter block), PYTHONHASHSEED
and block size, gets the same requests (a salted one on the adapter too): the same cached
tokens, and the same frames field by field, hashes included, but the one field vLLM 0.32
adds to GPU events (the simulator publishes vLLM 0.33's, as
``tests/store/test_sim_store.py`` explains). An adapter and the base model never share a
block, nor do two adapters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from publishers.engine.block_hash import BlockHasher, LoraAdapter, event_hash
from publishers.engine.block_manager import BlockManager
from publishers.engine.scheduler import EngineRequest, Scheduler
from publishers.engine.timing import TimingModel
from tests.publishers.engine.test_engine_server import parse
from tests.publishers.test_publisher import receive, subscriber
from tests.support.api import get, post
from tests.support.processes import REPO, EngineSim, free_port

CAPTURE = json.loads((REPO / "tests/fixtures/vllm_lora_frames.json").read_text())
ADAPTER = LoraAdapter(CAPTURE["lora"]["name"], CAPTURE["lora"]["lora_id"], CAPTURE["lora"]["path"])
BASE = CAPTURE["base_model"]
BLOCK = CAPTURE["block_size"]
ONLY_IN_VLLM_032 = "kv_cache_spec_kind"


def start_engine(
    log_dir: Path, name: str, events_port: int, *args: str, adapters: tuple[str, ...] = ()
) -> EngineSim:
    """The capture's engine (model path ``MODEL_DIR``, as the capture names it), events on
    ``events_port``, more flags in ``args`` and more ``--lora-modules`` in ``adapters``."""
    events = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{events_port}",
        "topic": "kv-events",
    }
    engine = EngineSim(
        log_dir,
        name,
        "MODEL_DIR",
        "--max-model-len",
        "2048",
        "--kv-events-config",
        json.dumps(events),
        "--sim-kv-bind",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        *args,
        "--lora-modules",
        f"{ADAPTER.name}={ADAPTER.path}",
        *adapters,
        model=BASE,
        block_size=BLOCK,
        env={"PYTHONHASHSEED": CAPTURE["python_hash_seed"]},
    )
    engine.wait_ready()
    return engine


@pytest.fixture
def events_port() -> int:
    return free_port()


@pytest.fixture
def engine(tmp_path: Path, events_port: int) -> Iterator[EngineSim]:
    started = start_engine(tmp_path, "lora", events_port)
    yield started
    started.stop()


async def complete(
    http: aiohttp.ClientSession, engine: EngineSim, model: str, prompt: list[int], **body: Any
) -> dict[str, Any]:
    request = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **body}
    status, answer = await post(http, f"{engine.url}/v1/completions", request)
    assert status == 200, answer
    return answer


def cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def comparable(payload: bytes) -> tuple[list[list[tuple[str, Any]]], int]:
    """A batch's events field by field (without vLLM 0.32's extra field), and its DP rank."""
    _, events, rank = msgpack.unpackb(payload)
    return [[(k, v) for k, v in e.items() if k != ONLY_IN_VLLM_032] for e in events], rank


def captured_events(frame: dict[str, Any]) -> tuple[list[list[tuple[str, Any]]], int]:
    return comparable(bytes.fromhex(frame["payload"]))


def test_adapter_blocks_hash_as_vllm_hashed_them() -> None:
    """Every block the capture stored: an adapter's chain is keyed by its name and path
    from the first block on; the base model's is not."""
    hasher = BlockHasher(CAPTURE["hash_algorithm"], CAPTURE["python_hash_seed"])
    for step in CAPTURE["steps"]:
        lora = ADAPTER if step["model"] == ADAPTER.name else None
        salt = step.get("cache_salt")
        digests = hasher.block_digests(step["prompt"], BLOCK, lora=lora, cache_salt=salt)
        chain = [event_hash(digest) for digest in digests]
        for frame in step["frames"]:
            for event in frame["decoded"][1]:
                hashes = event["block_hashes"]
                start = chain.index(hashes[0])
                assert chain[start : start + len(hashes)] == hashes
                assert event["parent_block_hash"] == (chain[start - 1] if start else None)


async def test_an_adapter_and_its_base_model_cache_and_publish_as_real_vllm(
    engine: EngineSim, events_port: int, http: aiohttp.ClientSession
) -> None:
    with subscriber(f"tcp://127.0.0.1:{events_port}") as sub:
        for number, step in enumerate(CAPTURE["steps"]):
            salt = {"cache_salt": step["cache_salt"]} if "cache_salt" in step else {}
            answer = await complete(http, engine, step["model"], step["prompt"], **salt)
            assert cached(answer) == cached(step), number
            assert answer["model"] == step["model"]
            for frame in step["frames"]:
                topic, seq, payload = receive(sub)
                assert (topic.decode(), int.from_bytes(seq, "big")) == (
                    frame["topic"],
                    frame["seq"],
                ), number
                assert comparable(payload) == captured_events(frame), number
        assert not sub.poll(300), "a KV-event batch vLLM did not publish"


async def test_models_lists_the_base_model_then_each_adapter_as_vllm(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    status, models = await get(http, f"{engine.url}/v1/models")
    assert status == 200
    cards = [{key: card[key] for key in ("id", "root", "parent")} for card in models["data"]]
    assert cards == CAPTURE["models"]
    assert [card["max_model_len"] for card in models["data"]] == [2048, None]
    assert all(card["owned_by"] == "vllm" and card["permission"] for card in models["data"])
    status, tokens = await post(
        http, f"{engine.url}/tokenize", {"model": ADAPTER.name, "prompt": "Hello"}
    )  # the same tokenizer for an adapter
    assert status == 200 and tokens["tokens"]


async def test_adapters_never_share_blocks_with_each_other_or_the_base_model(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The same prompt cached by the base model, then on each of two adapters, is computed
    three times; each then hits its own blocks. A salted adapter request keys its first
    block with the name and the salt, and publishes both, untagged, as vLLM."""
    events_port = free_port()
    other = LoraAdapter("other", 2, "/adapters/other")
    module = json.dumps({"name": other.name, "path": other.path})
    engine = start_engine(tmp_path, "two", events_port, "--max-loras", "2", adapters=(module,))
    prompt = list(range(500, 600))
    hasher = BlockHasher(CAPTURE["hash_algorithm"], CAPTURE["python_hash_seed"])
    try:
        for model in (BASE, ADAPTER.name, other.name):
            assert cached(await complete(http, engine, model, prompt)) == 0, model
        for model in (BASE, ADAPTER.name, other.name):
            assert cached(await complete(http, engine, model, prompt)) == 96, model

        with subscriber(f"tcp://127.0.0.1:{events_port}") as sub:
            await complete(http, engine, other.name, prompt, cache_salt="tenant")
            _, events, _ = msgpack.unpackb(receive(sub)[2])
        (stored,) = events
        digests = hasher.block_digests(prompt, BLOCK, lora=other, cache_salt="tenant")
        assert stored["block_hashes"] == [event_hash(digest) for digest in digests]
        assert (stored["lora_id"], stored["lora_name"]) == (2, other.name)
        assert stored["extra_keys"] == [[other.name, "tenant"], [other.name], [other.name]]
    finally:
        engine.stop()


async def test_lora_requests_info_names_the_adapters_an_engine_runs(
    engine: EngineSim, http: aiohttp.ClientSession
) -> None:
    """vLLM's gauge, labelled with the adapters that had requests (none once idle) and
    ``max_lora``; every other family stays labelled with the base model's name only."""
    await complete(http, engine, ADAPTER.name, list(range(10, 50)), max_tokens=2)
    await complete(http, engine, BASE, list(range(10, 50)), max_tokens=2)
    async with http.get(f"{engine.url}/metrics") as response:
        text = await response.text()
    info = re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", text, re.MULTILINE)
    labels = [dict(re.findall(r'(\w+)="([^"]*)"', series)) for series, _ in info]
    assert {"max_lora": "1", "waiting_lora_adapters": ADAPTER.name,
            "running_lora_adapters": ADAPTER.name} in labels  # fmt: skip
    assert all(float(value) > 1e9 for _, value in info)  # a Unix time, as vLLM's
    names = set(re.findall(r'model_name="([^"]*)"', text))
    assert names == {BASE}


def adapter_request(name: str, adapter: LoraAdapter | None, start: int) -> EngineRequest:
    return EngineRequest(name, list(range(start, start + 8)), 4, lora=adapter)


def test_a_step_runs_at_most_max_loras_adapters_and_the_base_model_is_free() -> None:
    """vLLM's rule: an adapter request that would make the step's adapters more than
    ``max_loras`` waits, keeping its place; requests behind it (the base model's, or the
    same adapter's) are admitted meanwhile."""
    first, second = LoraAdapter("a", 1, "/a"), LoraAdapter("b", 2, "/b")
    engine = Scheduler(BlockManager(64, 4), TimingModel(), num_ordinary_tokens=1000,
                       max_loras=1)  # fmt: skip
    requests = [
        adapter_request("a1", first, 0),
        adapter_request("b1", second, 100),
        adapter_request("base", None, 200),
        adapter_request("a2", first, 300),
    ]
    for request in requests:
        engine.add(request)
    plan = engine.plan_step()
    assert plan is not None
    assert [r.request_id for r in plan.admitted] == ["a1", "base", "a2"]
    assert [r.request_id for r in engine.waiting] == ["b1"]
    while engine.waiting:
        plan = engine.plan_step()
        assert plan is not None
        engine.complete_step(plan)
    assert requests[1].scheduled_time is not None
    assert requests[1].scheduled_time >= max(r.finish_time or 0 for r in requests[::2])


def test_lora_flags_are_vllms() -> None:
    args = parse("--enable-lora", "--lora-modules", "sql=/loras/sql",
                 '{"name": "chat", "path": "/loras/chat", "base_model_name": "m"}')  # fmt: skip
    assert args.max_loras == 1 and args.max_lora_rank == 16
    refused = [
        ("--lora-modules", "sql=/loras/sql"),  # without --enable-lora
        ("--enable-lora", "--lora-modules", "sql=/a", "sql=/b"),  # loaded twice
        ("--served-model-name", "m", "--enable-lora", "--lora-modules", "m=/a"),  # a base name
        ("--enable-lora", "--lora-modules", '{"name": "x"}'),  # no path
        ("--enable-lora", "--lora-modules", "{not json"),
        ("--enable-lora", "--max-lora-rank", "7"),
        ("--enable-lora", "--max-loras", "0"),
        ("--sim-engine", "sglang", "--enable-lora", "--lora-modules", "sql=/a"),
    ]
    for argv in refused:
        with pytest.raises(SystemExit):
            parse(*argv)
